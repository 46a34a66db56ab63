"""The engine: requests (req.py), batches (schedule_batch.py), policies (policy.py), the
Scheduler (scheduler.py), AsyncEngine (async_engine.py, the server's API) and the offline Engine
(engine.py). Imported lazily so that importing one piece does not load them all."""
from typing import Any

__all__ = ["AsyncEngine", "Engine", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "AsyncEngine":
        from radixserve.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "Engine":
        from radixserve.engine.engine import Engine
        return Engine
    if name == "Scheduler":
        from radixserve.engine.scheduler import Scheduler
        return Scheduler
    raise AttributeError(f"module 'radixserve.engine' has no attribute {name!r}")
