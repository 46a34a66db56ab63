"""RadixCache: property tests against a naive model, plus deterministic scenarios.

The naive model maps every cached prefix (a tuple of token ids, a whole number of pages) to the
slots of its last page. The tree is prefix-closed, so "the longest cached prefix" is the longest
key[:i] in that map, and the slots of a match are the map's entries for each page of key[:i] (the
slots of whoever first published each position). A real KVPool on the CPU accounts for every slot after every step.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache

POOL_SLOTS = 48
keys = st.lists(st.integers(0, 3), min_size=0, max_size=14)


def make_pool(num_slots: int = POOL_SLOTS) -> KVPool:
    return KVPool(num_slots, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")


# ------------------------------------------------------------------ property tests

class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self):
        super().__init__()
        self.pool = make_pool()
        self.cache = RadixCache(self.pool, page_size=self.page_size)
        self.model: Dict[Tuple[int, ...], int] = {}     # cached prefix -> slot of its last token
        self.locks: List[Tuple[object, Tuple[int, ...]]] = []   # (node handle, locked prefix)

    # -- model helpers (in pages: a cached prefix is a whole number of pages)
    def model_match_len(self, key: List[int]) -> int:
        i, p = 0, self.page_size
        while i + p <= len(key) and tuple(key[:i + p]) in self.model:
            i += p
        return i

    def model_slots(self, key: List[int], n: int) -> List[int]:
        p = self.page_size
        return [s for j in range(p, n + 1, p) for s in self.model[tuple(key[:j])]]

    def locked_prefixes(self):
        out = set()
        for _, prefix in self.locks:
            out.update(prefix[:j] for j in range(self.page_size, len(prefix) + 1, self.page_size))
        return out

    def sync_model_after_eviction(self) -> None:
        free = set(self.pool.free_slots().tolist())
        self.model = {k: v for k, v in self.model.items() if not free.intersection(v)}

    def alloc(self, n: int):
        """Allocate like the scheduler does: evict from the tree when the pool runs short."""
        if self.pool.available_size() < n:
            self.cache.evict(n - self.pool.available_size())
            self.sync_model_after_eviction()
        return self.pool.alloc(n)

    def check_match(self, key: List[int]):
        res = self.cache.match_prefix(key)
        n = self.model_match_len(key)
        assert res.indices.dtype == torch.int64
        assert res.indices.tolist() == self.model_slots(key, n), (key, n)
        return res, n

    # -- rules
    @rule(key=keys)
    def match(self, key):
        self.check_match(key)

    @rule(key=keys)
    def insert_after_match(self, key):
        """A request that reused its matched prefix and computed the rest into new slots."""
        res, n = self.check_match(key)
        # The scheduler locks its match while it allocates, so eviction cannot free that prefix.
        self.cache.inc_lock_ref(res.last_node)
        new = self.alloc(len(key) - n)
        self.cache.dec_lock_ref(res.last_node)
        if new is None:
            return
        self.publish(key, torch.cat([res.indices, new]))

    @rule(key=keys)
    def insert_duplicate(self, key):
        """A request that computed the whole key itself (e.g. two identical prompts in one batch)."""
        new = self.alloc(len(key))
        if new is None:
            return
        self.publish(key, new)

    def publish(self, key: List[int], slots: torch.Tensor) -> None:
        n = len(key) - len(key) % self.page_size
        expected_already = self.model_match_len(key[:n]) if n else 0
        already = self.cache.insert(key, slots)
        assert already == expected_already
        p = self.page_size
        for j in range(p, n + 1, p):
            self.model.setdefault(tuple(key[:j]), tuple(slots[j - p:j].tolist()))

    @rule(key=keys)
    def lock(self, key):
        res, n = self.check_match(key)
        self.cache.inc_lock_ref(res.last_node)
        self.locks.append((res.last_node, tuple(key[:n])))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 20))
    def evict(self, num_tokens):
        evictable_before = self.cache.evictable_size()
        locked = {k: self.model[k] for k in self.locked_prefixes()}
        freed = self.cache.evict(num_tokens)
        assert freed >= min(num_tokens, evictable_before)
        assert self.cache.evictable_size() == evictable_before - freed
        self.sync_model_after_eviction()
        for k, page in locked.items():
            assert self.model.get(k) == page, "a locked prefix was evicted"

    @rule()
    def reset(self):
        while self.locks:
            self.cache.dec_lock_ref(self.locks.pop()[0])
        self.cache.reset()
        self.model.clear()

    @invariant()
    def consistent(self):
        self.cache.check_integrity()
        owned = sorted(self.cache.owned_slots().tolist())
        assert owned == sorted(s for page in self.model.values() for s in page)
        assert self.pool.available_size() + len(owned) == POOL_SLOTS, "a slot leaked"
        protected = len(self.locked_prefixes()) * self.page_size
        assert self.cache.protected_size() == protected
        assert self.cache.evictable_size() == len(owned) - protected
        # the model is prefix-closed, as the tree is
        for k in self.model:
            assert len(k) == self.page_size or k[:-self.page_size] in self.model


class RadixMachinePage4(RadixMachine):
    page_size = 4


TestRadixProperties = RadixMachine.TestCase
TestRadixProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixPropertiesPage4 = RadixMachinePage4.TestCase
TestRadixPropertiesPage4.settings = settings(max_examples=100, stateful_step_count=40,
                                             deadline=None)


# ------------------------------------------------------------- deterministic tests

def publish(pool, cache, key):
    """Match, allocate the rest, insert; returns the slots the sequence ended up with."""
    res = cache.match_prefix(key)
    new = pool.alloc(len(key) - res.indices.numel())
    assert new is not None
    cache.insert(key, torch.cat([res.indices, new]))
    return torch.cat([res.indices, new])


def test_mid_edge_divergence_splits_the_edge():
    pool = make_pool()
    cache = RadixCache(pool)
    a = publish(pool, cache, [1, 2, 3, 4, 5])
    dup = pool.alloc(5)
    assert cache.insert([1, 2, 3, 9, 9], dup) == 3
    (mid,) = cache.root.children.values()
    assert mid.key == [1, 2, 3] and mid.value.tolist() == a[:3].tolist()
    assert sorted(c.key for c in mid.children.values()) == [[4, 5], [9, 9]]
    # the three duplicate slots went back to the pool; the two new ones are owned
    assert pool.available_size() + cache.total_size() == POOL_SLOTS
    assert cache.match_prefix([1, 2, 3, 9, 9, 0]).indices.tolist() == a[:3].tolist() + dup[3:].tolist()
    cache.check_integrity()


def test_match_ending_mid_edge_splits_so_last_node_ends_at_the_match():
    pool = make_pool()
    cache = RadixCache(pool)
    a = publish(pool, cache, [1, 2, 3, 4, 5, 6])
    res = cache.match_prefix([1, 2, 3, 7])
    assert res.indices.tolist() == a[:3].tolist()
    assert res.last_node.key == [1, 2, 3] and cache.num_nodes() == 3
    cache.inc_lock_ref(res.last_node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 3
    assert cache.evict(100) == 3                       # only the unlocked tail [4, 5, 6]
    assert cache.match_prefix([1, 2, 3, 4]).indices.tolist() == a[:3].tolist()
    cache.dec_lock_ref(res.last_node)
    cache.check_integrity()


def test_repeated_prompt_matches_fully_in_the_tree():
    # The tree matches everything it holds; limiting a repeated prompt to len - 1 cached tokens
    # (so its last token is computed for the logits) is the scheduler's job: it matches key[:-1].
    pool = make_pool()
    cache = RadixCache(pool)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    slots = publish(pool, cache, prompt)
    assert cache.match_prefix(prompt).indices.tolist() == slots.tolist()
    res = cache.match_prefix(prompt[:-1])
    assert res.indices.tolist() == slots[:-1].tolist()
    assert res.last_node.key[-1] == prompt[-2]
    cache.check_integrity()


def test_insert_returns_already_cached_and_frees_duplicates():
    pool = make_pool()
    cache = RadixCache(pool)
    a = publish(pool, cache, [0, 1, 2])
    same = cache.match_prefix([0, 1, 2, 3]).indices
    extra = pool.alloc(1)
    assert cache.insert([0, 1, 2, 3], torch.cat([same, extra])) == 3
    assert pool.available_size() == POOL_SLOTS - 4    # same slots reused, nothing freed
    dup = pool.alloc(4)
    assert cache.insert([0, 1, 2, 3], dup) == 4
    assert pool.available_size() == POOL_SLOTS - 4    # all four duplicates freed
    assert cache.match_prefix([0, 1, 2, 3]).indices.tolist() == a.tolist() + extra.tolist()
    cache.check_integrity()


def test_evict_is_lru_over_leaves_and_parents_become_leaves():
    pool = make_pool()
    cache = RadixCache(pool)
    a = publish(pool, cache, [1, 1, 1])
    b = publish(pool, cache, [2, 2])
    c = publish(pool, cache, [3, 3, 3, 3])
    d = publish(pool, cache, [3, 3, 0])      # splits c: [3, 3] -> {[3, 3], [0]}
    cache.match_prefix([1, 1, 1])            # a is now the most recent
    order = []
    while cache.total_size():
        before = set(pool.free_slots().tolist())
        assert cache.evict(1) >= 1
        order.append(sorted(set(pool.free_slots().tolist()) - before))
        cache.check_integrity()
    # b is oldest; then c's tail [3, 3], then d's [0], then their shared [3, 3], then a
    assert order == [sorted(b.tolist()), sorted(c[2:].tolist()), sorted(d[2:].tolist()),
                     sorted(c[:2].tolist()), sorted(a.tolist())]
    assert pool.available_size() == POOL_SLOTS


def test_evict_never_frees_a_locked_path_and_reports_what_it_freed():
    pool = make_pool()
    cache = RadixCache(pool)
    publish(pool, cache, [1, 2, 3, 4, 5])
    publish(pool, cache, [1, 2, 3, 6, 7])
    res = cache.match_prefix([1, 2, 3, 4, 5])
    cache.inc_lock_ref(res.last_node)
    assert cache.protected_size() == 5 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert cache.total_size() == 5
    cache.dec_lock_ref(res.last_node)
    assert cache.evict(1) == 2 and cache.evict(3) == 3       # leaf [4,5], then [1,2,3]
    assert cache.total_size() == 0 and pool.available_size() == POOL_SLOTS
    cache.check_integrity()


def test_evict_match_insert_and_locks_do_not_scan_the_tree():
    pool = make_pool(4096)
    cache = RadixCache(pool)
    for i in range(200):
        publish(pool, cache, [i % 7, i, i + 1, i + 2])
    cache.check_integrity()

    def no_scan():
        raise AssertionError("full-tree scan")
    cache._walk = no_scan
    res = cache.match_prefix([3, 3, 4, 5])
    cache.inc_lock_ref(res.last_node)
    publish(pool, cache, [5, 5, 5, 5, 5])
    assert cache.evict(10) >= 10
    cache.dec_lock_ref(res.last_node)
    del cache._walk
    cache.check_integrity()


def test_heap_of_stale_entries_stays_bounded():
    pool = make_pool()
    cache = RadixCache(pool)
    publish(pool, cache, [1, 2, 3])
    for _ in range(1000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._heap) <= 2 * 1 + 65
    cache.check_integrity()


def test_lock_counts_follow_the_documented_invariant():
    pool = make_pool()
    cache = RadixCache(pool)
    publish(pool, cache, [1, 2, 3, 4])
    publish(pool, cache, [1, 2, 5])
    n1 = cache.match_prefix([1, 2, 3, 4]).last_node
    n2 = cache.match_prefix([1, 2, 5]).last_node
    n3 = cache.match_prefix([1, 2]).last_node
    for n in (n1, n1, n2, n3):
        cache.inc_lock_ref(n)
    assert (n1.lock_ref, n2.lock_ref, n3.lock_ref) == (2, 1, 4)
    # splitting a locked edge keeps the handle valid
    mid = cache.match_prefix([1, 2, 3]).last_node
    assert mid.lock_ref == 2 and n1.parent is mid
    cache.check_integrity()
    for n in (n1, n2, n3, n1):
        cache.dec_lock_ref(n)
    assert cache.protected_size() == 0 and cache.evictable_size() == 5
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(n1)
    cache.check_integrity()


def test_reset_frees_everything_and_refuses_while_locked():
    pool = make_pool()
    cache = RadixCache(pool)
    publish(pool, cache, [1, 2, 3])
    publish(pool, cache, [2, 3])
    node = cache.match_prefix([2, 3]).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.dec_lock_ref(node)
    cache.reset()
    assert pool.available_size() == POOL_SLOTS and cache.total_size() == 0
    assert cache.match_prefix([1, 2, 3]).indices.numel() == 0
    cache.check_integrity()


def test_page_size_4_works_in_whole_pages_and_frees_the_partial_page():
    pool = make_pool()
    cache = RadixCache(pool, page_size=4)
    key = list(range(10))
    slots = pool.alloc(10)
    assert cache.insert(key, slots) == 0
    assert cache.total_size() == 8
    assert pool.available_size() == POOL_SLOTS - 8       # the two tail slots were freed
    assert cache.match_prefix(key[:7]).indices.tolist() == slots[:4].tolist()
    # divergence inside the second page: only the first page matches, and the split is at 4
    res = cache.match_prefix(key[:5] + [99, 99, 99])
    assert res.indices.tolist() == slots[:4].tolist() and res.last_node.key == key[:4]
    other = pool.alloc(8)
    assert cache.insert(key[:5] + [99, 99, 99], other) == 4
    assert pool.available_size() == POOL_SLOTS - 12      # 4 duplicates freed, 4 new owned
    assert cache.match_prefix(key[:5] + [99, 99, 99]).indices.tolist() == \
        slots[:4].tolist() + other[4:].tolist()
    assert cache.insert([1, 2, 3], pool.alloc(3)) == 0   # shorter than a page: all freed
    assert pool.available_size() == POOL_SLOTS - 12
    cache.check_integrity()
