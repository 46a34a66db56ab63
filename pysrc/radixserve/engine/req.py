"""Req: one sequence being generated, from enqueue to finish, as the scheduler sees it.

KV bookkeeping while a request holds a ReqToTokenPool row (`req_pool_idx is not None`):
  * positions [0, prefix_len) of the row are slots the prefix cache owns; the request keeps them
    alive with one lock on `last_node`;
  * positions [prefix_len, kv_len) are slots the request allocated and owns;
  * `fill_ids` = origin_input_ids + output_ids. With no step of the request in flight, a running
    (decoding) request has kv_len == len(fill_ids) - 1: every token has KV except the last
    sampled one, which is the next decode step's input. While a decode step of it is in flight
    (overlap scheduling), kv_len == len(fill_ids): that step writes the KV of the last known
    token and samples one the host learns when it processes the step.
  * `num_output_scheduled` counts the output tokens that will exist once every scheduled step
    has run (len(output_ids) plus the tokens in flight): a step's sampling offset, and what
    stops scheduling a request whose max_new_tokens is already covered.
A request without a row owns nothing. Only the event-loop thread mutates a Req.
"""
from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import torch

from radixserve.engine.io import GenerateOutput, LogprobEntry
from radixserve.engine.pooling import PoolParams, PoolState
from radixserve.sampling.params import SamplingParams


def salt_offset(cache_salt: Optional[str]) -> int:
    """The key offset of a cache salt: a 64-bit digest of it shifted above every token id
    (ids are < 2**32), 0 for no salt."""
    if not cache_salt:
        return 0
    digest = hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") | 1) << 32


class ReqStatus(enum.Enum):
    WAITING = 1    # in the waiting queue (new, or retracted)
    PREFILL = 2    # admitted; prompt (or a chunk of it) being prefilled
    RUNNING = 3    # in the decode batch
    FINISHED = 4


@dataclass(frozen=True, eq=False)
class FinishReason(Mapping):
    """Why a request finished, one of three kinds:
      * stop:   an EOS or stop token (matched: its id), a stop string or regex (matched: it), or
                the grammar's end (matched: the last token);
      * length: max_new_tokens or the context length reached (matched: None);
      * abort:  the request was aborted (message: why; status_code: set only when the request
                itself is at fault, 400: its grammar left no valid token; else a 503 upstream).
    to_dict() renders the wire form that GenerateOutput.finish_reason carries and the server
    emits: {"type", "matched"}, plus "message" for an abort and "status_code" where set. The
    object is also a read-only Mapping over that dict (reason["type"], reason == {...})."""
    kind: str
    matched: Union[int, str, None] = None
    message: Optional[str] = None
    status_code: Optional[int] = None

    @classmethod
    def stop(cls, matched: Union[int, str]) -> "FinishReason":
        return cls("stop", matched)

    @classmethod
    def length(cls) -> "FinishReason":
        return cls("length")

    @classmethod
    def abort(cls, message: str, status_code: Optional[int] = None) -> "FinishReason":
        return cls("abort", None, message, status_code)

    @property
    def is_abort(self) -> bool:
        return self.kind == "abort"

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"type": self.kind, "matched": self.matched}
        if self.kind == "abort":
            d["message"] = self.message
            if self.status_code is not None:
                d["status_code"] = self.status_code
        return d

    # the Mapping view of to_dict()
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


