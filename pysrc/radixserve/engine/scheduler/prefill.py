"""Admission and prefill: which waiting requests start this step, and the chunk each computes.

A prefill step continues the chunked request first, then admits waiting requests in policy
order under the token budget (max_prefill_tokens, and chunked_prefill_size which splits a long
prompt across steps), the request cap, a free ReqToToken row, and memory: free + evictable slots
must cover the new prefill tokens plus a reserve for the running requests' future decode tokens,
scaled by new_token_ratio. With --enable-mixed-chunk the running decodes ride along in the same
forward (their input ids come from the device). Part of Scheduler (core.py): these methods use
its state and run on the event-loop thread.

Fairness between clients (Req.client_id: the API key's identity, else the peer address; None is
one anonymous client). A client's running slots are its requests that are decoding, mid-chunk,
or ending their prefill in the step in flight. While requests of two or more clients are live
(running or waiting), each client's share is --max-running-requests-per-client when given, else
max_running_requests // (the number of those clients), at least 1. A lone client has no share:
it may use every slot. (--max-running-requests-per-client equal to --max-running-requests turns
fairness off: nobody can exceed it.)
  * Admission: a waiting request whose client holds its share or more is passed over while a
    client under its share has a request waiting; when every waiting client is at or over its
    share, free slots go to requests in policy order (work conserving).
  * Preemption: when a request of a client strictly under its share cannot start because the
    running slots (max_running_requests, ReqToToken rows) or the KV memory are taken, and some
    other client is strictly over its share, the latest-admitted running requests of the client
    most over its share are retracted, one at a time and only as many as it takes to admit the
    request (none when even all of them could not make it fit). A retraction is decode.py's:
    the victim's computed KV is published to the radix tree and it goes back to the front of the
    queue with its output, so when it resumes it re-matches its prefix and computes only the
    uncached tail (one token, unless eviction took some of its KV meanwhile). These are counted
    in counters["num_fair_retractions"] (num_retractions counts memory retractions only).
  * No thrash: a victim's client still holds at least its share afterwards and the request it
    made room for leaves its client at most at its share, so neither can preempt the other next
    (clients at their share never ping-pong); the victim is not considered again in the step
    that retracted it, and afterwards admission passes it over while a client under its share
    waits, so it never restarts ahead of the request it made room for.
  * Pipeline: retraction needs the exact host state, so it happens only with no step in flight.
    An admission that would preempt while a step is in flight sets fair_preempt_pending(); the
    pipeline then resolves the step in flight before scheduling the next (as it does for
    decode_memory_short), and that next prefill step preempts.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, NamedTuple, Optional, Set

import torch

from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")

RESERVE_CLIP = 4096              # per-request cap on the decode reserve
IN_BATCH_SHARE_MIN = 32          # a waiting request sharing this many uncached tokens with one in
                                 # the prefill batch waits a step to reuse them


class FairShare:
    """One admission's view of fairness (module docstring): running slots per client, the
    clients with requests waiting, and the share. Kept current as requests are admitted and
    retracted during the step."""

    def __init__(self, holding: Dict[Optional[str], int], waiting: Dict[Optional[str], int],
                 share: int):
        self.holding = holding
        self.waiting = waiting
        self.share = share
        # waiting clients under their share: while any waits, clients at their share wait too
        self.under_waiting: Set[Optional[str]] = {c for c in waiting if self.under(c)}

    def under(self, client: Optional[str]) -> bool:
        return self.holding.get(client, 0) < self.share

    def over(self, client: Optional[str]) -> bool:
        return self.holding.get(client, 0) > self.share

    def may_admit(self, req: Req) -> bool:
        return self.under(req.client_id) or not self.under_waiting

    def admitted(self, req: Req) -> None:
        c = req.client_id
        self.holding[c] = self.holding.get(c, 0) + 1
        self.waiting[c] = self.waiting.get(c, 1) - 1
        if self.waiting[c] <= 0 or not self.under(c):
            self.under_waiting.discard(c)

    def retracted(self, req: Req) -> None:
        c = req.client_id
        self.holding[c] = self.holding.get(c, 0) - 1
        self.waiting[c] = self.waiting.get(c, 0) + 1
        if self.under(c):
            self.under_waiting.add(c)


class _Fit(NamedTuple):
    """A waiting request fits now: its prefix match (locked) and the tokens it computes."""
    match: object
    prefix_len: int
    n: int
    remaining: int
    own_reserve: float


class _Blocked(NamedTuple):
    """A waiting request cannot start now: no running slot, and/or this many KV slots short
    (hard: for its tokens; soft: with the decode reserve)."""
    slots_full: bool
    hard: float
    soft: float


_SKIP = "skip"     # it waits a step for a prefix this batch computes
_STOP = "stop"     # over the token budget: nothing more this step


class PrefillMixin:
    def _alloc(self, n: int) -> Optional[torch.Tensor]:
        if self.kv_pool.available_size() < n:
            self.cache.evict(n - self.kv_pool.available_size())
        return self.kv_pool.alloc(n)

    def _reserve(self, req: Req) -> float:
        return min(req.remaining_new_tokens(), RESERVE_CLIP) * self.new_token_ratio

    def _prompt_lp_range(self, req: Req, start: int, n: int):
        """Positions of [start, start+n) whose logits score prompt tokens for req (or None)."""
        if not req.wants_prompt_logprobs or req.prompt_logprobs_done:
            return None
        first = max(req.logprob_start_len, 1) - 1
        last = len(req.origin_input_ids) - 1             # exclusive: position P-1 predicts output
        p0, p1 = max(start, first), min(start + n, last)
        return (p0, p1) if p1 > p0 else None

    def _prefill_batch(self) -> Optional[ScheduleBatch]:
        self._fair_preempt_wanted = False     # set again by this admission if it still applies
        if self.chunked_req is None and not self.waiting:
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
                return self._log_prefill(batch, stats)
        self._admit_waiting(batch, budget, stats)
        if batch.batch_size == 0:
            return None
        return self._log_prefill(batch, stats)

    def _continue_chunk(self, batch: ScheduleBatch, req: Req, budget: int) -> Optional[int]:
        """The chunked request's next chunk; returns the budget left (None: no memory)."""
        remaining = req.seq_len - req.kv_len
        n = min(remaining, budget, self.kv_pool.available_size() + self.cache.evictable_size())
        slots = self._alloc(n) if n > 0 else None
        if slots is None:
            return None
        self._add_extend(batch, req, slots, final=n == remaining)
        return budget - n

    def _admit_waiting(self, batch: ScheduleBatch, budget: int, stats: dict) -> None:
        inflight = self._inflight_prefills()        # running once the step in flight is processed
        reserve = sum(self._reserve(r) for r in self.running + inflight)
        num_admitted = 0
        num_running = self.num_running        # once: it walks the step in flight's requests
        fair = self._fair_share()
        for req in self.policy(list(self.waiting), self.cache):
            if budget <= 0:
                break
            if fair is not None and not fair.may_admit(req):
                continue
            slots_full = (num_running + num_admitted >= self.max_running_requests
                          or self.req_to_token_pool.available_size() == 0)
            if slots_full and (fair is None or not fair.under(req.client_id)):
                break
            fit = self._fit(req, batch, inflight, budget, reserve, slots_full)
            while isinstance(fit, _Blocked) and fair is not None:
                victims = self._fair_victims(fair, req, fit)
                if not victims:
                    break
                if self.pipeline.inflight is not None:
                    self._fair_preempt_wanted = True    # the pipeline resolves that step first
                    break
                for victim in victims:
                    reserve -= self._reserve(victim)
                    self._retract(victim)
                    fair.retracted(victim)
                self.counters["num_fair_retractions"] += len(victims)
                num_running -= len(victims)
                logger.info("Fair-share retraction: #retracted: %d, client share: %d running "
                            "slots", len(victims), fair.share)
                slots_full = (num_running + num_admitted >= self.max_running_requests
                              or self.req_to_token_pool.available_size() == 0)
                fit = self._fit(req, batch, inflight, budget, reserve, slots_full)
            if fit is _SKIP:
                continue
            if not isinstance(fit, _Fit):
                break
            slots = self._alloc(fit.n)
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

    def _fit(self, req: Req, batch: ScheduleBatch, inflight: List[Req], budget: int,
             reserve: float, slots_full: bool):
        """Can req start in this batch? _Fit (its prefix match locked), _Blocked (no running
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
        own_reserve = self._reserve(req) if n == remaining else 0.0
        available = self.kv_pool.available_size() + self.cache.evictable_size()
        idle = not self.running and not inflight and batch.batch_size == 0
        hard = n - available
        soft = hard if idle else n + own_reserve + reserve - available
        if slots_full or hard > 0 or soft > 0:
            self.cache.dec_lock_ref(match.last_node)
            return _Blocked(slots_full, hard, soft)
        return _Fit(match, prefix_len, n, remaining, own_reserve)

    def _fair_victims(self, fair: FairShare, req: Req, blocked: _Blocked) -> List[Req]:
        """The running requests to retract so that req (of a client under its share) can start:
        repeatedly the latest-admitted request of the client most over its share (ties: the
        one with the later admission), never taking a client below its share, until a running
        slot is free (if none is) and their KV and decode reserve could cover the memory
        shortfall. Their KV is counted whole (the prefix too), an upper bound: admission
        re-checks after retracting and asks again if still short. [] when even every such
        request could not make room (nothing is retracted for nothing)."""
        client = req.client_id
        if not fair.under(client):
            return []
        share = fair.share
        holding = dict(fair.holding)
        pools: Dict[Optional[str], List[Req]] = {}
        for r in self.running:
            if r.client_id != client and holding.get(r.client_id, 0) > share:
                pools.setdefault(r.client_id, []).append(r)
        for rs in pools.values():
            rs.sort(key=lambda r: r.admit_order, reverse=True)
        victims: List[Req] = []
        kv_gain, reserve_gain = 0, 0.0
        while (blocked.slots_full and not victims) or kv_gain < blocked.hard or \
                kv_gain + reserve_gain < blocked.soft:
            over = [c for c, rs in pools.items() if rs and holding[c] > share]
            if not over:
                return []
            c = max(over, key=lambda k: (holding[k] - share, pools[k][0].admit_order))
            victim = pools[c].pop(0)
            holding[c] -= 1
            victims.append(victim)
            kv_gain += victim.kv_len
            reserve_gain += self._reserve(victim)
        return victims

    def fair_preempt_pending(self) -> bool:
        """The last admission wanted to retract requests of a client over its share for a
        client under it, but a step was in flight: the pipeline resolves that step before
        scheduling the next, which then preempts (module docstring)."""
        return self._fair_preempt_wanted and bool(self.waiting)

    def _fair_share(self) -> Optional[FairShare]:
        """Fairness between clients for this admission (module docstring); None while the live
        requests are all one client's."""
        holding: Dict[Optional[str], int] = {}
        for r in self.running + ([self.chunked_req] if self.chunked_req else []) + \
                self._inflight_prefills():
            holding[r.client_id] = holding.get(r.client_id, 0) + 1
        waiting: Dict[Optional[str], int] = {}
        for r in self.waiting:
            waiting[r.client_id] = waiting.get(r.client_id, 0) + 1
        clients = len(set(holding) | set(waiting))
        if clients < 2:
            return None
        cap = self.server_args.max_running_requests_per_client
        share = cap if cap is not None else max(self.max_running_requests // clients, 1)
        return FairShare(holding, waiting, share)

    def _admit(self, req: Req, match, prefix_len: int) -> None:
        """Give req a row holding its matched prefix (locked by inc_lock_ref already)."""
        row = self.req_to_token_pool.alloc()
        self.waiting.remove(req)
        req.req_pool_idx = row
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.kv_len = prefix_len
        req.num_output_scheduled = len(req.output_ids)
        req.penalty_ready = False
        if prefix_len:
            self.req_to_token_pool.write(row, 0, match.indices)
        req.status = ReqStatus.PREFILL
        req.admit_order = self._admit_counter
        self._admit_counter += 1
        if req.cached_tokens is None:
            req.cached_tokens = prefix_len
            if req.arrival_time is not None:
                req.queue_time = time.perf_counter() - req.arrival_time
            self.counters["prompt_tokens"] += len(req.origin_input_ids)
            self.counters["cached_tokens"] += prefix_len

    def _waits_for_batch_prefix(self, req: Req, others: List[Req], prefix_len: int) -> bool:
        """In-batch prefix sharing: if req's uncached part starts with IN_BATCH_SHARE_MIN tokens
        that a request of `others` (this prefill batch, and the step in flight's prefills) is
        computing, req waits: that request publishes its prompt after the prefill
        (process_batch_result), so req then reuses it (identical prompts arriving together
        prefill once, not once each)."""
        if not self.cache.supports_sharing:
            return False
        end = prefix_len + IN_BATCH_SHARE_MIN
        if len(req.fill_ids) - 1 < end:
            return False
        head = req.cache_key[:end]
        return any(other.cache_key[:end] == head for other in others if not
                   other.status == ReqStatus.RUNNING)

    def _add_extend(self, batch: ScheduleBatch, req: Req, slots: torch.Tensor, final: bool) -> None:
        start, n = req.kv_len, int(slots.numel())
        self.req_to_token_pool.write(req.req_pool_idx, start, slots)
        req.kv_len += n
        batch.add(req, start, n, slots, sample=final,
                  prompt_lp=self._prompt_lp_range(req, start, n))
        self.chunked_req = None if final else req

    def _publish_chunk(self, req: Req) -> None:
        """After a prefill chunk: hand its slots to the cache and lock the new path; the row is
        re-pointed at the cache's slots (the next step carries that write to the device)."""
        kv = req.kv_len
        key = req.cache_key[:kv]
        slots = self.req_to_token_pool.slots(req.req_pool_idx, kv)
        self.cache.insert(key, slots)
        match = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_indices = match.indices
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.indices)
        # a cache that publishes whole pages only may keep less: those tokens get recomputed
        req.kv_len = int(match.indices.numel())

    def _log_prefill(self, batch: ScheduleBatch, stats: dict) -> ScheduleBatch:
        self.counters["num_prefill_steps"] += 1
        logger.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, "
                    "token usage: %.2f, #running-req: %d, #queue-req: %d",
                    stats["new_seqs"], batch.num_tokens, stats["cached"], self.token_usage(),
                    len(self.running), len(self.waiting))
        return batch
