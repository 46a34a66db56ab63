"""Admission and prefill: which waiting requests start this step, and the chunk each computes.

A prefill step continues the chunked request first, then admits waiting requests in policy
order under the token budget (max_prefill_tokens, and chunked_prefill_size which splits a long
prompt across steps), the request cap, a free ReqToToken row, and memory: free + evictable slots
must cover the new prefill tokens plus a reserve for the running requests' future decode tokens,
scaled by new_token_ratio. With --enable-mixed-chunk the running decodes ride along in the same
forward (their input ids come from the device). Part of Scheduler (core.py): these methods use
its state and run on the event-loop thread.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch

from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")

RESERVE_CLIP = 4096              # per-request cap on the decode reserve
IN_BATCH_SHARE_MIN = 32          # a waiting request sharing this many uncached tokens with one in
                                 # the prefill batch waits a step to reuse them


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
            if budget <= 0 or num_running + num_admitted >= self.max_running_requests:
                break
            if self.req_to_token_pool.available_size() == 0:
                break
            if fair is not None and not fair(req):
                continue
            key = req.cache_key
            match = self.cache.match_prefix(key[:req.max_prefix_len()])
            prefix_len = int(match.indices.numel())
            if self._waits_for_batch_prefix(req, batch.reqs + inflight, prefix_len):
                continue
            remaining = len(key) - prefix_len
            if remaining > budget and (self.chunk_size is None) and batch.batch_size > 0:
                break
            n = remaining if self.chunk_size is None else min(remaining, budget)
            self.cache.inc_lock_ref(match.last_node)
            own_reserve = self._reserve(req) if n == remaining else 0.0
            available = self.kv_pool.available_size() + self.cache.evictable_size()
            idle = not self.running and not inflight and batch.batch_size == 0
            if (n > available) or (not idle and n + own_reserve + reserve > available):
                self.cache.dec_lock_ref(match.last_node)
                break
            slots = self._alloc(n)
            if slots is None:
                self.cache.dec_lock_ref(match.last_node)
                break
            self._admit(req, match, prefix_len)
            stats["cached"] += prefix_len
            stats["new_seqs"] += 1
            num_admitted += 1
            self._add_extend(batch, req, slots, final=n == remaining)
            budget -= n
            reserve += own_reserve
            if n < remaining:
                break

    def _fair_share(self):
        """--max-running-requests-per-client: a predicate admitting a request unless its client
        already holds its share of running slots while another client's request waits (work
        conserving: a lone client may use every slot). None when there is no cap."""
        cap = self.server_args.max_running_requests_per_client
        if cap is None:
            return None
        holding: Dict[Optional[str], int] = {}
        for r in self.running + ([self.chunked_req] if self.chunked_req else []) + \
                self._inflight_prefills():
            holding[r.client_id] = holding.get(r.client_id, 0) + 1
        waiting_clients = {r.client_id for r in self.waiting}

        def admit(req: Req) -> bool:
            others_wait = len(waiting_clients - {req.client_id}) > 0
            if others_wait and holding.get(req.client_id, 0) >= cap:
                return False
            holding[req.client_id] = holding.get(req.client_id, 0) + 1
            return True
        return admit

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
