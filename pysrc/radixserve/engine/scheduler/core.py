"""Scheduler: owns every live request and decides what each step computes.

The scheduler is split by concern, as one class over four files:
  core.py     requests in and out (add, abort, finish, release KV), schedule(), integrity, stats
  prefill.py  admission and chunked prefill (PrefillMixin)
  decode.py   decode batches and retraction (DecodeMixin)
  results.py  a step's results: tokens, stops, streaming (ResultsMixin)
  grammar.py  constrained decoding: the grammar slot's bitmask, matchers, jump-forward
Its pipeline (engine/pipeline.py) runs the steps: schedule() -> launch -> process_batch_result(),
with the next step scheduled while the previous one runs (overlap). Everything here runs on the
event-loop thread and is the only code that mutates requests, the queues, the KV free list, the
host ReqToToken rows and the prefix cache; the device sees only StepInputs.

Per step (schedule()):
  1. finish requests marked for abort;
  2. prefill (under --step-order alternate, the default in the server: unless the previous step
     was a prefill and requests are decoding, so that prefill and decode steps alternate under
     load and neither starves; under prefill-first, the offline Engine's default: whenever a
     prompt can be admitted), else
  3. a decode step over the running requests that still need tokens.
Slot ownership follows cache/base.py and engine/req.py; check_integrity() verifies it.
"""
from __future__ import annotations

import collections
import logging
import random
import time
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

from radixserve.cache.base import PrefixCache
from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.config import ServerArgs
from radixserve.engine.pipeline import StepPipeline, run_sync
from radixserve.engine.policy import get_policy
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.engine.scheduler.decode import DecodeMixin
from radixserve.engine.scheduler.grammar import GrammarMixin
from radixserve.engine.scheduler.prefill import PrefillMixin
from radixserve.engine.scheduler.results import ResultsMixin
from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")

INIT_NEW_TOKEN_RATIO = 0.7       # x conservativeness: share of remaining max_new_tokens reserved
MIN_NEW_TOKEN_RATIO = 0.1        # the ratio decays to this (x conservativeness) while nothing retracts


def make_prefix_cache(server_args: ServerArgs, kv_pool: KVPool) -> PrefixCache:
    """RadixCache unless --disable-radix-cache (or the module is missing: ChunkCache + a warning)."""
    if not server_args.disable_radix_cache:
        try:
            from radixserve.cache.radix_cache import RadixCache
        except ImportError as e:
            logger.warning("radix cache unavailable (%s); falling back to ChunkCache (no prefix "
                           "sharing)", e)
        else:
            return RadixCache(kv_pool, page_size=server_args.page_size)
    return ChunkCache(kv_pool, page_size=server_args.page_size)


