"""KV bookkeeping shared by the scheduler's parts: the slot ledger and the decode reserve.

SlotLedger holds the KV pool, the host ReqToToken rows and the prefix cache, and is the only
code that moves slots between them and a request (the ownership contract of cache/base.py and
engine/req.py): allocate with eviction, give a request its row over its matched prefix, extend
it, roll back its rejected draft tokens (speculative decoding), publish its computed KV to the
cache, release everything it holds. It knows no queues.

DecodeReserve is admission's estimate of the KV the running requests will still need: each
reserves min(remaining max_new_tokens, RESERVE_CLIP) x new_token_ratio slots. The ratio starts
at INIT_NEW_TOKEN_RATIO x --schedule-conservativeness, decays toward MIN_NEW_TOKEN_RATIO x it
over NEW_TOKEN_RATIO_DECAY_STEPS decode steps while nothing is retracted, and a retraction for
memory resets it (decode.py). Event-loop thread.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from radixserve.cache.base import PrefixCache
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool
from radixserve.engine.req import Req, ReqStatus

INIT_NEW_TOKEN_RATIO = 0.7       # x conservativeness: share of remaining max_new_tokens reserved
MIN_NEW_TOKEN_RATIO = 0.1        # the ratio decays to this (x conservativeness) while nothing retracts
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RESERVE_CLIP = 4096              # per-request cap on the decode reserve


class DecodeReserve:
    def __init__(self, conservativeness: float):
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_ratio = min(MIN_NEW_TOKEN_RATIO * conservativeness, self.init_ratio)
        self.ratio = self.init_ratio

    def of(self, req: Req) -> float:
        """The KV slots req is expected to still need for its decode tokens."""
        return min(req.remaining_new_tokens(), RESERVE_CLIP) * self.ratio

    def decay(self) -> None:
        """One decode step without retraction."""
        self.ratio = max(self.ratio - (self.init_ratio - self.min_ratio)
                         / NEW_TOKEN_RATIO_DECAY_STEPS, self.min_ratio)

    def reset(self) -> float:
        """A retraction for memory: back to the initial ratio. Returns the old one."""
        old, self.ratio = self.ratio, self.init_ratio
        return old


class SlotLedger:
    def __init__(self, kv_pool: KVPool, rows: ReqToTokenPool, cache: PrefixCache):
        self.kv_pool = kv_pool
        self.rows = rows
        self.cache = cache

    # ------------------------------------------------------------------ capacity
    def room(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.kv_pool.available_size() + self.cache.evictable_size()

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """n free slots ([n] int64), evicting from the cache as needed; None if short."""
        if self.kv_pool.available_size() < n:
            self.cache.evict(n - self.kv_pool.available_size())
        return self.kv_pool.alloc(n)

    def num_used_tokens(self) -> int:
        return self.kv_pool.num_slots - self.kv_pool.available_size() - self.cache.evictable_size()

    def token_usage(self) -> float:
        return self.num_used_tokens() / max(self.kv_pool.num_slots, 1)

    # ------------------------------------------------------------------ a request's slots
    def open_row(self, req: Req, match: Any, prefix_len: int) -> None:
        """Give req a row holding its matched prefix (locked by inc_lock_ref already)."""
        row = self.rows.alloc()
        req.req_pool_idx = row
        req.prefix_indices = match.indices
        req.last_node = match.last_node
        req.kv_len = prefix_len
        if prefix_len:
            self.rows.write(row, 0, match.indices)

    def extend(self, req: Req, slots: torch.Tensor) -> int:
        """Append slots to req's row at kv_len; returns the position they start at."""
        start = req.kv_len
        self.rows.write(req.req_pool_idx, start, slots)
        req.kv_len += int(slots.numel())
        return start

    def extend_many(self, reqs, slots: torch.Tensor) -> None:
        """One slot per request at its kv_len, in one indexed write (a decode step)."""
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.rows.write_many(rows, cols, slots)

    def publish(self, req: Req) -> None:
        """Hand req's computed slots to the cache and lock the new path; the row is re-pointed
        at the cache's slots (the next step carries that write to the device)."""
        kv = req.kv_len
        key = req.cache_key[:kv]
        slots = self.rows.slots(req.req_pool_idx, kv)
        self.cache.insert(key, slots)
        match = self.cache.match_prefix(key)
        self.cache.inc_lock_ref(match.last_node)
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.prefix_indices = match.indices
        self.rows.write(req.req_pool_idx, 0, match.indices)
        # a cache that publishes whole pages only may keep less: those tokens get recomputed
        req.kv_len = int(match.indices.numel())

    def rollback(self, req: Req, kv_len: int) -> None:
        """Free req's own slots at positions [kv_len, req.kv_len) and shorten it to kv_len (a
        verify step's rejected draft tokens: their KV was written but is not the request's).
        The host row keeps stale entries past kv_len, as after any release; the next extend of
        the request overwrites them (its table writes travel with that step)."""
        kv_len = max(kv_len, req.prefix_len)
        if kv_len >= req.kv_len:
            return
        slots = self.rows.slots(req.req_pool_idx, req.kv_len)[kv_len:]
        self.kv_pool.free(slots)
        req.kv_len = kv_len

    def drop_own(self, req: Req) -> None:
        """Free the slots req allocated itself (kv beyond its prefix), not publishing them: a
        failed step's KV is not trustworthy."""
        own = self.rows.slots(req.req_pool_idx, req.kv_len)[req.prefix_len:]
        self.kv_pool.free(own)
        req.kv_len = req.prefix_len

    def release(self, req: Req, keep: Optional[int] = None) -> None:
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
        slots = self.rows.slots(req.req_pool_idx, req.kv_len)
        self.cache.insert(req.cache_key[:kv], slots[:kv])
        self.kv_pool.free(slots[kv:])
        self.cache.dec_lock_ref(req.last_node)
        self.rows.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.kv_len = 0
