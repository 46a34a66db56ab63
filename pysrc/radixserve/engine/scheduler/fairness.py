"""Fairness between clients (Req.client_id: the API key's identity, else the peer address; None
is one anonymous client): the share, and whom to preempt for it. Pure: no scheduler state.

A client's running slots are its requests that are decoding, mid-chunk, or ending their prefill
in the step in flight. While requests of two or more clients are live (running or waiting),
each client's share is --max-running-requests-per-client when given, else
max_running_requests // (the number of those clients), at least 1. A lone client has no share:
it may use every slot. (--max-running-requests-per-client equal to --max-running-requests turns
fairness off: nobody can exceed it.) How admission and retraction use it: prefill.py.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Set

from radixserve.engine.req import Req


class Blocked(NamedTuple):
    """A waiting request cannot start now: no running slot, and/or this many KV slots short
    (hard: for its tokens; soft: with the decode reserve)."""
    slots_full: bool
    hard: float
    soft: float


class FairShare:
    """One admission's view of fairness: running slots per client, the clients with requests
    waiting, and the share. Kept current as requests are admitted and retracted during the
    step."""

    def __init__(self, holding: Dict[Optional[str], int], waiting: Dict[Optional[str], int],
                 share: int):
        self.holding = holding
        self.waiting = waiting
        self.share = share
        # waiting clients under their share: while any waits, clients at their share wait too
        self.under_waiting: Set[Optional[str]] = {c for c in waiting if self.under(c)}

    def under(self, client: Optional[str]) -> bool:
        return self.holding.get(client, 0) < self.share

    def over(self, client: Optional[str]) -> bool:
        return self.holding.get(client, 0) > self.share

    def may_admit(self, req: Req) -> bool:
        return self.under(req.client_id) or not self.under_waiting

    def admitted(self, req: Req) -> None:
        c = req.client_id
        self.holding[c] = self.holding.get(c, 0) + 1
        self.waiting[c] = self.waiting.get(c, 1) - 1
        if self.waiting[c] <= 0 or not self.under(c):
            self.under_waiting.discard(c)

    def retracted(self, req: Req) -> None:
        c = req.client_id
        self.holding[c] = self.holding.get(c, 0) - 1
        self.waiting[c] = self.waiting.get(c, 0) + 1
        if self.under(c):
            self.under_waiting.add(c)


def fair_share(holders: Iterable[Req], waiting: Iterable[Req], max_running: int,
               per_client_cap: Optional[int]) -> Optional[FairShare]:
    """The FairShare of these running-slot holders and waiting requests; None while they are
    all one client's."""
    holding: Dict[Optional[str], int] = {}
    for r in holders:
        holding[r.client_id] = holding.get(r.client_id, 0) + 1
    queued: Dict[Optional[str], int] = {}
    for r in waiting:
        queued[r.client_id] = queued.get(r.client_id, 0) + 1
    clients = len(set(holding) | set(queued))
    if clients < 2:
        return None
    share = per_client_cap if per_client_cap is not None else max(max_running // clients, 1)
    return FairShare(holding, queued, share)


def fair_victims(fair: FairShare, req: Req, blocked: Blocked, running: List[Req],
                 reserve: Callable[[Req], float]) -> List[Req]:
    """The running requests to retract so that req (of a client under its share) can start:
    repeatedly the latest-admitted request of the client most over its share (ties: the one
    with the later admission), never taking a client below its share, until a running slot is
    free (if none is) and their KV and decode reserve could cover the memory shortfall. Their
    KV is counted whole (the prefix too), an upper bound: admission re-checks after retracting
    and asks again if still short. [] when even every such request could not make room
    (nothing is retracted for nothing)."""
    client = req.client_id
    if not fair.under(client):
        return []
    share = fair.share
    holding = dict(fair.holding)
    pools: Dict[Optional[str], List[Req]] = {}
    for r in running:
        if r.client_id != client and holding.get(r.client_id, 0) > share:
            pools.setdefault(r.client_id, []).append(r)
    for rs in pools.values():
        rs.sort(key=lambda r: r.admit_order, reverse=True)
    victims: List[Req] = []
    kv_gain, reserve_gain = 0, 0.0
    while (blocked.slots_full and not victims) or kv_gain < blocked.hard or \
            kv_gain + reserve_gain < blocked.soft:
        over = [c for c, rs in pools.items() if rs and holding[c] > share]
        if not over:
            return []
        c = max(over, key=lambda k: (holding[k] - share, pools[k][0].admit_order))
        victim = pools[c].pop(0)
        holding[c] -= 1
        victims.append(victim)
        kv_gain += victim.kv_len
        reserve_gain += reserve(victim)
    return victims
