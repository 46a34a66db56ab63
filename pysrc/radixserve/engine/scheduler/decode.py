"""DecodeManager: decode steps, and retraction when the KV pool cannot hold their tokens.

A decode step gives each running request one slot, in one allocation and one indexed write of
the host rows; the device writes its own copy of the rows and reads the input ids it sampled
last step (model/forward_batch.decode_prologue), so building a decode step never needs that step's
predecessor to have reached the host. A request whose remaining tokens are all scheduled already
(max_new_tokens covered by the step in flight) is left out.

If the pool cannot give every running request its slot even after eviction, the latest-admitted
requests are retracted to the front of the queue (Scheduler.retract): their computed KV is
published to the cache (so resuming re-matches it) and they keep their output. With
--enable-priority-scheduling the victims come from the least urgent priority class present
first (priority.py). Among those, while a client is over its fair share (fairness.py), that
client's requests go first, latest admitted first, so a retraction for memory does not undo a
preemption made for fairness.
Retraction needs the exact host state, so the pipeline resolves the step in flight before a
step that may retract (memory_short). A retraction resets the decode reserve (kv.py); each
decode step decays it. counters["num_retractions"] counts these (retractions for fairness,
made at admission, are prefill.py's and counted in num_fair_retractions).

With --enable-mixed-chunk the running decodes also ride along in a prefill step (add_rows).
With --speculative-algorithm (spec.py) a decode step becomes a verify step when some request
has a draft (_plan_verify): a decode step where a request with a draft of k tokens takes k + 1
rows (its last token and the draft; model/step_io.StepInput), so it runs in the decode CUDA
graphs; when the pool cannot hold the drafts' slots it stays a plain decode step (drafts never
retract anyone). Either may be planned over a verify step in flight, assuming its drafts
accepted (_in_flight, spec.py's "Pipeline").
Owns no queue: it reads the Scheduler's running set and asks it to retract or finish.
Event-loop thread.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

from radixserve.engine.req import FinishReason, Req
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.engine.scheduler.kv import DecodeReserve, SlotLedger
from radixserve.engine.scheduler.priority import PriorityOrder
from radixserve.engine.scheduler.spec import SpecDecoder
from radixserve.engine.scheduler.stats import SchedulerStats
from radixserve.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from radixserve.engine.scheduler.core import Scheduler

logger = logging.getLogger("radixserve.engine.scheduler")


class DecodeManager:
    def __init__(self, sched: "Scheduler", ledger: SlotLedger, reserve: DecodeReserve,
                 stats: SchedulerStats, context_len: int, spec: Optional[SpecDecoder] = None,
                 priority: Optional[PriorityOrder] = None):
        self.sched = sched
        self.spec = spec
        self.priority = priority            # None unless --enable-priority-scheduling
        self.ledger = ledger
        self.reserve = reserve
        self.stats = stats
        self.context_len = context_len

    def decoding(self) -> List[Req]:
        """Running requests that still need a decode step."""
        return [r for r in self.sched.running if not r.done_scheduling(self.context_len)]

    def memory_short(self) -> bool:
        """A decode step now could not give every running request a slot without retracting."""
        return len(self.decoding()) > self.ledger.room()

    def plan(self) -> Optional[ScheduleBatch]:
        """This step's decode batch (slots allocated, rows written), retracting first if the
        pool is short; None when no running request needs a token."""
        if not self.sched.running:
            return None
        self._ensure_memory()
        reqs = self.decoding()
        if not reqs:
            return None
        pending: Dict[int, List[int]] = {}
        if self.spec is not None:          # without speculation nothing in flight has a draft
            pending, unknown = self._in_flight()
            over = self.sched.step_in_flight() is not None
            if (not over or self.spec.overlap_verify(len(reqs))) \
                    and self.spec.gate(reqs, overlapped=over):
                batch = self._plan_verify(reqs, pending, unknown)
                if batch is not None:
                    return batch
            self.spec.skip(reqs)
        slots = self.ledger.kv_pool.alloc(len(reqs))                # [B] int64
        batch = ScheduleBatch(ForwardMode.DECODE)
        self.ledger.extend_many(reqs, slots)
        for req in reqs:                 # the slots travel as one tensor: batch.decode_slots
            batch.add(req, req.kv_len, 1, None, sample=True, from_device=True)
            req.kv_len += 1
        batch.decode_slots = slots
        if pending:
            self._assume(batch, reqs, pending)
        self.reserve.decay()
        if self.stats.decode_step():
            self.stats.log_decode(len(reqs), self.ledger.num_used_tokens(),
                                  self.ledger.token_usage(), len(self.sched.waiting))
        return batch

    def _in_flight(self) -> Tuple[Dict[int, List[int]], Set[int]]:
        """The step in flight (a decode or verify step, or none), as this step's planning
        sees it: ({id(req): its draft there} of the requests it verifies a draft of, which this
        step assumes fully accepted; {id(req)} of every request it computes a token of, which
        the host does not know yet)."""
        inflight = self.sched.step_in_flight()
        if inflight is None:
            return {}, set()
        unknown = {id(r) for i, r in enumerate(inflight.reqs)
                   if inflight.sample[i] and inflight.current(i)}
        return inflight.pending_drafts(), unknown

    @staticmethod
    def _assume(batch: ScheduleBatch, reqs: List[Req], pending: Dict[int, List[int]]) -> None:
        """Record in batch which of its requests it computes assuming the step in flight
        accepts their whole draft (StepInput.spec_cond_rows)."""
        batch.spec_cond = [(r.req_pool_idx, len(pending[id(r)])) for r in reqs
                           if id(r) in pending]

    def _plan_verify(self, reqs: List[Req], pending: Dict[int, List[int]],
                     unknown: Set[int]) -> Optional[ScheduleBatch]:
        """A verify step over reqs (spec.py): a DECODE batch where a request with a draft of
        k tokens takes k + 1 rows (StepInput); None when no request has a draft or the pool
        cannot hold the drafts' slots (evicting is fine, retracting is not). pending, unknown:
        the step in flight (_in_flight); the drafts of its requests continue past what it
        computes, assuming its drafts accepted (SpecDecoder.drafts)."""
        drafts = self.spec.drafts(reqs, pending, unknown)
        if not any(drafts):
            return None
        total = len(reqs) + sum(len(d) for d in drafts)
        if total > self.ledger.room():
            return None
        slots = self.ledger.alloc(total)                            # [total] int64
        if slots is None:
            return None
        batch = ScheduleBatch(ForwardMode.DECODE)
        pos = 0
        for req, draft in zip(reqs, drafts):
            n = len(draft) + 1
            start = self.ledger.extend(req, slots[pos:pos + n])
            pos += n
            batch.add_verify(req, draft, start)
        batch.decode_slots = slots
        self._assume(batch, reqs, pending)
        self.spec.skip(reqs, drafts)
        self.reserve.decay()
        self.stats.verify_step(sum(1 for d in drafts if d), total - len(reqs),
                               overlapped=self.sched.step_in_flight() is not None)
        if self.stats.decode_step():
            self.stats.log_decode(len(reqs), self.ledger.num_used_tokens(),
                                  self.ledger.token_usage(), len(self.sched.waiting))
        return batch

    def add_rows(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: the running decodes join an extend batch (one new token each,
        read from the device), so a long prefill costs them one step, not the whole prefill.
        Never retracts: nothing is added when the pool is short."""
        reqs = self.decoding()
        if not reqs or self.memory_short():
            return
        inflight = self.sched.step_in_flight()
        if inflight is not None and inflight.pending_drafts():
            return       # their positions depend on the verify in flight (extend rows: exact)
        slots = self.ledger.alloc(len(reqs))
        if slots is None:
            return
        for i, req in enumerate(reqs):
            slot = slots[i:i + 1]
            start = self.ledger.extend(req, slot)
            batch.add(req, start, 1, slot, sample=True, from_device=True)

    def _ensure_memory(self) -> None:
        """Make one free slot per decoding request: evict, then retract (latest admitted first;
        the chunked request counts as a candidate too). Only with no step in flight when it
        must retract (the pipeline checks memory_short first)."""
        kv_pool = self.ledger.kv_pool
        retracted: List[Req] = []
        while True:
            need = len(self.decoding())
            short = need - kv_pool.available_size()
            if need == 0 or short <= 0:
                break
            self.ledger.cache.evict(short)
            if need <= kv_pool.available_size():
                break
            victim = self._victim()
            if victim is None:
                # cannot happen while admission keeps prompt + max_new_tokens within the pool;
                # fail the request honestly rather than the step
                for req in self.decoding():
                    self.sched.finish(req, FinishReason.abort(
                        f"the KV pool ({kv_pool.num_slots} slots) cannot hold this request's "
                        f"next token; raise --max-total-tokens"))
                break
            self.sched.retract(victim)
            retracted.append(victim)
        if retracted:
            old = self.reserve.reset()
            self.stats.count("num_retractions", len(retracted))
            logger.warning("Retract requests: #retracted: %d, #new-token-ratio: %.4f -> %.4f",
                           len(retracted), old, self.reserve.ratio)

    def _victim(self) -> Optional[Req]:
        """The latest admitted of the running requests and the chunked one, keeping at least one
        running request (admission guarantees a lone request fits the pool): of the least
        urgent priority class (with --enable-priority-scheduling), and of those, while clients
        are over their fair share (fairness.py), the latest admitted of theirs."""
        chunked = self.sched.chunked_req
        candidates = list(self.sched.running) + ([chunked] if chunked else [])
        if len(candidates) <= 1:
            return None
        if self.priority is not None:
            candidates = self.priority.least_urgent(candidates)
        fair = self.sched.fair_share()
        if fair is not None:
            over = [r for r in candidates if fair.over(r.client_id)]
            if over:
                candidates = over
        return max(candidates, key=lambda r: r.admit_order)
