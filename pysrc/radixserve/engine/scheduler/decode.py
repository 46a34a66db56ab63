"""Decode and retraction: one new token for every running request, and room for it.

A decode step gives each running request one slot, in one allocation and one indexed write of
the host rows; the device writes its own copy of the rows and reads the input ids it sampled
last step (model/forward_batch.decode_prologue), so building a decode step never needs that step's
predecessor to have reached the host. A request whose remaining tokens are all scheduled already
(max_new_tokens covered by the step in flight) is left out.

If the pool cannot give every running request its slot even after eviction, the latest-admitted
requests are retracted to the front of the queue: their computed KV is published to the cache
(so resuming re-matches it) and they keep their output. While a client is over its fair share
(prefill.py), the victims are that client's requests first, latest admitted first, so a
retraction for memory does not undo a preemption made for fairness. Retraction needs the exact
host state, so the pipeline resolves the step in flight before a step that may retract
(decode_memory_short).

Retraction for fairness (prefill.py) uses the same _retract: when a request of a client under
its share cannot start for lack of running slots or KV memory, the latest-admitted requests of
a client strictly over its share are retracted, just enough to admit it, at admission with no
step in flight (the pipeline resolves it first when fair_preempt_pending()). They are counted in
counters["num_fair_retractions"]; num_retractions counts retractions for memory only.
Part of Scheduler (core.py); event-loop thread.
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional

import torch

from radixserve.engine.req import Req, ReqStatus
from radixserve.engine.schedule_batch import ScheduleBatch
from radixserve.model.forward_batch import ForwardMode

logger = logging.getLogger("radixserve.engine.scheduler")

NEW_TOKEN_RATIO_DECAY_STEPS = 600
DECODE_LOG_INTERVAL = 40


class DecodeMixin:
    def _decoding(self) -> List[Req]:
        """Running requests that still need a decode step."""
        return [r for r in self.running if not r.done_scheduling(self.context_len)]

    def decode_memory_short(self) -> bool:
        """A decode step now could not give every running request a slot without retracting."""
        need = len(self._decoding())
        return need > self.kv_pool.available_size() + self.cache.evictable_size()

    def _decode_batch(self) -> Optional[ScheduleBatch]:
        if not self.running:
            return None
        self._ensure_decode_memory()
        reqs = self._decoding()
        if not reqs:
            return None
        slots = self.kv_pool.alloc(len(reqs))                       # [B] int64
        batch = ScheduleBatch(ForwardMode.DECODE)
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_to_token_pool.write_many(rows, cols, slots)
        for req in reqs:                 # the slots travel as one tensor: batch.decode_slots
            batch.add(req, req.kv_len, 1, None, sample=True, from_device=True)
            req.kv_len += 1
        batch.decode_slots = slots
        self._decay_new_token_ratio()
        self._log_decode(len(reqs))
        return batch

    def _add_decode_rows(self, batch: ScheduleBatch) -> None:
        """--enable-mixed-chunk: the running decodes join an extend batch (one new token each,
        read from the device), so a long prefill costs them one step, not the whole prefill."""
        reqs = self._decoding()
        if not reqs or self.decode_memory_short():
            return
        if self.kv_pool.available_size() < len(reqs):
            self.cache.evict(len(reqs) - self.kv_pool.available_size())
        slots = self.kv_pool.alloc(len(reqs))
        if slots is None:
            return
        for i, req in enumerate(reqs):
            slot = slots[i:i + 1]
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slot)
            batch.add(req, req.kv_len, 1, slot, sample=True, from_device=True)
            req.kv_len += 1

    def _decay_new_token_ratio(self) -> None:
        self.new_token_ratio = max(
            self.new_token_ratio - (self.init_new_token_ratio - self.min_new_token_ratio)
            / NEW_TOKEN_RATIO_DECAY_STEPS, self.min_new_token_ratio)

    def _log_decode(self, batch_size: int) -> None:
        self._num_decode_steps += 1
        self.counters["num_decode_steps"] += 1
        if self._num_decode_steps % DECODE_LOG_INTERVAL:
            return
        now = time.perf_counter()
        elapsed = max(now - self._decode_log_time, 1e-9)
        self.gen_throughput = self._decode_log_tokens / elapsed
        self.gpu_busy_fraction = min(self._device_time / elapsed, 1.0)
        self._decode_log_tokens, self._decode_log_time, self._device_time = 0, now, 0.0
        logger.info("Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, #queue-req: %d",
                    batch_size, self.num_used_tokens(), self.token_usage(),
                    self.gen_throughput, len(self.waiting))

    def _ensure_decode_memory(self) -> None:
        """Make one free slot per decoding request: evict, then retract (latest admitted first;
        the chunked request counts as a candidate too). Only with no step in flight when it
        must retract (the pipeline checks decode_memory_short first)."""
        retracted: List[Req] = []
        while True:
            need = len(self._decoding())
            short = need - self.kv_pool.available_size()
            if need == 0 or short <= 0:
                break
            self.cache.evict(short)
            if need <= self.kv_pool.available_size():
                break
            victim = self._retraction_victim()
            if victim is None:
                # cannot happen while admission keeps prompt + max_new_tokens within the pool;
                # fail the request honestly rather than the step
                for req in self._decoding():
                    self._finish(req, {"type": "abort", "matched": None, "message":
                                       f"the KV pool ({self.kv_pool.num_slots} slots) cannot hold "
                                       f"this request's next token; raise --max-total-tokens"})
                break
            self._retract(victim)
            retracted.append(victim)
        if retracted:
            old = self.new_token_ratio
            self.new_token_ratio = self.init_new_token_ratio
            self.counters["num_retractions"] += len(retracted)
            logger.warning("Retract requests: #retracted: %d, #new-token-ratio: %.4f -> %.4f",
                           len(retracted), old, self.new_token_ratio)

    def _retraction_victim(self) -> Optional[Req]:
        """The latest admitted of the running requests and the chunked one, keeping at least one
        running request (admission guarantees a lone request fits the pool); while clients are
        over their fair share (prefill.py), the latest admitted of theirs."""
        candidates = list(self.running) + ([self.chunked_req] if self.chunked_req else [])
        if len(candidates) <= 1:
            return None
        fair = self._fair_share()
        if fair is not None:
            over = [r for r in candidates if fair.over(r.client_id)]
            if over:
                candidates = over
        return max(candidates, key=lambda r: r.admit_order)

    def _retract(self, req: Req) -> None:
        if req is self.chunked_req:
            self.chunked_req = None
        else:
            self.running.remove(req)
        self._release_kv(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        req.num_output_scheduled = len(req.output_ids)
        # the earliest-admitted of the retracted ends up first (each later victim is pushed first)
        self.waiting.appendleft(req)
