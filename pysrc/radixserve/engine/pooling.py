"""Pooling requests (--is-embedding): a prompt that is only prefilled, and what comes back
instead of tokens: a pooled hidden state (an embedding), and for a reranker the logits of a
few label tokens ("yes" / "no") at the prompt's last position.

A pooling request (GenerateReqInput.pool / Req.pool set to a PoolParams) runs through the
scheduler like any prompt (admission, chunked prefill, the radix cache) with
max_new_tokens 0: it is never decoded. Each extend step of it asks the runner for a span of
its rows (StepInput.pool_starts / pool_counts): the final-norm hidden states of those rows,
summed. With last-token pooling the span is the prompt's last token, in the step that ends
the prompt (earlier chunks only fill the KV cache); with mean pooling it is every token of
each chunk, summed here across chunks (PoolState). The step that ends the prompt also asks
for the logits of the label tokens at the last position (StepInput.pool_labels). Then
ResultProcessor finishes the request: its KV is published to the prefix cache and freed like
any finished request's, and its one GenerateOutput carries the embedding (truncated to
`dimensions`, then L2-normalised) and the label logits.

The prefix contract: last-token pooling (and reranking, which pools the last token too)
takes a cached prefix as generation does (every token but the last may come from the radix
cache: the last one is always computed, and its hidden state attends over the cached KV);
mean pooling needs every token's hidden state, so it never takes a cached prefix
(Req.max_prefix_len() is 0: it prefills from position 0), though it still publishes its KV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

POOLING_METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolParams:
    """What a pooling request returns. method: "last" (the last token's final-norm hidden
    state) or "mean" (the mean over every prompt token); dimensions: keep the first N values
    (Matryoshka truncation; None: all); normalize: L2-normalise after truncating; label_ids:
    token ids whose logits at the last position come back too (a reranker's yes / no)."""
    method: str = "last"
    normalize: bool = True
    dimensions: Optional[int] = None
    label_ids: Tuple[int, ...] = ()

    @property
    def takes_prefix(self) -> bool:
        """Whether a cached prefix may stand in for computed tokens (see the module doc)."""
        return self.method != "mean"

    def span(self, n: int, final: bool) -> Optional[Tuple[int, int]]:
        """The rows of an extend of n tokens (final: it ends the prompt) this request pools, as
        (offset in the extend, count), or None (a chunk before the last, for last pooling)."""
        if self.method == "mean":
            return (0, n)
        return (n - 1, 1) if final else None


class PoolState:
    """A pooling request's running sum over its pooled rows (mean pooling adds one span per
    chunk) and the label logits of its last position."""

    def __init__(self):
        self.total: Optional[torch.Tensor] = None     # [hidden] float32 CPU
        self.count = 0
        self.label_logits: List[float] = []

    def add(self, start: int, row: torch.Tensor, count: int, labels: List[float]) -> None:
        """One span's sum (row [hidden] float32) over `count` tokens starting at prompt
        position `start`. A span from position 0 starts the sum over (a request retracted
        mid-prompt recomputes its prompt from the start)."""
        if start == 0 or self.total is None:
            self.total, self.count = row.clone(), 0
        else:
            self.total += row
        self.count += count
        if labels:
            self.label_logits = list(labels)

    def finite(self) -> bool:
        if self.total is not None and not bool(torch.isfinite(self.total).all()):
            return False
        return all(v == v and abs(v) != float("inf") for v in self.label_logits)

    def embedding(self, params: PoolParams) -> List[float]:
        """The request's embedding: the sum's mean (mean pooling) or the last token's state,
        truncated to params.dimensions, then L2-normalised when params.normalize ([] before
        any span was added)."""
        if self.total is None:
            return []
        vec = self.total / max(self.count, 1) if params.method == "mean" else self.total
        return embedding_values(vec, params.dimensions, params.normalize)


def embedding_values(vec: torch.Tensor, dimensions: Optional[int], normalize: bool) -> List[float]:
    """vec [hidden] -> its first `dimensions` values (all for None), L2-normalised (in float32,
    a zero vector stays zero) when `normalize`, as floats."""
    vec = vec.float()
    if dimensions is not None:
        vec = vec[:dimensions]
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    return vec.tolist()


# --------------------------------------------------------------------------- server settings

def sentence_transformers_pooling(model_path: str) -> Optional[str]:
    """The pooling a sentence-transformers model directory declares (modules.json naming a
    Pooling module, whose config.json sets pooling_mode_*): "last", "mean", another mode's
    name ("cls", "max", ...), or None when the directory has no such config."""
    import json
    import os

    try:
        with open(os.path.join(model_path, "modules.json")) as f:
            modules = json.load(f)
        pooling = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        with open(os.path.join(model_path, pooling.get("path", ""), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    modes = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
             "pooling_mode_weightedmean_tokens": "weightedmean"}
    on = [name for key, name in modes.items() if config.get(key)]
    return on[0] if len(on) == 1 else ("+".join(on) if on else None)


def resolve_pooling_method(flag: str, model_path: str) -> str:
    """--pooling-method: last or mean as given; auto: the model's sentence-transformers pooling
    when it declares one, else last. ValueError naming the flag for a declared pooling this
    server does not compute."""
    if flag != "auto":
        return flag
    declared = sentence_transformers_pooling(model_path)
    if declared is None:
        return "last"
    if declared not in POOLING_METHODS:
        raise ValueError(f"the model's sentence-transformers config pools with {declared!r}, "
                         f"which is not implemented (last and mean are); pass --pooling-method "
                         f"last or mean to choose one")
    return declared


def rerank_label_ids(tokenizer: Any, override: Optional[Tuple[int, int]], vocab_size: int
                     ) -> Tuple[Optional[Tuple[int, int]], Optional[str]]:
    """The (yes, no) token ids a reranker's score reads, and None or why there are none:
    --rerank-token-ids (checked against the vocabulary), else the tokenizer's single tokens
    "yes" and "no" (Qwen3-Reranker's)."""
    if override is not None:
        bad = [t for t in override if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"--rerank-token-ids {bad[0]} is outside the vocabulary "
                             f"[0, {vocab_size})")
        return override, None
    ids = []
    for word in ("yes", "no"):
        enc = tokenizer.encode(word, add_special_tokens=False) if tokenizer is not None else []
        if len(enc) != 1 or not 0 <= enc[0] < vocab_size:
            return None, (f"the tokenizer has no single token {word!r} (it encodes as {enc}); "
                          f"start the server with --rerank-token-ids YES,NO")
        ids.append(enc[0])
    return (ids[0], ids[1]), None
