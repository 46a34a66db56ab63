"""The engine's request and output types: what the server (and the offline Engine) hand to
AsyncEngine.generate and what comes back, one GenerateOutput per step that produced text; and
expand_requests, the one place a request's prompts x n become those sequences (the HTTP routes
and the offline Engine both call it, so n means the same everywhere)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from radixserve.engine.pooling import PoolParams
from radixserve.sampling.params import SamplingParams

# One logprob entry: (logprob, token_id, token_text or None)
LogprobEntry = Tuple[float, int, Optional[str]]


@dataclass
class GenerateReqInput:
    """One sequence to generate (expand_requests turns batches and n>1 into several of these)."""
    rid: str
    input_ids: List[int]                      # already tokenized (templates applied upstream)
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1               # -1: no prompt logprobs; k: prompt positions >= k
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    client_id: Optional[str] = None           # who sent it (fairness: --max-running-requests-per-client)
    cache_salt: Optional[str] = None          # prefix sharing only among requests of the same salt
    # a pooling request (--is-embedding, engine/pooling.py): prefilled only, never decoded
    # (sampling_params.max_new_tokens 0); its last output carries embedding / label_logits
    pool: Optional[PoolParams] = None
    priority: Optional[int] = None            # --enable-priority-scheduling (None: the server's default)


@dataclass
class GenerateOutput:
    """A step's result for one request. Text and ids are deltas since the previous output:
    drop the last output_ids_rollback ids received so far, then append output_ids_delta (a
    jump-forward re-tokenized the seam; the text is unchanged, text_delta only appends)."""
    rid: str
    text_delta: str
    output_ids_delta: List[int]
    finished: bool
    finish_reason: Optional[Dict[str, Any]] = None   # {"type": "stop"|"length"|"abort", "matched": str|int|None}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs_delta: List[LogprobEntry] = field(default_factory=list)
    output_top_logprobs_delta: List[List[LogprobEntry]] = field(default_factory=list)
    input_token_logprobs: Optional[List[LogprobEntry]] = None   # once, with the first output
    input_top_logprobs: Optional[List[List[LogprobEntry]]] = None
    queue_time_s: Optional[float] = None      # once, with the first output: arrival in the engine -> first admission
    output_ids_rollback: int = 0
    # a pooling request's result, with its last output (engine/pooling.py): the embedding
    # (truncated and normalised as its PoolParams say) and the logits of its label_ids
    embedding: Optional[List[float]] = None
    label_logits: Optional[List[float]] = None


def apply_ids_delta(ids: List[int], out: GenerateOutput) -> None:
    """Bring a consumer's accumulated output ids up to date with out (rollback, then delta)."""
    if out.output_ids_rollback:
        del ids[max(len(ids) - out.output_ids_rollback, 0):]
    ids.extend(out.output_ids_delta)


def expand_requests(rid: str, prompt_ids: Sequence[List[int]], n: int,
                    sampling: Sequence[SamplingParams], stream: bool = False,
                    return_logprob: Optional[Sequence[bool]] = None,
                    logprob_start_len: Optional[Sequence[int]] = None,
                    top_logprobs_num: Optional[Sequence[int]] = None,
                    return_text_in_logprobs: bool = False,
                    rids: Optional[Sequence[str]] = None,
                    cache_salts: Optional[Sequence[Optional[str]]] = None,
                    priority: Optional[int] = None) -> List[GenerateReqInput]:
    """One GenerateReqInput per (prompt, sample): index p * n + j, each with n=1 (n is a
    request-level field: the engine runs single sequences). With a single sequence the rid is
    `rid` (or rids[0]); otherwise "<rid>-<index>" (or "<rids[p]>-<j>" when the client named each
    prompt). A seed s gives sample j the seed s + j, so samples differ but each is
    reproducible. Per-prompt settings are sequences with one entry per prompt (cache_salts
    too: a prompt's sequences share its salt); None leaves GenerateReqInput's default. priority
    is the request's, every sequence's."""
    total = len(prompt_ids) * n
    reqs = []
    for p, ids in enumerate(prompt_ids):
        for j in range(n):
            index = p * n + j
            sp = sampling[p].for_sample(j)       # a verified request's samples stay verified
            if rids is not None:
                seq_rid = rids[p] if n == 1 else f"{rids[p]}-{j}"
            else:
                seq_rid = rid if total == 1 else f"{rid}-{index}"
            reqs.append(GenerateReqInput(
                rid=seq_rid, input_ids=list(ids), sampling_params=sp, stream=stream,
                return_logprob=False if return_logprob is None else return_logprob[p],
                logprob_start_len=-1 if logprob_start_len is None else logprob_start_len[p],
                top_logprobs_num=0 if top_logprobs_num is None else top_logprobs_num[p],
                return_text_in_logprobs=return_text_in_logprobs,
                cache_salt=cache_salts[p] if cache_salts is not None else None,
                priority=priority))
    return reqs