class Scheduler(PrefillMixin, DecodeMixin, ResultsMixin, GrammarMixin):
    """runner: provides kv_pool, model_config, context_len, max_running_requests, launch(StepInput).
    tokenizer: optional; gives EOS ids, token_text for logprobs, and detokenizers (via
    detokenizer_factory(req) -> IncrementalDetokenizer or None)."""

    def __init__(self, server_args: ServerArgs, runner: Any, tokenizer: Any = None,
                 detokenizer_factory: Optional[Callable[[Req], Any]] = None,
                 cache: Optional[PrefixCache] = None):
        self.server_args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self.kv_pool: KVPool = runner.kv_pool
        self.vocab_size = runner.model_config.vocab_size
        self.context_len = runner.context_len
        self.req_to_token_pool = ReqToTokenPool(runner.max_running_requests,
                                                runner.context_len + 1)
        self.cache = cache if cache is not None else make_prefix_cache(server_args, self.kv_pool)
        self.policy = get_policy(server_args.schedule_policy)
        self.max_running_requests = runner.max_running_requests
        self.chunk_size = server_args.resolved_chunked_prefill_size()
        self.max_prefill_tokens = server_args.max_prefill_tokens
        self.mixed_chunk = server_args.enable_mixed_chunk
        self.alternate = server_args.step_order == "alternate"
        self.jump_forward = not server_args.disable_jump_forward
        self.eos_ids = self._eos_ids(runner, tokenizer)
        cons = server_args.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * cons, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * cons, self.init_new_token_ratio)
        self.new_token_ratio = self.init_new_token_ratio
        self._rng = random.Random(server_args.random_seed)
        self.pipeline = StepPipeline(self, overlap=not server_args.disable_overlap_schedule)
        # request state
        self.waiting: Deque[Req] = collections.deque()
        self.running: List[Req] = []
        self.chunked_req: Optional[Req] = None
        self.reqs: Dict[str, Req] = {}
        self._admit_counter = 0
        self._last_was_prefill = False
        self._fair_preempt_wanted = False     # see prefill.py (fairness) and the pipeline
        # telemetry (decode.py's log line refreshes the rates)
        self._num_decode_steps = 0
        self._decode_log_tokens = 0
        self._decode_log_time = time.perf_counter()
        self._device_time = 0.0
        self.total_device_time = 0.0        # device seconds of every step processed
        # the same split by step kind: "decode", and "extend" (prefill chunks, mixed steps)
        self.device_time_by_kind: Dict[str, float] = {"decode": 0.0, "extend": 0.0}
        # device seconds idle just before a step of each kind (CUDA: from the steps' events)
        self.device_idle_before_kind: Dict[str, float] = {"decode": 0.0, "extend": 0.0}
        # decode steps' device seconds x their rows: over a run, divided by the tokens those
        # steps made, the mean decode step a generated token waited for (bench serving puts
        # the median ITL over it)
        self.decode_row_device_time = 0.0
        self.decode_rows = 0
        self.gen_throughput = 0.0
        self.gpu_busy_fraction = 0.0
        self.counters: Dict[str, int] = {
            "num_requests": 0, "num_finished_requests": 0, "num_aborted_requests": 0,
            "prompt_tokens": 0, "cached_tokens": 0, "generation_tokens": 0,
            "num_retractions": 0, "num_fair_retractions": 0,
            "num_prefill_steps": 0, "num_decode_steps": 0,
            "num_jumps": 0, "jump_forward_tokens": 0,
        }

    @staticmethod
    def _eos_ids(runner: Any, tokenizer: Any) -> List[int]:
        eos = set(runner.model_config.eos_token_ids)
        if tokenizer is not None:
            tok_eos = getattr(tokenizer, "eos_token_ids", None)
            tok_eos = tok_eos() if callable(tok_eos) else tok_eos
            eos |= set(tok_eos or [])
        return sorted(eos)

    # ------------------------------------------------------------------ queue API (loop thread)
    def add_request(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use; send a unique rid")
        if req.seed is None:
            req.seed = self._rng.randrange(1 << 62)
        if req.detokenizer is None and self.detokenizer_factory is not None:
            req.detokenizer = self.detokenizer_factory(req)
        req.status = ReqStatus.WAITING
        req.arrival_time = time.perf_counter()
        self.reqs[req.rid] = req
        self.waiting.append(req)
        self.counters["num_requests"] += 1

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort a live request: at once if it is waiting, else at the next step boundary (its
        slots may be in use by the forward in flight). Returns False for an unknown rid."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        req.abort_message = message
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "matched": None, "message": message})
        else:
            req.to_abort = True
        return True

    def has_work(self) -> bool:
        """Any live request (waiting, decoding, mid-chunk) or a step still in flight."""
        return bool(self.reqs) or self.pipeline.inflight is not None

    @property
    def num_running(self) -> int:
        """Requests holding a running slot: decoding, mid-chunk, or ending their prefill in the
        step in flight (not in `running` until that step is processed)."""
        return len(self.running) + (self.chunked_req is not None) + len(self._inflight_prefills())

    def _inflight_prefills(self) -> List[Req]:
        """The step in flight's requests that end their prefill there (status PREFILL, not the
        chunked request): they join `running` when it is processed."""
        return [r for r in self.pipeline.inflight_reqs()
                if r.status == ReqStatus.PREFILL and r is not self.chunked_req]

    def can_prefill_over(self, batch: ScheduleBatch) -> bool:
        """May a prefill step be scheduled while `batch` (an extend step) is in flight? Yes when
        prompts wait and every request of batch ends its prompt there with nothing else to
        process first: no chunk to publish (no chunked request), no prompt logprobs, no
        decode rows (mixed chunk), no grammar rows. Admission then counts batch's requests as
        running (num_running, their decode reserve) and lets waiting requests that share a
        prefix with them wait for it to be published (prefill.py)."""
        return (batch.mode is ForwardMode.EXTEND and bool(self.waiting)
                and self.chunked_req is None and all(batch.sample)
                and not any(batch.from_device)
                and all(lp is None for lp in batch.prompt_lp)
                and not batch.step_input.sampling.grammar_rows)

    # ------------------------------------------------------------------ a step
    def step(self) -> bool:
        """One pipeline turn, synchronously (tests, offline use); False when idle."""
        async def launch(step_input):
            return self.runner.launch(step_input)

        async def sample(pending, bitmask):
            return self.runner.sample_masked(pending, bitmask)

        async def wait(pending):
            return pending.wait()

        return run_sync(self.pipeline.turn(launch, wait, sample))

    def schedule(self, prefill_only: bool = False) -> Optional[ScheduleBatch]:
        """Pick this step's batch, allocate its slots and build its StepInput. Loop thread.
        prefill_only: a prefill step or nothing (None, no state changed but aborts handled):
        the pipeline schedules over an extend step in flight (can_prefill_over)."""
        self.handle_aborts()
        batch = None
        decoding = bool(self.running) or bool(self._inflight_prefills())
        if not (self.alternate and self._last_was_prefill and decoding):
            batch = self._prefill_batch()
            if batch is not None and self.mixed_chunk:
                self._add_decode_rows(batch)
        if batch is None and prefill_only:
            return None
        if batch is None:
            batch = self._decode_batch()
        if batch is None:
            self._last_was_prefill = False
            self._drop_unschedulable()
            return None
        self._last_was_prefill = batch.mode == ForwardMode.EXTEND
        batch.step_input = batch.prepare(self.req_to_token_pool, self.eos_ids, self.vocab_size,
                                         decode_slots=batch.decode_slots)
        return batch

    def _drop_unschedulable(self) -> None:
        """Nothing runs and the head of the queue still cannot be admitted. Admission refuses
        requests that can never fit, so this is a safety net: finish it rather than wait forever."""
        if self.waiting and not self.running and self.chunked_req is None \
                and self.pipeline.inflight is None:
            req = self.waiting.popleft()
            self._finish(req, {"type": "abort", "matched": None,
                               "message": f"the request needs {req.seq_len} KV slots to start "
                                          f"but only {self.kv_pool.available_size()} of "
                                          f"{self.kv_pool.num_slots} can be freed"})

    def fail_batch(self, batch: ScheduleBatch, error: BaseException) -> None:
        """The step of batch raised: finish its requests with an abort (their new KV is not
        trustworthy, so it is freed, not published). Loop thread."""
        message = f"internal error: {type(error).__name__}: {error}"
        for req in batch.reqs:
            if req.finished:
                continue
            if req.req_pool_idx is not None:
                own = self.req_to_token_pool.slots(req.req_pool_idx, req.kv_len)[req.prefix_len:]
                self.kv_pool.free(own)
                req.kv_len = req.prefix_len
            req.abort_message = message
            self._finish(req, {"type": "abort", "matched": None, "message": message})
        self._requeue_table_writes(batch)

    def _requeue_table_writes(self, batch: ScheduleBatch) -> None:
        """The failed step carried ReqToToken writes of requests that live on (a row re-pointed
        at the cache): send them again with the next step."""
        si = batch.step_input
        if si is None or si.table_slots is None:
            return
        live = {r.req_pool_idx for r in self.reqs.values() if r.req_pool_idx is not None}
        for row in sorted(live & set(si.table_rows.tolist())):
            mask = si.table_rows == row
            cols, slots = si.table_cols[mask], si.table_slots[mask]
            for c, s in zip(cols.tolist(), slots.tolist()):
                self.req_to_token_pool.write(row, c, torch.tensor([s]))

    def handle_aborts(self) -> None:
        """Finish every request marked for abort (between steps only)."""
        for req in [r for r in self.running if r.to_abort]:
            self._finish(req, self._abort_reason(req))
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            self._finish(req, self._abort_reason(req))

    def _abort_reason(self, req: Req) -> Dict[str, Any]:
        return {"type": "abort", "matched": None, "message": req.abort_message or "aborted"}

    def _finish(self, req: Req, reason: Dict[str, Any]) -> None:
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        self._release_kv(req)
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        if reason["type"] == "abort":
            self.counters["num_aborted_requests"] += 1
        else:
            self.counters["num_finished_requests"] += 1
        if req.detokenizer is not None and reason["type"] != "abort" and \
                not req.stop_str_matched:
            req.pending_text += req.detokenizer.flush()
        self._emit(req, finished=True)

    def _release_kv(self, req: Req, keep: Optional[int] = None) -> None:
        """Give the request's computed tokens to the cache (ChunkCache frees them), unlock its
        prefix and free its row. A running request publishes fill_ids[:seq_len - 1], exactly as
        with no step in flight: the slot a step in flight is writing for its last token is
        freed (the next owner's writes come after that step on the device). keep: publish at
        most that many (jump-forward rolls back the re-tokenized tail)."""
        if req.req_pool_idx is None:
            return
        kv = req.kv_len
        if req.status == ReqStatus.RUNNING:
            kv = min(kv, req.seq_len - 1)
        if keep is not None:
            kv = min(kv, keep)
        kv = max(kv, req.prefix_len)   # never below the prefix: those slots are the cache's
        slots = self.req_to_token_pool.slots(req.req_pool_idx, req.kv_len)
        self.cache.insert(req.cache_key[:kv], slots[:kv])
        self.kv_pool.free(slots[kv:])
        self.cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0

    # ------------------------------------------------------------------ cache, stats, checks
    def flush_cache(self) -> bool:
        """Reset the prefix cache; refused (False, nothing changes) while any request is live."""
        if self.has_work():
            return False
        self.cache.reset()
        return True

    def num_used_tokens(self) -> int:
        return self.kv_pool.num_slots - self.kv_pool.available_size() - self.cache.evictable_size()

    def token_usage(self) -> float:
        return self.num_used_tokens() / max(self.kv_pool.num_slots, 1)

    def metrics(self) -> Dict[str, Any]:
        m: Dict[str, Any] = dict(self.counters)
        m.update(num_running_reqs=self.num_running,
                 num_waiting_reqs=len(self.waiting), token_usage=self.token_usage(),
                 num_used_tokens=self.num_used_tokens(), max_total_tokens=self.kv_pool.num_slots,
                 evictable_tokens=self.cache.evictable_size(),
                 gen_throughput=self.gen_throughput, gpu_busy_fraction=self.gpu_busy_fraction,
                 decode_device_seconds=self.device_time_by_kind["decode"],
                 extend_device_seconds=self.device_time_by_kind["extend"],
                 device_idle_before_decode_seconds=self.device_idle_before_kind["decode"],
                 device_idle_before_extend_seconds=self.device_idle_before_kind["extend"],
                 decode_row_device_seconds=self.decode_row_device_time,
                 decode_rows=self.decode_rows,
                 weight_floor_seconds=getattr(self.runner, "weight_floor_s", None) or 0.0)
        return m

    def check_integrity(self) -> None:
        """Every slot is free, cache-owned, or owned by one live request; exactly once each.
        Raises AssertionError naming the inconsistency. Between pipeline turns."""
        total = self.kv_pool.num_slots
        holders = [r for r in self.reqs.values() if r.req_pool_idx is not None]
        parts = [self.kv_pool.free_slots(), self.cache.owned_slots().to(torch.int64)]
        rows = self.req_to_token_pool.req_to_token
        in_flight = {id(r) for r in self.pipeline.inflight_reqs()}
        for r in holders:
            assert r.prefix_len <= r.kv_len, f"{r}: prefix beyond kv"
            row = rows[r.req_pool_idx].to(torch.int64)
            assert torch.equal(row[:r.prefix_len], r.prefix_indices), f"{r}: row != prefix"
            parts.append(row[r.prefix_len:r.kv_len])
            if r.status == ReqStatus.RUNNING:
                ahead = 1 if id(r) in in_flight else 0
                assert r.kv_len == r.seq_len - 1 + ahead, f"{r}: kv_len != seq_len - 1 + {ahead}"
                assert r.num_output_scheduled == len(r.output_ids) + ahead, \
                    f"{r}: {r.num_output_scheduled} outputs scheduled"
        allslots = torch.cat(parts)
        assert allslots.numel() == total, \
            f"slot accounting: {allslots.numel()} accounted != {total} total"
        assert int(allslots.unique().numel()) == total, "a slot is owned twice"
        assert int(allslots.min()) >= 1 and int(allslots.max()) <= total, "slot out of range"
        used_rows = [r.req_pool_idx for r in holders]
        assert len(set(used_rows)) == len(used_rows), "a ReqToToken row is held twice"
        assert self.req_to_token_pool.available_size() + len(used_rows) == \
            self.req_to_token_pool.size, "ReqToToken rows leaked"
        for r in self.running:
            assert r.req_pool_idx is not None and r.status == ReqStatus.RUNNING
        self.cache.check_integrity()
