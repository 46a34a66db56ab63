"""NgramIndex (engine/spec/ngram.py) in isolation: the prompt-lookup draft rule."""
import random

import pytest

from radixserve.engine.spec.ngram import NgramIndex, propose


def brute_force(history, k, lo, hi):
    """The rule, spelled out: the longest window n in [lo, hi] whose last-n suffix occurs
    earlier; its latest earlier occurrence's continuation, up to k tokens."""
    L = len(history)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = history[L - n:]
        for s in range(L - n - 1, -1, -1):
            if history[s:s + n] == suffix:
                return history[s + n:s + n + k]
    return []


def test_repeated_text_is_drafted():
    h = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert propose(h, 3, 1, 4) == [4, 5, 9]
    assert propose(h, 10, 1, 4) == [4, 5, 9, 1, 2, 3]
    assert propose(h, 0, 1, 4) == []


def test_no_match_and_short_history():
    assert propose([1, 2, 3, 4], 3, 1, 3) == []
    assert propose([7], 3, 1, 3) == []
    assert propose([], 3, 1, 3) == []
    # min window 2: a one-token match does not count
    assert propose([5, 1, 6, 1], 2, 2, 3) == []
    assert propose([5, 1, 6, 1], 2, 1, 3) == [6, 1]


def test_longest_window_then_latest_occurrence():
    # the suffix [2, 3] occurs at 0 (followed by 7) and at 4 (followed by 8); [9, 2, 3] at 3
    h = [2, 3, 7, 9, 2, 3, 8, 1, 9, 2, 3]
    assert propose(h, 1, 1, 3) == [8]          # window 3 matches "9 2 3" at 3..5
    assert propose(h, 1, 1, 2) == [8]          # window 2: the latest "2 3" is at 4
    h2 = [2, 3, 7, 5, 2, 3, 8, 1, 9, 2, 3]
    assert propose(h2, 1, 1, 3) == [8]


def test_incremental_equals_one_shot_and_brute_force():
    rng = random.Random(3)
    for trial in range(30):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        idx = NgramIndex(lo, hi)
        h = []
        for _ in range(80):
            h.append(rng.randrange(6))
            idx.sync(h)
            k = rng.randint(1, 5)
            assert idx.propose(k) == propose(h, k, lo, hi) == brute_force(h, k, lo, hi), (h, lo, hi)


def test_rollback_rebuilds():
    idx = NgramIndex(1, 3)
    idx.sync([1, 2, 3, 1, 2])
    assert idx.propose(2) == [3, 1]
    idx.sync([1, 2, 3, 1, 9])              # the tail changed (a rollback): re-indexed
    assert idx.propose(2) == []
    idx.sync([1, 2])                        # shrank
    assert idx.propose(2) == []
    assert idx.propose(2) == brute_force([1, 2], 2, 1, 3)


def test_bad_windows():
    with pytest.raises(ValueError):
        NgramIndex(0, 3)
    with pytest.raises(ValueError):
        NgramIndex(4, 3)


def test_radix_continuation_reads_without_changing_the_tree():
    """RadixCache.continuation: the tokens after key on the most recently used path, [] where
    key leaves the tree; no split, touch or lock (the tree's shape and clocks are unchanged)."""
    import torch

    from radixserve.cache.kv_pool import KVPool
    from radixserve.cache.radix_cache import RadixCache

    pool = KVPool(64, 1, 1, 8, torch.float32, "cpu")
    cache = RadixCache(pool)
    a = [1, 2, 3, 4, 5, 6, 7]
    b = [1, 2, 3, 9, 9]
    cache.insert(a, pool.alloc(len(a)))
    cache.insert(b, pool.alloc(len(b)))            # splits a's edge at 3; b is newer
    before = [(n.node_id, len(n.key), n.last_access_time) for n in cache._walk()]
    assert cache.continuation([1, 2], 3) == [3, 9, 9]           # the newer branch
    assert cache.continuation([1, 2, 3, 4], 2) == [5, 6]        # inside a's edge
    assert cache.continuation([1, 2, 3, 4, 5, 6, 7], 4) == []   # nothing follows
    assert cache.continuation([1, 2, 8], 4) == []               # leaves the tree
    assert cache.continuation([5], 4) == []
    assert cache.continuation([], 2) == [1, 2]
    assert [(n.node_id, len(n.key), n.last_access_time) for n in cache._walk()] == before
    cache.check_integrity()


def test_propose_after_assumed_tokens_equals_brute_force():
    """propose(k, extra): the draft after history + extra (a verify step in flight's draft,
    assumed accepted) with matches among the n-grams of the synced history only, the
    continuation running on into extra; extra is not indexed (the next sync() sees only the
    real history)."""
    def brute(history, extra, k, lo, hi):
        t, length = history + extra, len(history)
        for n in range(min(hi, len(t) - 1), lo - 1, -1):
            for s in range(length - 1 - n, -1, -1):
                if t[s:s + n] == t[len(t) - n:]:
                    return t[s + n:s + n + k]
        return []

    rng = random.Random(7)
    for _ in range(400):
        history = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        extra = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        k, lo = rng.randrange(0, 7), rng.randrange(1, 3)
        hi = lo + rng.randrange(0, 3)
        index = NgramIndex(lo, hi)
        index.sync(history)
        assert index.propose(k, extra) == brute(history, extra, k, lo, hi), (history, extra)
        assert index.tokens == history
    index = NgramIndex(1, 3)
    index.sync([1, 2, 3, 9])
    assert index.propose(4, [1, 2]) == [3, 9, 1, 2]      # continuation runs into extra
