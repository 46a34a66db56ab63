"""ChunkCache: the prefix cache that shares nothing (--disable-radix-cache).

Every lookup misses, so every request prefills its whole prompt. insert() takes ownership of the
given slots as the PrefixCache contract says, and since ChunkCache never hands slots out it
frees all of them to the pool at once. The scheduler keeps a chunked-prefill request's own slots
with the request (it does not publish them, see Scheduler) because publishing here frees them.
"""
from __future__ import annotations

from typing import Any, List

import torch

from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.kv_pool import KVPool


class ChunkCache(PrefixCache):
    def __init__(self, kv_pool: KVPool, page_size: int = 1):
        self.kv_pool = kv_pool
        self.page_size = page_size

    @property
    def supports_sharing(self) -> bool:
        return False

    def match_prefix(self, key: List[int]) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), None)

    def insert(self, key: List[int], indices: torch.Tensor) -> int:
        self.kv_pool.free(indices)
        return 0

    def inc_lock_ref(self, node: Any) -> None:
        return None

    def dec_lock_ref(self, node: Any) -> None:
        return None

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def owned_slots(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        return None

    def check_integrity(self) -> None:
        return None
