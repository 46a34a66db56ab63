"""The Scheduler, split by concern (see core.py): admission and prefill, decode and retraction,
results and streaming."""
from radixserve.engine.scheduler.core import Scheduler, make_prefix_cache

__all__ = ["Scheduler", "make_prefix_cache"]
