"""Priority scheduling (--enable-priority-scheduling): the order of the waiting queue by request
priority, and whom admission preempts for an urgent request. Pure: no scheduler state.

Semantics (SGLang's flags and meaning):
  * A request's priority is Req.priority, an int, or None: then --default-priority-value, and
    without one the least urgent of all (SGLang gives such requests the extreme value too).
  * Higher values are more urgent; with --schedule-low-priority-values-first lower values are
    (vLLM's convention, where 0 is the default and smaller runs earlier). `urgency` maps both
    onto one scale: larger = more urgent, -inf for "least urgent of all".
  * Queue order (`order`): the most urgent class first; within a class the --schedule-policy
    order (fcfs: arrival order, retracted requests first since they sit at the queue's front;
    lpm: longest cached prefix, ties in arrival order). The sort is stable, so nothing else
    moves. (SGLang sorts by priority for fcfs and lof and refuses lpm with priorities; here
    lpm orders within a class.)
  * Preemption (`victims`, unless --disable-priority-preemption): a waiting request `beats` a
    running one when its urgency exceeds the running one's by strictly more than
    --priority-scheduling-preemption-threshold (SGLang's comparison; default 10). When the
    request cannot start (running slots or KV memory taken: fairness.Blocked), the running
    requests it beats are retracted least urgent first (ties: the latest admitted), only as
    many as it takes, and none when even all of them could not make room.
  * Retraction for memory (decode.py) takes the least urgent class first (`least_urgent`).
How admission uses this: prefill.py; the decode manager: decode.py.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

from radixserve.cache.base import PrefixCache
from radixserve.config import ServerArgs
from radixserve.engine.policy import Policy
from radixserve.engine.req import Req
from radixserve.engine.scheduler.fairness import Blocked

LEAST_URGENT = float("-inf")


class PriorityOrder:
    """One server's priority rules (built from ServerArgs by `from_server_args`; None there when
    priority scheduling is off)."""

    def __init__(self, low_values_first: bool = False, threshold: int = 10,
                 default: Optional[int] = None, preempt: bool = True):
        self.low_values_first = low_values_first
        self.threshold = threshold
        self.default = default
        self.preempt = preempt

    @classmethod
    def from_server_args(cls, args: ServerArgs) -> Optional["PriorityOrder"]:
        if not args.enable_priority_scheduling:
            return None
        return cls(low_values_first=args.schedule_low_priority_values_first,
                   threshold=args.priority_scheduling_preemption_threshold,
                   default=args.default_priority_value,
                   preempt=not args.disable_priority_preemption)

    def urgency(self, req: Req) -> float:
        """req's place on one scale where larger is more urgent (LEAST_URGENT: no priority and
        no default)."""
        value = req.priority if req.priority is not None else self.default
        if value is None:
            return LEAST_URGENT
        return -value if self.low_values_first else value

    def beats(self, req: Req, running: Req) -> bool:
        """req may retract `running`: strictly more urgent by more than the threshold."""
        mine, theirs = self.urgency(req), self.urgency(running)
        return mine > theirs and mine - theirs > self.threshold

    def order(self, policy: Policy) -> Policy:
        """`policy` within priority classes: the waiting requests most urgent first, each class
        in policy's order (a stable sort of policy's answer)."""
        def prioritized(waiting: Sequence[Req], cache: PrefixCache) -> List[Req]:
            return sorted(policy(waiting, cache), key=lambda r: -self.urgency(r))
        return prioritized

    def may_preempt(self, req: Req, running: Sequence[Req]) -> bool:
        """Could req retract anyone of `running` (preemption on and one it beats)?"""
        return self.preempt and any(self.beats(req, r) for r in running)

    def victims(self, req: Req, blocked: Blocked, running: Sequence[Req],
                reserve: Callable[[Req], float]) -> List[Req]:
        """The running requests to retract so that req can start: those it beats, least urgent
        first (ties: the latest admitted), until a running slot is free (if none is) and their
        KV plus decode reserve cover the memory shortfall (KV counted whole, an upper bound:
        admission re-checks after retracting and asks again if still short). [] when
        preemption is off or even all of them could not make room."""
        if not self.preempt:
            return []
        beaten = sorted((r for r in running if self.beats(req, r)),
                        key=lambda r: (self.urgency(r), -r.admit_order))
        victims: List[Req] = []
        kv_gain, reserve_gain = 0, 0.0

        def short() -> bool:
            return ((blocked.slots_full and not victims) or kv_gain < blocked.hard
                    or kv_gain + reserve_gain < blocked.soft)

        for r in beaten:
            if not short():
                break
            victims.append(r)
            kv_gain += r.kv_len
            reserve_gain += reserve(r)
        return [] if short() else victims

    def least_urgent(self, candidates: Sequence[Req]) -> List[Req]:
        """The candidates of the least urgent class present (retraction for memory)."""
        if not candidates:
            return []
        low = min(self.urgency(r) for r in candidates)
        return [r for r in candidates if self.urgency(r) == low]
