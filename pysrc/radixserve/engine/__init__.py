"""The engine: requests (req.py), batches (schedule_batch.py), policies (policy.py), the
Scheduler (scheduler/), AsyncEngine (async_engine.py, the API of the server and of the offline
Engine, radixserve/offline.py, which sits above it) and their request types (io.py). Imported
lazily so that importing one piece does not load them all."""
from typing import Any

__all__ = ["AsyncEngine", "Scheduler"]


def __getattr__(name: str) -> Any:
    if name == "AsyncEngine":
        from radixserve.engine.async_engine import AsyncEngine
        return AsyncEngine
    if name == "Scheduler":
        from radixserve.engine.scheduler import Scheduler
        return Scheduler
    raise AttributeError(f"module 'radixserve.engine' has no attribute {name!r}")
