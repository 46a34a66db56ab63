"""Scheduling policies: the order in which waiting requests are considered for admission.

A policy is a callable (waiting reqs, prefix cache) -> the same reqs in admission order; it must
not mutate the requests or lock anything (the scheduler re-matches and locks at admission).
  * fcfs: arrival order (retracted requests sit at the front of the queue, so they go first).
  * lpm:  longest prefix match first, ties in arrival order. Matching every waiting request costs
          O(sum of prompt lengths) per step, so above LPM_MAX_QUEUE_LEN waiting requests lpm
          falls back to fcfs: under a deep queue the order matters less than the step time, and
          the fallback keeps the policy correct (every request is still considered) at any length.
          A cache that shares nothing (ChunkCache) makes lpm identical to fcfs.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

from radixserve.cache.base import PrefixCache
from radixserve.engine.req import Req

Policy = Callable[[Sequence[Req], PrefixCache], List[Req]]

LPM_MAX_QUEUE_LEN = 128


def fcfs(waiting: Sequence[Req], cache: PrefixCache) -> List[Req]:
    return list(waiting)


def lpm(waiting: Sequence[Req], cache: PrefixCache) -> List[Req]:
    if len(waiting) > LPM_MAX_QUEUE_LEN or not cache.supports_sharing:
        return list(waiting)
    matched = {id(r): int(cache.match_prefix(r.cache_key[:r.max_prefix_len()]).indices.numel())
               for r in waiting}
    # sorted() is stable: equal matches keep arrival order
    return sorted(waiting, key=lambda r: -matched[id(r)])


POLICIES: Dict[str, Policy] = {"fcfs": fcfs, "lpm": lpm}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"--schedule-policy must be one of {sorted(POLICIES)}, not {name!r}")
    return POLICIES[name]
