"""PrefillPlanner: admission and prefill, which waiting requests start this step and the chunk
each computes. It owns the chunked request (the one request whose prompt is mid-prefill
across steps): only this module sets or clears it.

A prefill step continues the chunked request first, then admits waiting requests in policy
order under the token budget (max_prefill_tokens, and chunked_prefill_size which splits a long
prompt across steps), the request cap, a free ReqToToken row, and memory: free + evictable slots
must cover the new prefill tokens plus a reserve for the running requests' future decode tokens
(kv.DecodeReserve). With --enable-mixed-chunk the running decodes ride along in the same
forward (decode.py's add_rows). The planner reads the Scheduler's queues and running set,
removes the requests it admits from the waiting queue, and asks the Scheduler to retract for
fairness. Event-loop thread.

Fairness between clients (the share: fairness.py).
  * Admission: a waiting request whose client holds its share or more is passed over while a
    client under its share has a request waiting; when every waiting client is at or over its
    share, free slots go to requests in policy order (work conserving).
  * Preemption: when a request of a client strictly under its share cannot start because the
    running slots (max_running_requests, ReqToToken rows) or the KV memory are taken, and some
    other client is strictly over its share, the latest-admitted running requests of the client
    most over its share are retracted (fairness.fair_victims), one at a time and only as many as
    it takes to admit the request (none when even all of them could not make it fit). A
    retraction is Scheduler.retract: the victim's computed KV is published to the radix tree
    and it goes back to the front of the queue with its output, so when it resumes it
    re-matches its prefix and computes only the uncached tail (one token, unless eviction took
    some of its KV meanwhile). These are counted in counters["num_fair_retractions"]
    (num_retractions counts memory retractions only).
  * No thrash: a victim's client still holds at least its share afterwards and the request it
    made room for leaves its client at most at its share, so neither can preempt the other next
    (clients at their share never ping-pong); the victim is not considered again in the step
    that retracted it, and afterwards admission passes it over while a client under its share
    waits, so it never restarts ahead of the request it made room for.
  * Pipeline: retraction needs the exact host state, so it happens only with no step in flight.
    An admission that would preempt while a step is in flight sets preempt_wanted; the
    pipeline then resolves the step in flight before scheduling the next (as it does for
    DecodeManager.memory_short), and that next prefill step preempts.

Priority (--enable-priority-scheduling; the order and the rule: priority.py).
  * Admission: the policy is wrapped by PriorityOrder.order, so the most urgent waiting
    requests are considered first and, as with any request that cannot start, the ones behind
    an urgent request that does not fit wait for it (lower priorities wait).
  * Preemption: when a waiting request cannot start because the running slots or the KV memory
    are taken (the same Blocked as fairness) and no fairness victim frees them, the running
    requests it beats by more than --priority-scheduling-preemption-threshold are retracted,
    least urgent first (PriorityOrder.victims), by the same Scheduler.retract, the same
    one-at-a-time re-check and the same pipeline rule as fairness (preempt_wanted). Counted in
    counters["num_priority_retractions"]. No thrash: a victim is strictly less urgent than the
    request it made room for, so it is ordered behind it and can never retract it back.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, List, NamedTuple, Optional

import torch

from radixserve.engine.policy import Policy
from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.engine.scheduler.fairness import Blocked, FairShare, fair_victims
from radixserve.engine.scheduler.kv import DecodeReserve, SlotLedger
from radixserve.engine.scheduler.priority import PriorityOrder
from radixserve.engine.scheduler.stats import SchedulerStats
from radixserve.model.forward_batch import ForwardMode

if TYPE_CHECKING:
    from radixserve.engine.scheduler.core import Scheduler

logger = logging.getLogger("radixserve.engine.scheduler")

IN_BATCH_SHARE_MIN = 32          # a waiting request sharing this many uncached tokens with one in
                                 # the prefill batch waits a step to reuse them


class _Fit(NamedTuple):
    """A waiting request fits now: its prefix match (locked) and the tokens it computes."""
    match: Any
    prefix_len: int
    n: int
    remaining: int
    own_reserve: float


_SKIP = "skip"     # it waits a step for a prefix this batch computes
_STOP = "stop"     # over the token budget: nothing more this step


class PrefillPlanner:
    """sched: the Scheduler (waiting, running, num_running, inflight_prefills(), fair_share(),
    retract(), step_in_flight()). policy: engine/policy.py's order (wrapped by
    PriorityOrder.order with priorities). chunk_size: None for no chunking.
    max_prefill_tokens: the step's token budget. priority: None unless
    --enable-priority-scheduling (whom to preempt for an urgent request)."""

    def __init__(self, sched: "Scheduler", ledger: SlotLedger, reserve: DecodeReserve,
                 stats: SchedulerStats, policy: Policy, chunk_size: Optional[int],
                 max_prefill_tokens: int, priority: Optional[PriorityOrder] = None):
        self.sched = sched
        self.ledger = ledger
        self.cache = ledger.cache
        self.reserve = reserve
        self.stats = stats
        self.policy = policy
        self.chunk_size = chunk_size
        self.max_prefill_tokens = max_prefill_tokens
        self.priority = priority
        self.chunked_req: Optional[Req] = None      # mid-prefill across steps; ours alone
        self.preempt_wanted = False       # the last admission wanted to preempt over a step
        self._admit_counter = 0

    def forget(self, req: Req) -> None:
        """req leaves the running set (finished, retracted): it is no longer the chunked one."""
        if self.chunked_req is req:
            self.chunked_req = None

    # ------------------------------------------------------------------ a prefill step
    def plan(self) -> Optional[ScheduleBatch]:
        """This step's prefill batch (slots allocated, rows written), or None: nothing waits,
        nothing fits, or the chunked request's next chunk has no memory."""
        self.preempt_wanted = False           # set again by this admission if it still applies
        if self.chunked_req is None and not self.sched.waiting:
            return None
        budget = self.max_prefill_tokens
        if self.chunk_size is not None:
            budget = min(budget, self.chunk_size)
        batch = ScheduleBatch(ForwardMode.EXTEND)
        stats = {"new_seqs": 0, "cached": 0}
        req = self.chunked_req
        if req is not None:
            budget = self._continue_chunk(batch, req, budget)
            if budget is None:
                return None
            if self.chunked_req is req:           # more chunks to go: nothing else this step
                return self._log(batch, stats)
        self._admit_waiting(batch, budget, stats)
        if batch.batch_size == 0:
            return None
        return self._log(batch, stats)

    def _continue_chunk(self, batch: ScheduleBatch, req: Req, budget: int) -> Optional[int]:
        """The chunked request's next chunk; returns the budget left (None: no memory)."""
        remaining = req.seq_len - req.kv_len
        n = min(remaining, budget, self.ledger.room())
        slots = self.ledger.alloc(n) if n > 0 else None
        if slots is None:
            return None
        self._add_extend(batch, req, slots, final=n == remaining)
        return budget - n

    def _admit_waiting(self, batch: ScheduleBatch, budget: int, stats: dict) -> None:
        sched, rows = self.sched, self.ledger.rows
        inflight = sched.inflight_prefills()      # running once the step in flight is processed
        reserve = sum(self.reserve.of(r) for r in sched.running + inflight)
        num_admitted = 0
        num_running = sched.num_running       # once: it walks the step in flight's requests
        fair = sched.fair_share()
        prio = self.priority
        for req in self.policy(list(sched.waiting), self.cache):
            if budget <= 0:
                break
            if fair is not None and not fair.may_admit(req):
                continue
            slots_full = (num_running + num_admitted >= sched.max_running_requests
                          or rows.available_size() == 0)
            if slots_full and not (fair is not None and fair.under(req.client_id)) and \
                    not (prio is not None and prio.may_preempt(req, sched.running)):
                break
            fit = self._fit(req, batch, inflight, budget, reserve, slots_full)
            while isinstance(fit, Blocked):
                victims, why = self._victims(req, fit, fair)
                if not victims:
                    break
                if sched.step_in_flight() is not None:
                    self.preempt_wanted = True    # the pipeline resolves that step first
                    break
                for victim in victims:
                    reserve -= self.reserve.of(victim)
                    sched.retract(victim)
                    if fair is not None:
                        fair.retracted(victim)
                self.stats.count(f"num_{why}_retractions", len(victims))
                num_running -= len(victims)
                if why == "fair":
                    logger.info("Fair-share retraction: #retracted: %d, client share: %d "
                                "running slots", len(victims), fair.share)
                else:
                    logger.info("Priority retraction: #retracted: %d for request %s "
                                "(priority %s)", len(victims), req.rid, req.priority)
                slots_full = (num_running + num_admitted >= sched.max_running_requests
                              or rows.available_size() == 0)
                fit = self._fit(req, batch, inflight, budget, reserve, slots_full)
            if fit is _SKIP:
                continue
            if not isinstance(fit, _Fit):
                break
            slots = self.ledger.alloc(fit.n)
            if slots is None:
                self.cache.dec_lock_ref(fit.match.last_node)
                break
            self._admit(req, fit.match, fit.prefix_len)
            if fair is not None:
                fair.admitted(req)
            stats["cached"] += fit.prefix_len
            stats["new_seqs"] += 1
            num_admitted += 1
            self._add_extend(batch, req, slots, final=fit.n == fit.remaining)
            budget -= fit.n
            reserve += fit.own_reserve
            if fit.n < fit.remaining:
                break

    def _victims(self, req: Req, blocked: Blocked, fair: Optional[FairShare]):
        """(running requests to retract so that req can start, "fair" or "priority"): the
        fairness victims when there are any (fairness.fair_victims), else the priority ones
        (PriorityOrder.victims); ([], None) when neither frees enough."""
        running = self.sched.running
        if fair is not None:
            victims = fair_victims(fair, req, blocked, running, self.reserve.of)
            if victims:
                return victims, "fair"
        if self.priority is not None:
            victims = self.priority.victims(req, blocked, running, self.reserve.of)
            if victims:
                return victims, "priority"
        return [], None

    def _fit(self, req: Req, batch: ScheduleBatch, inflight: List[Req], budget: int,
             reserve: float, slots_full: bool):
        """Can req start in this batch? _Fit (its prefix match locked), Blocked (no running
        slot or not enough KV memory: nothing locked), _SKIP or _STOP."""
        key = req.cache_key
        match = self.cache.match_prefix(key[:req.max_prefix_len()])
        prefix_len = int(match.indices.numel())
        if self._waits_for_batch_prefix(req, batch.reqs + inflight, prefix_len):
            return _SKIP
        remaining = len(key) - prefix_len
        if remaining > budget and (self.chunk_size is None) and batch.batch_size > 0:
            return _STOP
        n = remaining if self.chunk_size is None else min(remaining, budget)
        self.cache.inc_lock_ref(match.last_node)
        own_reserve = self.reserve.of(req) if n == remaining else 0.0
        available = self.ledger.room()
        idle = not self.sched.running and not inflight and batch.batch_size == 0
        hard = n - available
        soft = hard if idle else n + own_reserve + reserve - available
        if slots_full or hard > 0 or soft > 0:
            self.cache.dec_lock_ref(match.last_node)
            return Blocked(slots_full, hard, soft)
        return _Fit(match, prefix_len, n, remaining, own_reserve)

    def _admit(self, req: Req, match, prefix_len: int) -> None:
        """req leaves the waiting queue with a row holding its matched prefix (locked by
        inc_lock_ref already)."""
        self.sched.waiting.remove(req)
        self.ledger.open_row(req, match, prefix_len)
        req.num_output_scheduled = len(req.output_ids)
        req.penalty_ready = False
        req.status = ReqStatus.PREFILL
        req.admit_order = self._admit_counter
        self._admit_counter += 1
        if req.cached_tokens is None:
            req.cached_tokens = prefix_len
            if req.arrival_time is not None:
                req.queue_time = time.perf_counter() - req.arrival_time
            self.stats.count("prompt_tokens", len(req.origin_input_ids))
            self.stats.count("cached_tokens", prefix_len)
            self.stats.prompt_admitted(req, prefix_len)

    def _waits_for_batch_prefix(self, req: Req, others: List[Req], prefix_len: int) -> bool:
        """In-batch prefix sharing: if req's uncached part starts with IN_BATCH_SHARE_MIN tokens
        that a request of `others` (this prefill batch, and the step in flight's prefills) is
        computing, req waits: that request publishes its prompt after the prefill
        (ResultProcessor), so req then reuses it (identical prompts arriving together
        prefill once, not once each)."""
        if not self.cache.supports_sharing:
            return False
        if req.pool is not None and not req.pool.takes_prefix:
            return False      # mean pooling takes no prefix: nothing to wait for
        end = prefix_len + IN_BATCH_SHARE_MIN
        if len(req.fill_ids) - 1 < end:
            return False
        head = req.cache_key[:end]
        return any(other.cache_key[:end] == head for other in others if not
                   other.status == ReqStatus.RUNNING)

    def _add_extend(self, batch: ScheduleBatch, req: Req, slots: torch.Tensor,
                    final: bool) -> None:
        start = self.ledger.extend(req, slots)
        n = int(slots.numel())
        if req.pool is not None:      # a pooling request: no token, its rows pooled instead
            batch.add(req, start, n, slots, sample=False, pool_span=req.pool.span(n, final),
                      pool_final=final)
        else:
            batch.add(req, start, n, slots, sample=final,
                      prompt_lp=self._prompt_lp_range(req, start, n))
        self.chunked_req = None if final else req

    @staticmethod
    def _prompt_lp_range(req: Req, start: int, n: int):
        """Positions of [start, start+n) whose logits score prompt tokens for req (or None)."""
        if not req.wants_prompt_logprobs or req.prompt_logprobs_done:
            return None
        first = max(req.logprob_start_len, 1) - 1
        last = len(req.origin_input_ids) - 1             # exclusive: position P-1 predicts output
        p0, p1 = max(start, first), min(start + n, last)
        return (p0, p1) if p1 > p0 else None

    def _log(self, batch: ScheduleBatch, stats: dict) -> ScheduleBatch:
        self.stats.prefill_step(stats["new_seqs"], batch.num_tokens, stats["cached"],
                                self.ledger.token_usage(), len(self.sched.running),
                                len(self.sched.waiting))
        return batch
