"""Jump-forward: append the text a grammar forces, re-tokenizing the seam as the tokenizer would.

When a request's grammar admits exactly one continuation string s, the model has no choice for
those characters; they are appended without forward passes. The tokens are not simply
encode(s): the last sampled tokens and s may tokenize differently together (" {" + '"name"'
merges), and the KV cache must hold exactly the tokens the text would have. plan_jump
re-encodes the last few output tokens' text followed by s, keeps the longest common token prefix
and replaces the rest: those positions' KV is rolled back and recomputed by the next extend.

The plan is used only if it is exact: the decoded new output must equal the old output's text
plus s (tokenizers that rewrite text on a round trip would otherwise change what was already
streamed); failing that, s is appended as its own tokens, and failing that too, no jump.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

SEAM_WINDOW = 8          # output tokens re-tokenized together with the jumped text


class JumpPlan(NamedTuple):
    num_removed: int      # tokens dropped from the end of the output
    new_ids: List[int]    # tokens appended in their place (never empty)


def plan_jump(tokenizer, output_ids: Sequence[int], text: str,
              window: int = SEAM_WINDOW) -> Optional[JumpPlan]:
    """How to append text to output_ids. tokenizer: encode(text, add_special_tokens) and
    decode(ids, skip_special_tokens). None when text cannot be appended exactly."""
    if not text:
        return None
    out = list(output_ids)
    w = min(window, len(out))
    head, tail = out[:len(out) - w], out[len(out) - w:]
    want = _decode(tokenizer, out) + text
    tail_text = _decode(tokenizer, tail)
    candidates = [tokenizer.encode(tail_text + text, add_special_tokens=False)] if w else []
    candidates.append(tail + tokenizer.encode(text, add_special_tokens=False))
    for new_tail in candidates:
        if not new_tail or _decode(tokenizer, head + new_tail) != want:
            continue
        common = 0
        while common < min(len(tail), len(new_tail)) and tail[common] == new_tail[common]:
            common += 1
        if common == len(new_tail):
            continue                     # nothing would be appended
        return JumpPlan(len(tail) - common, list(new_tail[common:]))
    return None


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)
