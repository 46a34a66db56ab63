"""The Scheduler (core.py), composed of parts that own their state: admission and prefill
(prefill.py), decode and retraction (decode.py), fairness (fairness.py), results and streaming
(results.py), the grammar slot (grammar.py), KV bookkeeping (kv.py) and telemetry (stats.py)."""
from radixserve.engine.scheduler.core import Scheduler, make_prefix_cache

__all__ = ["Scheduler", "make_prefix_cache"]
