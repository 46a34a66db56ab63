"""CPU seconds of the engine's threads, read from any thread: how much host time the loop
thread (HTTP, scheduling, detokenizing, streaming) and the forward worker spend, for /metrics
and the benches (a serving run's loop CPU per generated token).

Linux gives every thread a CPU-time clock (pthread_getcpuclockid); where Python lacks it,
nothing is reported. A thread is read only while registered: the owner forgets it before the
thread ends (a finished thread's id may be reused).
"""
from __future__ import annotations

import threading
import time
from typing import Dict


class ThreadCPU:
    """name -> a live thread's CPU seconds so far (user + system)."""

    def __init__(self) -> None:
        self._clocks: Dict[str, int] = {}

    def add(self, name: str, ident: int) -> None:
        """Register the thread whose threading ident is `ident` (on Linux, its pthread_t)."""
        getclock = getattr(time, "pthread_getcpuclockid", None)
        if getclock is None:
            return
        try:
            self._clocks[name] = getclock(ident)
        except OSError:
            pass

    def add_current(self, name: str) -> None:
        self.add(name, threading.get_ident())

    def forget(self) -> None:
        self._clocks.clear()

    def seconds(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for name, clock in self._clocks.items():
            try:
                out[name] = time.clock_gettime(clock)
            except OSError:
                pass
        return out
