"""Scheduler: owns every live request and decides what each step computes.

The Scheduler holds the requests (`reqs`), the waiting queue and the running set, and is
composed of parts that own their state; each part gets what it needs at construction:
  kv.py        SlotLedger: slots between the KV pool, the ReqToToken rows, the prefix cache and
               a request; DecodeReserve: the KV kept for running requests' future tokens
  prefill.py   PrefillPlanner: admission and chunked prefill; owns the chunked request
  decode.py    DecodeManager: decode batches, retraction for memory
  fairness.py  the fair share between clients, and whom admission preempts for it
  priority.py  --enable-priority-scheduling: the queue's order by priority, and whom admission
               preempts for an urgent request
  results.py   ResultProcessor: a step's results: tokens, stops, streaming (emit)
  grammar.py   GrammarSlot: the grammar slot's bitmask, matchers, jump-forward plans
  stats.py     SchedulerStats: counters and device-time telemetry
  spec.py      SpecDecoder (--speculative-algorithm only): who drafts what; verify steps are
               DecodeManager's, their results ResultProcessor's
The parts do not call each other (ResultProcessor asks the GrammarSlot, a leaf); they reach
the queues through the Scheduler, which alone finishes and retracts requests (finish,
retract: a request leaves the running set only there, or when results move it).
Its StepPipeline (engine/pipeline.py), built once with its executor, runs the steps:
schedule() -> launch -> process_batch_result(), with the next step scheduled while the
previous one runs (overlap). Everything here runs on the event-loop thread and is the only code
that mutates requests, the queues, the KV free list, the host ReqToToken rows and the prefix
cache; the device sees only StepInputs.

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
from radixserve.engine.pipeline import StepExecutor, StepPipeline, SyncExecutor, run_sync
from radixserve.engine.policy import get_policy
from radixserve.engine.req import FinishReason, Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.engine.scheduler.decode import DecodeManager
from radixserve.engine.scheduler.fairness import FairShare, fair_share
from radixserve.engine.scheduler.grammar import GrammarSlot
from radixserve.engine.scheduler.kv import DecodeReserve, SlotLedger
from radixserve.engine.scheduler.prefill import PrefillPlanner
from radixserve.engine.scheduler.priority import PriorityOrder
from radixserve.engine.scheduler.results import ResultProcessor, emit
from radixserve.engine.scheduler.spec import SpecDecoder
from radixserve.engine.scheduler.stats import SchedulerStats
from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")


def make_prefix_cache(server_args: ServerArgs, kv_pool: KVPool) -> PrefixCache:
    """RadixCache unless --disable-radix-cache (or the module is missing: ChunkCache + a warning)."""
    if not server_args.disable_radix_cache:
        try:
            from radixserve.cache.radix_cache import RadixCache
        except ImportError as e:
            logger.warning("radix cache unavailable (%s); falling back to ChunkCache (no prefix "
                           "sharing)", e)
        else:
            return RadixCache.from_server_args(kv_pool, server_args)  # + --kv-events-config
    return ChunkCache(kv_pool, page_size=server_args.page_size)


class Scheduler:
    """runner: provides kv_pool, model_config, context_len, max_running_requests, and the
    calls SyncExecutor makes (launch, sample_masked). tokenizer: optional; gives EOS ids,
    token_text for logprobs, and detokenizers (via detokenizer_factory(req) ->
    IncrementalDetokenizer or None). executor: the pipeline's StepExecutor (default: a
    SyncExecutor over runner, which step() needs; AsyncEngine passes its ThreadedExecutor)."""

    def __init__(self, server_args: ServerArgs, runner: Any, tokenizer: Any = None,
                 detokenizer_factory: Optional[Callable[[Req], Any]] = None,
                 cache: Optional[PrefixCache] = None,
                 executor: Optional[StepExecutor] = None):
        self.server_args = server_args
        self.runner = runner
        self.tokenizer = tokenizer
        self.detokenizer_factory = detokenizer_factory
        self.kv_pool: KVPool = runner.kv_pool
        self.vocab_size = runner.model_config.vocab_size
        self.context_len = runner.context_len
        self.max_running_requests = runner.max_running_requests
        self.req_to_token_pool = ReqToTokenPool(runner.max_running_requests,
                                                runner.context_len + 1)
        self.cache = cache if cache is not None else make_prefix_cache(server_args, self.kv_pool)
        self.chunk_size = server_args.resolved_chunked_prefill_size()
        self.mixed_chunk = server_args.enable_mixed_chunk
        self.alternate = server_args.step_order == "alternate"
        self.eos_ids = self._eos_ids(runner, tokenizer)
        self._rng = random.Random(server_args.random_seed)
        # the queues and the running set (the chunked request is the PrefillPlanner's)
        self.waiting: Deque[Req] = collections.deque()
        self.running: List[Req] = []
        self.reqs: Dict[str, Req] = {}
        self._last_was_prefill = False
        # the parts
        self.stats = SchedulerStats()
        self.ledger = SlotLedger(self.kv_pool, self.req_to_token_pool, self.cache)
        reserve = DecodeReserve(server_args.schedule_conservativeness)
        # priority scheduling: None unless --enable-priority-scheduling (priority.py)
        self.priority: Optional[PriorityOrder] = PriorityOrder.from_server_args(server_args)
        policy = get_policy(server_args.schedule_policy)
        if self.priority is not None:
            policy = self.priority.order(policy)
        self.admission = PrefillPlanner(self, self.ledger, reserve, self.stats, policy,
                                        self.chunk_size, server_args.max_prefill_tokens,
                                        priority=self.priority)
        # speculative decoding: None unless --speculative-algorithm (spec.py)
        self.spec: Optional[SpecDecoder] = None
        if server_args.speculative_algorithm is not None:
            self.spec = SpecDecoder(server_args, self.context_len, self.cache)
        self.decode = DecodeManager(self, self.ledger, reserve, self.stats, self.context_len,
                                    spec=self.spec, priority=self.priority)
        self.grammar = GrammarSlot(self.vocab_size, tokenizer, self.context_len,
                                   pin=self.kv_pool.device.type == "cuda",
                                   jump_forward=not server_args.disable_jump_forward)
        self.results = ResultProcessor(self, self.ledger, self.grammar, self.stats, tokenizer,
                                       self.context_len, server_args.page_size)
        self.pipeline = StepPipeline(self, executor or SyncExecutor(runner),
                                     overlap=not server_args.disable_overlap_schedule)

    @staticmethod
    def _eos_ids(runner: Any, tokenizer: Any) -> List[int]:
        eos = set(runner.model_config.eos_token_ids)
        if tokenizer is not None:
            tok_eos = getattr(tokenizer, "eos_token_ids", None)
            tok_eos = tok_eos() if callable(tok_eos) else tok_eos
            eos |= set(tok_eos or [])
        return sorted(eos)

    # ------------------------------------------------------------------ the parts' state, read
    @property
    def chunked_req(self) -> Optional[Req]:
        """The request whose prompt is mid-prefill across steps (PrefillPlanner's)."""
        return self.admission.chunked_req

    @property
    def counters(self) -> Dict[str, int]:
        return self.stats.counters

    @property
    def total_device_time(self) -> float:
        return self.stats.total_device_time

    @property
    def device_time_by_kind(self) -> Dict[str, float]:
        return self.stats.device_time_by_kind

    @property
    def device_idle_before_kind(self) -> Dict[str, float]:
        return self.stats.device_idle_before_kind

    @property
    def gen_throughput(self) -> float:
        return self.stats.gen_throughput

    @property
    def jump_forward(self) -> bool:
        return self.grammar.jump_forward

    @jump_forward.setter
    def jump_forward(self, on: bool) -> None:
        self.grammar.jump_forward = on

    # ------------------------------------------------------------------ queue API (loop thread)
    def add_request(self, req: Req) -> None:
        """Queue req (ValueError for an rid in use): it gets its seed and detokenizer here."""
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
        self.stats.count("num_requests")

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort a live request: at once if it is waiting, else at the next step boundary (its
        slots may be in use by the forward in flight). Returns False for an unknown rid."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        req.abort_message = message
        if req.status == ReqStatus.WAITING:
            self.waiting.remove(req)
            self.finish(req, FinishReason.abort(message))
        else:
            req.to_abort = True
        return True

    def has_work(self) -> bool:
        """Any live request (waiting, decoding, mid-chunk) or a step still in flight."""
        return bool(self.reqs) or self.step_in_flight() is not None

    def step_in_flight(self) -> Optional[ScheduleBatch]:
        """The batch of the pipeline's step in flight, or None."""
        return self.pipeline.inflight_batch

    def inflight_prefills(self) -> List[Req]:
        """The step in flight's requests that end their prefill there (status PREFILL, not the
        chunked request): they join `running` when it is processed."""
        return [r for r in self.pipeline.inflight_reqs()
                if r.status == ReqStatus.PREFILL and r is not self.chunked_req]

    @property
    def num_running(self) -> int:
        """Requests holding a running slot: decoding, mid-chunk, or ending their prefill in the
        step in flight (not in `running` until that step is processed)."""
        return len(self.running) + (self.chunked_req is not None) + len(self.inflight_prefills())

    def fair_share(self) -> Optional[FairShare]:
        """Fairness between clients now (fairness.py); None while the live requests are all
        one client's."""
        holders = self.running + ([self.chunked_req] if self.chunked_req else []) + \
            self.inflight_prefills()
        return fair_share(holders, self.waiting, self.max_running_requests,
                          self.server_args.max_running_requests_per_client)

    # ------------------------------------------------------------------ a step
    def step(self) -> bool:
        """One pipeline turn, synchronously (tests, offline use; the default SyncExecutor);
        False when idle."""
        return run_sync(self.pipeline.turn())

    def schedule(self, prefill_only: bool = False) -> Optional[ScheduleBatch]:
        """Pick this step's batch, allocate its slots and build its StepInput. Loop thread.
        prefill_only: a prefill step or nothing (None, no state changed but aborts handled):
        the pipeline schedules over an extend step in flight (can_prefill_over)."""
        self.handle_aborts()
        batch = None
        decoding = bool(self.running) or bool(self.inflight_prefills())
        if not (self.alternate and self._last_was_prefill and decoding):
            batch = self.admission.plan()
            if batch is not None and self.mixed_chunk:
                self.decode.add_rows(batch)
        if batch is None and prefill_only:
            return None
        if batch is None:
            batch = self.decode.plan()
        self._last_was_prefill = batch is not None and batch.mode is ForwardMode.EXTEND
        if batch is None:
            self._drop_unschedulable()
            return None
        batch.step_input = batch.prepare(self.req_to_token_pool, self.eos_ids, self.vocab_size,
                                         decode_slots=batch.decode_slots,
                                         spec_row_base=self.runner.spec_row_base)
        if self.spec is not None:
            self.spec.step_scheduled(batch, time.perf_counter(),
                                     overlapped=self.step_in_flight() is not None)
        return batch

    # the pipeline's questions and calls (engine/pipeline.py)
    def can_prefill_over(self, batch: ScheduleBatch) -> bool:
        """May a prefill step be scheduled while `batch` (an extend step) is in flight? Yes when
        prompts wait and every request of batch ends its prompt there with nothing else to
        process first: no chunk to publish (no chunked request), no prompt logprobs, no
        decode rows (mixed chunk), no grammar rows (a pooling request ending its prompt
        there finishes when it is processed). Admission then counts batch's requests as
        running (num_running, their decode reserve) and lets waiting requests that share a
        prefix with them wait for it to be published (prefill.py)."""
        return (batch.mode is ForwardMode.EXTEND and bool(self.waiting)
                and self.chunked_req is None
                and all(batch.ends_prompt(i) for i in range(batch.batch_size))
                and not any(batch.from_device)
                and all(lp is None for lp in batch.prompt_lp)
                and not batch.step_input.sampling.grammar_rows)

    def decode_memory_short(self) -> bool:
        """A decode step now could not give every running request a slot without retracting."""
        return self.decode.memory_short()

    def spec_wants_host(self) -> bool:
        """Speculation runs serially now (SpecDecoder.overlap_verify) and could build a verify
        step if the step in flight were processed (its drafts need every token on the host):
        the pipeline resolves it first rather than scheduling a plain decode over it. Always
        False without --speculative-algorithm."""
        return self.spec is not None and self.spec.wants_host(self.decode.decoding())

    def spec_overlaps(self, batch: ScheduleBatch) -> bool:
        """May a step be scheduled over batch, a verify step in flight
        (SpecDecoder.overlap_verify at its batch size)?"""
        return self.spec is not None and self.spec.overlap_verify(batch.batch_size)

    def preempt_pending(self) -> bool:
        """The last admission wanted to retract running requests (for fairness: of a client
        over its share for a client under it; for priority: less urgent ones for an urgent
        one), but a step was in flight: the pipeline resolves that step before scheduling the
        next, which then preempts (prefill.py)."""
        return self.admission.preempt_wanted and bool(self.waiting)

    def grammar_bitmask(self, batch: ScheduleBatch) -> torch.Tensor:
        """The grammar slot: batch's token bitmask (GrammarSlot.bitmask)."""
        return self.grammar.bitmask(batch)

    def process_batch_result(self, batch: ScheduleBatch, out: Any) -> None:
        """A step's StepOutput reached the host (ResultProcessor.process). Loop thread."""
        if self.spec is not None and batch.verifies:
            self.spec.verify_ran(batch.batch_size, out.device_time)
        self.results.process(batch, out)

    def fail_batch(self, batch: ScheduleBatch, error: BaseException) -> None:
        """The step of batch raised: finish its requests with an abort (their new KV is not
        trustworthy, so it is freed, not published). Loop thread."""
        message = f"internal error: {type(error).__name__}: {error}"
        for req in batch.reqs:
            if req.finished:
                continue
            if req.req_pool_idx is not None:
                self.ledger.drop_own(req)
            req.abort_message = message
            self.finish(req, FinishReason.abort(message))
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

    def _drop_unschedulable(self) -> None:
        """Nothing runs and the head of the queue still cannot be admitted. Admission refuses
        requests that can never fit, so this is a safety net: finish it rather than wait forever."""
        if self.waiting and not self.running and self.chunked_req is None \
                and self.step_in_flight() is None:
            req = self.waiting.popleft()
            self.finish(req, FinishReason.abort(
                f"the request needs {req.seq_len} KV slots to start but only "
                f"{self.kv_pool.available_size()} of {self.kv_pool.num_slots} can be freed"))

    # ------------------------------------------------------------------ leaving the running set
    def handle_aborts(self) -> None:
        """Finish every request marked for abort (between steps only)."""
        for req in [r for r in self.running if r.to_abort]:
            self.finish(req, self.abort_reason(req))
        chunked = self.chunked_req
        if chunked is not None and chunked.to_abort:
            self.finish(chunked, self.abort_reason(chunked))

    @staticmethod
    def abort_reason(req: Req) -> FinishReason:
        return FinishReason.abort(req.abort_message or "aborted")

    def finish(self, req: Req, reason: FinishReason) -> None:
        """req is done: it leaves the running set, its KV goes to the cache (released), it is
        counted, its detokenizer flushed (unless aborted or trimmed at a stop string) and its
        last output emitted with the reason."""
        req.finish_reason = reason
        self._leave_running(req)
        self.ledger.release(req)
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        if reason.is_abort:
            self.stats.count("num_aborted_requests")
        else:
            self.stats.count("num_finished_requests")
        if req.detokenizer is not None and not reason.is_abort and not req.stop_str_matched:
            req.pending_text += req.detokenizer.flush()
        emit(req, finished=True)

    def retract(self, req: Req) -> None:
        """A running (or the chunked) request goes back to the front of the queue with its
        output; its computed KV is published, so resuming re-matches it. Only with no step in
        flight (the caller's contract: the host state must be exact)."""
        self._leave_running(req)
        self.ledger.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        req.num_output_scheduled = len(req.output_ids)
        # the earliest-admitted of the retracted ends up first (each later victim is pushed first)
        self.waiting.appendleft(req)

    def _leave_running(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        self.admission.forget(req)

    # ------------------------------------------------------------------ cache, stats, checks
    def flush_cache(self) -> bool:
        """Reset the prefix cache; refused (False, nothing changes) while any request is live."""
        if self.has_work():
            return False
        self.cache.reset()
        return True

    def num_used_tokens(self) -> int:
        return self.ledger.num_used_tokens()

    def token_usage(self) -> float:
        return self.ledger.token_usage()

    def metrics(self) -> Dict[str, Any]:
        m: Dict[str, Any] = dict(self.counters)
        m.update(num_running_reqs=self.num_running,
                 num_waiting_reqs=len(self.waiting), token_usage=self.token_usage(),
                 num_used_tokens=self.num_used_tokens(), max_total_tokens=self.kv_pool.num_slots,
                 evictable_tokens=self.cache.evictable_size())
        m.update(self.stats.device_metrics())
        m.update(weight_floor_seconds=getattr(self.runner, "weight_floor_s", None) or 0.0,
                 streamed_weight_bytes=getattr(self.runner, "streamed_weight_bytes", 0) or 0,
                 kv_cache_bytes_per_token=self.kv_bytes_per_token())
        return m

    def kv_bytes_per_token(self) -> int:
        """K + V bytes of one cached token over all layers, as one device holds them (a tensor-
        parallel rank: its KV heads), in the pool's dtype."""
        pool = self.kv_pool
        return KVPool.bytes_per_token(pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)

    def check_integrity(self) -> None:
        """Every slot is free, cache-owned, or owned by one live request; exactly once each.
        Raises AssertionError naming the inconsistency. Between pipeline turns."""
        total = self.kv_pool.num_slots
        holders = [r for r in self.reqs.values() if r.req_pool_idx is not None]
        parts = [self.kv_pool.free_slots(), self.cache.owned_slots().to(torch.int64)]
        rows = self.req_to_token_pool.req_to_token
        # a request's KV and output ahead of its known tokens while its step is in flight: its
        # row's extend length (1 for a decode row, len(draft) + 1 for a verify row, whose draft
        # counts as accepted until the step is processed); nothing for an entry voided since
        # (a rejected draft in the step before: ResultProcessor._apply_verify)
        inflight = self.pipeline.inflight_batch
        in_flight = {} if inflight is None else \
            {id(r): n for i, (r, n) in enumerate(zip(inflight.reqs, inflight.extend_lens))
             if inflight.current(i)}
        for r in holders:
            assert r.prefix_len <= r.kv_len, f"{r}: prefix beyond kv"
            row = rows[r.req_pool_idx].to(torch.int64)
            assert torch.equal(row[:r.prefix_len], r.prefix_indices), f"{r}: row != prefix"
            parts.append(row[r.prefix_len:r.kv_len])
            if r.status == ReqStatus.RUNNING:
                ahead = in_flight.get(id(r), 0)
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
