"""KV memory and prefix caches: KVPool/ReqToTokenPool (kv_pool.py), the PrefixCache interface
(base.py), RadixCache (radix_cache.py, token-level sharing) and ChunkCache (no sharing)."""
from radixserve.cache.base import MatchResult, PrefixCache
from radixserve.cache.chunk_cache import ChunkCache
from radixserve.cache.kv_pool import KVPool, ReqToTokenPool

__all__ = ["ChunkCache", "KVPool", "MatchResult", "PrefixCache", "ReqToTokenPool"]
