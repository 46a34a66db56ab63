"""ChunkCache: shares nothing, frees what it is given, and keeps the pool's accounting whole."""
import torch

from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.kv_pool import KVPool


def make_pool(n=32):
    return KVPool(n, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")


def test_match_is_always_empty_and_insert_frees():
    pool = make_pool()
    cache = ChunkCache(pool)
    assert not cache.supports_sharing
    slots = pool.alloc(5)
    assert pool.available_size() == 27
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert pool.available_size() == 32            # ownership taken, and given straight back
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert m.indices.numel() == 0 and m.indices.dtype == torch.int64
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(10) == 0
    assert cache.evictable_size() == 0 and cache.protected_size() == 0
    assert cache.owned_slots().numel() == 0
    cache.reset()
    cache.check_integrity()
    free = pool.free_slots()
    assert sorted(free.tolist()) == list(range(1, 33))   # slot 0 never handed out, none twice


def test_scheduler_falls_back_to_chunk_cache(make_scheduler):
    sched = make_scheduler(disable_radix_cache=True)
    assert isinstance(sched.cache, ChunkCache)