class Req:
    def __init__(self, rid: str, input_ids: List[int], sampling_params: SamplingParams,
                 max_new_tokens: int, *, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0,
                 return_text_in_logprobs: bool = False, stream: bool = False,
                 sink: Optional[Callable[[GenerateOutput], None]] = None,
                 detokenizer: Any = None, client_id: Optional[str] = None,
                 cache_salt: Optional[str] = None, pool: Optional[PoolParams] = None,
                 priority: Optional[int] = None):
        self.rid = rid
        self._salt_offset = salt_offset(cache_salt)
        self.client_id = client_id                    # fairness key (None: one anonymous client)
        # --enable-priority-scheduling: the request's priority (None: the server's default;
        # which end is urgent: engine/scheduler/priority.py); ignored when that is off
        self.priority = priority
        self.origin_input_ids: List[int] = list(input_ids)
        self.output_ids: List[int] = []
        self.sampling_params = sampling_params
        self.max_new_tokens = max_new_tokens          # resolved (never None)
        self.stream = stream
        # a pooling request (engine/pooling.py): prefilled only, then finished with its pooled
        # hidden state (pool_state, summed over the steps that pool its rows)
        self.pool = pool
        self.pool_state: Optional[PoolState] = PoolState() if pool is not None else None
        # sampling: the seed is fixed at admission so a retracted request keeps its stream
        self.seed: Optional[int] = sampling_params.seed
        # prefix-cache match and KV bookkeeping (see the module docstring)
        self.prefix_indices = torch.empty(0, dtype=torch.int64)   # [prefix_len] CPU slots
        self.last_node: Any = None
        self.req_pool_idx: Optional[int] = None
        self.kv_len = 0
        self.cached_tokens: Optional[int] = None      # prompt tokens served by the cache, first admission
        self.status = ReqStatus.WAITING
        self.admit_order = -1                          # larger = admitted later (retraction order)
        self.num_retractions = 0
        self.num_output_scheduled = 0                  # see the module docstring
        self.penalty_ready = False                     # its device penalty row is initialised
        # constrained decoding: the grammar matcher (constrained/grammar.py), advanced by every
        # output token; epoch counts jump-forwards, so a step scheduled before a jump (its
        # token computed from the old state) is recognised and dropped
        self.grammar: Any = None
        self.epoch = 0
        self.num_jumped_tokens = 0                     # output tokens appended by jump-forward
        # speculative decoding (--speculative-algorithm): the request's drafting state (an
        # engine/scheduler/spec.ReqSpec), owned by the scheduler's SpecDecoder; None: never drafted
        self.spec: Any = None
        self.arrival_time: Optional[float] = None      # perf_counter at add_request
        self.queue_time: Optional[float] = None        # arrival -> first admission, seconds
        self.queue_time_sent = False
        # finishing
        self.finish_reason: Optional[FinishReason] = None
        self.to_abort = False
        self.abort_message: Optional[str] = None
        # logprobs
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.return_text_in_logprobs = return_text_in_logprobs
        self.input_token_logprobs: Optional[List[LogprobEntry]] = None
        self.input_top_logprobs: Optional[List[List[LogprobEntry]]] = None
        self.input_logprobs_sent = False
        self.prompt_logprobs_done = False             # every asked prompt position is scored
        self.pending_logprobs: List[LogprobEntry] = []
        self.pending_top_logprobs: List[List[LogprobEntry]] = []
        # output streaming
        self.detokenizer = detokenizer
        self.sink = sink
        self.pending_ids: List[int] = []
        self.pending_rollback = 0                     # sent ids to take back (jump-forward)
        self.pending_text = ""
        self.stop_str_matched = False                 # the detokenizer already trimmed the text

    # ------------------------------------------------------------------ derived lengths
    @property
    def fill_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def cache_key(self) -> List[int]:
        """fill_ids as the prefix cache indexes them: with a cache_salt every id is moved into
        that salt's own key range (id + offset), so requests of different salts (or salted and
        unsalted ones) never match each other's KV; without one, fill_ids itself."""
        ids = self.fill_ids
        if not self._salt_offset:
            return ids
        off = self._salt_offset
        return [t + off for t in ids]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def prefix_len(self) -> int:
        return int(self.prefix_indices.numel())

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def uses_penalties(self) -> bool:
        sp = self.sampling_params
        return (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0
                or sp.presence_penalty != 0.0)

    @property
    def can_jump_forward(self) -> bool:
        """Jump-forward applies: a grammar, and no logprobs (jumped tokens have none)."""
        return self.grammar is not None and not self.return_logprob

    def done_scheduling(self, context_len: int) -> bool:
        """Every token it may still produce is already scheduled: max_new_tokens is covered,
        or the sequence reaches the context length with the tokens in flight."""
        return (self.num_output_scheduled >= self.max_new_tokens
                or len(self.origin_input_ids) + self.num_output_scheduled >= context_len)

    def remaining_new_tokens(self) -> int:
        return max(self.max_new_tokens - len(self.output_ids), 0)

    def max_prefix_len(self) -> int:
        """How many leading fill tokens may come from the cache: the last one is always computed
        (its logits give the next token), and prompt logprobs need logits from position
        logprob_start_len - 1 on (a token's logprob comes from the previous position). A
        mean-pooling request takes none: it needs every token's hidden state."""
        if self.pool is not None and not self.pool.takes_prefix:
            return 0
        limit = self.seq_len - 1
        if self.wants_prompt_logprobs and not self.prompt_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return max(limit, 0)

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, "
                f"out={len(self.output_ids)}, kv={self.kv_len}, status={self.status.name})")
