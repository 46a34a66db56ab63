"""The prefix-cache interface the scheduler talks to. RadixCache and ChunkCache implement it.

Ownership of KV slots (the KVPool owns the free list; everything else is a holder):
  * A running request owns the slots it allocated for its own new tokens.
  * The cache owns every slot it indexes (published tokens). A request that matched a prefix
    uses those slots read-only and keeps them alive by holding a lock on the matched node.
  * insert(key, indices) transfers ownership of ALL given slots to the cache. Where the tree
    already holds a position with a different slot (another request published the same tokens
    meanwhile), the cache frees the given duplicate slot to the pool; where it holds the very
    same slot (the caller's matched prefix), nothing happens. ChunkCache, which shares nothing,
    frees every given slot that it did not hand out itself.
Locks: a node with lock_ref > 0, and every node on its path to the root, is never evicted.
Eviction frees only unlocked leaves, least recently used first.
"""
from __future__ import annotations

import abc
from typing import Any, List, NamedTuple, Sequence

import torch


class MatchResult(NamedTuple):
    indices: torch.Tensor   # [matched_len] int64 slots of the matched prefix (CPU tensor)
    last_node: Any          # handle for inc_lock_ref / dec_lock_ref (the deepest matched node)


class PrefixCache(abc.ABC):
    @abc.abstractmethod
    def match_prefix(self, key: List[int]) -> MatchResult:
        """Longest cached prefix of key (whole pages). Touches the matched path (LRU); no other change
        except that a match ending mid-edge may split that edge so last_node ends exactly there."""

    @abc.abstractmethod
    def insert(self, key: List[int], indices: torch.Tensor) -> int:
        """Publish key's KV (indices: [len(key)] slots). Takes ownership of all of indices (see
        module docstring). Returns how many leading positions were already cached before the call."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> None:
        """Protect node and its ancestors from eviction."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> None:
        """Undo one inc_lock_ref(node)."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves (LRU), if that many are evictable.
        Returns the number freed. Never frees a locked node's slots."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Slots the cache owns that no lock protects."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Slots the cache owns that a lock protects."""

    @abc.abstractmethod
    def owned_slots(self) -> torch.Tensor:
        """Every slot the cache owns (int64, CPU), for integrity checks."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop every entry and free its slots (= /flush_cache). Only when nothing is locked."""

    def check_integrity(self) -> None:
        """Raise AssertionError on an internal inconsistency (sizes, lock counts, ordering)."""

    def continuation(self, key: Sequence[int], max_tokens: int) -> List[int]:
        """Up to max_tokens token ids that follow key in a cached sequence whose prefix is all of
        key ([] when none is cached: a cache without a tree). Read-only: touches, splits and
        locks nothing (speculative decoding's suffix drafts, engine/scheduler/spec.py)."""
        return []

    @property
    def supports_sharing(self) -> bool:
        return True
