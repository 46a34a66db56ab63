"""The engine's request and output types: what the server (and the offline Engine) hand to
AsyncEngine.generate and what comes back, one GenerateOutput per step that produced text."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from radixserve.sampling.params import SamplingParams

# One logprob entry: (logprob, token_id, token_text or None)
LogprobEntry = Tuple[float, int, Optional[str]]


@dataclass
class GenerateReqInput:
    """One sequence to generate (the server expands batches and n>1 into several of these)."""
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


class RequestError(ValueError):
    """A request the engine refuses, naming the field to change (param): a 400 upstream."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def apply_ids_delta(ids: List[int], out: GenerateOutput) -> None:
    """Bring a consumer's accumulated output ids up to date with out (rollback, then delta)."""
    if out.output_ids_rollback:
        del ids[max(len(ids) - out.output_ids_rollback, 0):]
    ids.extend(out.output_ids_delta)


class EngineOverloaded(Exception):
    """The waiting queue is full: the request was refused before it started (a 503 with
    Retry-After upstream); nothing changed in the engine."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s
