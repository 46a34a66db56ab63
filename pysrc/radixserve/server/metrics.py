"""Prometheus metrics and request logging of one app.

Two sources feed /metrics, both registered on the app's own registry (no module-level state:
tests build several apps in one process):

  * EngineCollector reads engine.metrics() at scrape time. Counters and gauges the scheduler
    keeps anyway, so they cost nothing per request and are ALWAYS served. Names follow SGLang's
    (`<prefix>num_running_reqs`, `<prefix>num_queue_reqs`, `<prefix>token_usage`,
    `<prefix>gen_throughput`, `<prefix>prompt_tokens_total`, `<prefix>cached_tokens_total`, ...);
    where our engine key differs from SGLang's name both are served (num_waiting_reqs and
    num_queue_reqs, max_total_tokens and max_total_num_tokens, num_retractions_total and
    num_retracted_requests_total). Prefix-cache hits are two counters, queried and hit tokens
    (`cache_query_tokens_total`, `cache_hit_tokens_total`), so any window's hit rate is
    rate(hit) / rate(query); `cache_hit_rate` is the ratio since start, for SGLang dashboards.
  * RequestMetrics observes each sequence's GenerateOutputs at the server layer (see
    generation.merge_generations): with --enable-metrics the histograms
    time_to_first_token_seconds, inter_token_latency_seconds, time_per_output_token_seconds,
    e2e_request_latency_seconds and queue_time_seconds; with --log-requests one INFO line per
    finished sequence. With neither flag no per-request work is done at all.

Every series carries the label model_name (the served model name). The prefix comes from
--metrics-prefix (default "radixserve:"; "sglang:" gives SGLang's exact names).

--metrics-prefix vllm: is for stacks that hard-code vLLM's names (vllm/v1/metrics/loggers.py,
PrometheusStatLogger; every series labelled model_name and engine="0", as vLLM's one engine
core): the gauges vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
(a fraction: slots held by requests / pool, as vLLM's 1 - free blocks / blocks, where cached
but unreferenced blocks count as free) and its pre-0.10 name vllm:gpu_cache_usage_perc; the
counters vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:prefix_cache_queries_total (prompt tokens looked up) and vllm:prefix_cache_hits_total
(found), vllm:prompt_tokens_cached_total, the pre-0.10 vllm:gpu_prefix_cache_queries_total /
vllm:gpu_prefix_cache_hits_total, vllm:num_preemptions_total (retractions, for memory,
fairness or priority); the info gauge vllm:cache_config_info{block_size, num_gpu_blocks,
enable_prefix_caching, engine} = 1; and with --enable-metrics the histograms
vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
vllm:request_time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
vllm:request_queue_time_seconds and the counter vllm:request_success_total{finished_reason}.
Everything else (and every engine counter and gauge above, under our names too, so radixserve
dashboards keep working) is served under radixserve:.

KV events (--kv-events-config, cache/kv_events.py) add <prefix>kv_events_published_batches_total
and <prefix>kv_events_dropped_batches_total (batches dropped because the publisher's bounded
queue was full; radixserve: under vllm:) while a publisher runs.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine.io import GenerateOutput, GenerateReqInput

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "radixserve:"
VLLM_PREFIX = "vllm:"
VLLM_ENGINE = "0"       # vLLM's `engine` label: the engine core's index (radixserve has one)
_PREFIX_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")

# Bucket upper bounds, in seconds. They reach down to what one H200 step takes and up to what a
# CPU-only server under load takes; the +Inf bucket is implicit.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                3.0, 5.0, 7.5, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04,
               0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
E2E_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0,
               30.0, 45.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 2400.0)
QUEUE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

# engine.metrics() key -> (exposed names, help). Counter names end in _total.
_COUNTERS: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "prompt_tokens": (("prompt_tokens_total",), "Prompt tokens received"),
    "cached_tokens": (("cached_tokens_total",), "Prompt tokens served from the prefix cache"),
    "generation_tokens": (("generation_tokens_total",), "Tokens generated"),
    "num_requests": (("num_requests_total",), "Requests (sequences) received by the engine"),
    "num_finished_requests": (("num_finished_requests_total",), "Requests finished"),
    "num_aborted_requests": (("num_aborted_requests_total",), "Requests aborted"),
    "num_prefill_steps": (("num_prefill_steps_total",), "Prefill steps run"),
    "num_decode_steps": (("num_decode_steps_total",), "Decode steps run"),
    "num_retractions": (("num_retractions_total", "num_retracted_requests_total"),
                        "Running requests retracted to the queue for lack of KV slots"),
    "num_fair_retractions": (("num_fair_retractions_total",),
                             "Running requests of a client over its fair share retracted to "
                             "the queue so that a request of a client under it could start"),
    "num_priority_retractions": (("num_priority_retractions_total",),
                                 "Running requests retracted to the queue so that a more urgent "
                                 "request could start (--enable-priority-scheduling)"),
    # the device's own time, split by step kind (bench serving reports them over a run)
    "decode_device_seconds": (("decode_device_seconds_total",),
                              "Device seconds of decode steps (CUDA events; on the CPU the "
                              "forward's wall time)"),
    "extend_device_seconds": (("extend_device_seconds_total",),
                              "Device seconds of prefill (extend) steps, mixed steps included"),
    "device_idle_before_decode_seconds": (
        ("device_idle_before_decode_seconds_total",),
        "Seconds the device sat idle before a decode step, from the previous step's end "
        "(time without work counts too; 0 on the CPU)"),
    "device_idle_before_extend_seconds": (
        ("device_idle_before_extend_seconds_total",),
        "Seconds the device sat idle before a prefill step, from the previous step's end"),
    "decode_row_device_seconds": (
        ("decode_row_device_seconds_total",),
        "Device seconds of decode steps times their rows (over decode_rows_total: the mean "
        "decode step a generated token waited for)"),
    "decode_rows": (("decode_rows_total",), "Rows (requests) of the decode steps run"),
    # speculative decoding (--speculative-algorithm; engine/scheduler/spec.py)
    "spec_verify_steps": (("spec_verify_steps_total",), "Speculative verify steps run"),
    "spec_verify_reqs": (("spec_verify_reqs_total",),
                         "Requests' verify rows with a draft (one per request and verify step)"),
    "spec_draft_tokens": (("spec_draft_tokens_total",), "Draft tokens verified"),
    "spec_accepted_tokens": (("spec_accepted_tokens_total",),
                             "Draft tokens accepted (equal to the model's own token)"),
    "spec_overlapped_verify_steps": (("spec_overlapped_verify_steps_total",),
                                     "Verify steps scheduled while the step before was running"),
    "spec_voided_steps": (("spec_voided_steps_total",),
                          "Request-steps dropped because the verify before them rejected a "
                          "draft token (they had assumed it accepted)"),
    # host CPU of the engine's two busy threads (engine/thread_cpu.py)
    "loop_thread_cpu_seconds": (("loop_thread_cpu_seconds_total",),
                                "CPU seconds of the event-loop thread (HTTP, scheduling, "
                                "detokenizing, streaming)"),
    "forward_thread_cpu_seconds": (("forward_thread_cpu_seconds_total",),
                                   "CPU seconds of the forward worker thread (step launches; "
                                   "on the CPU the forward itself)"),
    # --engine-process: the server's own process (engine/client.py), apart from the engine's
    "server_process_cpu_seconds": (("server_process_cpu_seconds_total",),
                                   "CPU seconds of the server's process when the engine runs in "
                                   "a process of its own (--engine-process: HTTP, rendering, "
                                   "streaming; the loop thread's counter is then the engine's)"),
}
_GAUGES: Dict[str, Tuple[Tuple[str, ...], str]] = {
    "num_running_reqs": (("num_running_reqs",), "Requests running"),
    "num_waiting_reqs": (("num_waiting_reqs", "num_queue_reqs"), "Requests waiting in the queue"),
    "token_usage": (("token_usage",), "Fraction of KV slots held by requests"),
    "num_used_tokens": (("num_used_tokens",), "KV slots held by requests"),
    "max_total_tokens": (("max_total_tokens", "max_total_num_tokens"), "KV slots in the pool"),
    "evictable_tokens": (("evictable_tokens",), "KV slots held only by the prefix cache (evictable)"),
    "gen_throughput": (("gen_throughput",),
                       "Generation throughput (token/s) over the last decode-log interval"),
    "gpu_busy_fraction": (("gpu_busy_fraction",),
                          "Device time of steps / wall time over the last interval"),
    "spec_accept_length": (("spec_accept_length",),
                           "Mean tokens a verifying request gained per verify step (accepted "
                           "drafts + 1; 0 before any)"),
    "weight_floor_seconds": (("weight_floor_seconds",),
                             "The batch-1 decode floor measured at start: streamed weight bytes "
                             "over the device's copy bandwidth (0 on the CPU)"),
    "streamed_weight_bytes": (("streamed_weight_bytes",),
                              "The weight bytes a decode step streams (the floor's numerator; 0 "
                              "on the CPU)"),
    "kv_cache_bytes_per_token": (("kv_cache_bytes_per_token",),
                                 "K and V bytes of one cached token over all layers, on one "
                                 "device, in the KV cache's dtype"),
}
_RESERVED = frozenset([n for names, _ in (*_COUNTERS.values(), *_GAUGES.values()) for n in names]
                      + ["cache_query_tokens_total", "cache_hit_tokens_total", "cache_hit_rate"])
# Every known key is served even while the engine does not report it (as 0 until it does:
# gen_throughput and gpu_busy_fraction come with the scheduler rewrite), so that every
# dashboard panel has a series.
_ALWAYS = (*_COUNTERS, *_GAUGES)


# vLLM's names (without the prefix) for our engine.metrics() keys, under --metrics-prefix vllm:
_VLLM_GAUGES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "num_running_reqs": (("num_requests_running",
                          "Number of requests in model execution batches."),),
    "num_waiting_reqs": (("num_requests_waiting", "Number of requests waiting to be processed."),),
    "token_usage": (("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
                    ("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage. "
                     "DEPRECATED in vLLM 0.9: use vllm:kv_cache_usage_perc instead.")),
}
_VLLM_COUNTERS: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "prompt_tokens": (("prompt_tokens_total", "Number of prefill tokens processed."),
                      ("prefix_cache_queries_total",
                       "Prefix cache queries, in terms of number of queried tokens."),
                      ("gpu_prefix_cache_queries_total",
                       "GPU prefix cache queries, in terms of number of queried tokens. "
                       "DEPRECATED in vLLM 0.9: use vllm:prefix_cache_queries instead.")),
    "cached_tokens": (("prefix_cache_hits_total",
                       "Prefix cache hits, in terms of number of cached tokens."),
                      ("prompt_tokens_cached_total",
                       "Number of cached prompt tokens (local + external)."),
                      ("gpu_prefix_cache_hits_total",
                       "GPU prefix cache hits, in terms of number of cached tokens. "
                       "DEPRECATED in vLLM 0.9: use vllm:prefix_cache_hits instead.")),
    "generation_tokens": (("generation_tokens_total", "Number of generation tokens processed."),),
    "num_preemptions": (("num_preemptions_total",
                         "Cumulative number of preemption from the engine."),),
}
# our histogram name -> vLLM's
_VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "queue_time_seconds": "request_queue_time_seconds",
}


def check_prefix(prefix: str) -> str:
    """The prefix, if every metric name built from it is a valid Prometheus name."""
    if not _PREFIX_RE.match(prefix or ""):
        raise ValueError(f"--metrics-prefix {prefix!r} is not a valid Prometheus metric name "
                         f"prefix: use letters, digits, '_' and ':' (e.g. \"radixserve:\" or "
                         f"\"sglang:\"), not starting with a digit")
    return prefix


def kv_event_publisher(engine) -> Any:
    """The engine's KV event publisher (cache/kv_events.ZmqEventPublisher), None without one."""
    cache = getattr(getattr(engine, "scheduler", None), "cache", None)
    return getattr(cache, "kv_events", None)


class EngineCollector:
    """Reads engine.metrics() at scrape time (a dict of numbers; missing keys read as 0).
    Known keys are exposed under the names above, unknown numeric keys as `<prefix><key>`
    (a counter if the key ends in `_total`, else a gauge). With vllm=True, vLLM's names too
    (_VLLM_GAUGES, _VLLM_COUNTERS, vllm:cache_config_info)."""

    def __init__(self, engine, prefix: str, vllm: bool = False):
        self.engine = engine
        self.prefix = prefix
        self.vllm = vllm

    def collect(self):
        model = self.engine.served_model_name
        values = {k: v for k, v in self.engine.metrics().items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key in _ALWAYS:
            values.setdefault(key, 0)
        if self.vllm:
            yield from self._vllm_families(model, values)
        publisher = kv_event_publisher(self.engine)
        if publisher is not None and hasattr(publisher, "stats"):
            stats = publisher.stats()
            for key, doc in (("kv_events_published_batches",
                              "KV event batches sent on the ZMQ PUB socket"),
                             ("kv_events_dropped_batches",
                              "KV event batches dropped because the publisher's queue was full "
                              "(the next batch then starts with AllBlocksCleared)")):
                f = CounterMetricFamily(self.prefix + key + "_total", doc, labels=["model_name"])
                f.add_metric([model], float(stats.get(key, 0)))
                yield f

        def family(kind, name, doc, value):
            f = kind(self.prefix + name, doc, labels=["model_name"])
            f.add_metric([model], float(value))
            return f

        for key, value in sorted(values.items()):
            if key in _COUNTERS:
                names, doc = _COUNTERS[key]
                for name in names:
                    yield family(CounterMetricFamily, name, doc, value)
            elif key in _GAUGES:
                names, doc = _GAUGES[key]
                for name in names:
                    yield family(GaugeMetricFamily, name, doc, value)
            else:
                name = re.sub(r"[^a-zA-Z0-9_:]", "_", key)
                if name in _RESERVED:    # an engine key named like one of ours: ours wins
                    continue
                kind = CounterMetricFamily if key.endswith("_total") else GaugeMetricFamily
                yield family(kind, name, key.replace("_", " "), value)
        queried, hit = values["prompt_tokens"], values["cached_tokens"]
        yield family(CounterMetricFamily, "cache_query_tokens_total",
                     "Prompt tokens looked up in the prefix cache (queried)", queried)
        yield family(CounterMetricFamily, "cache_hit_tokens_total",
                     "Prompt tokens found in the prefix cache (hit)", hit)
        yield family(GaugeMetricFamily, "cache_hit_rate",
                     "Prefix cache hit tokens / queried tokens since start (for a window use "
                     "rate(cache_hit_tokens_total) / rate(cache_query_tokens_total))",
                     hit / queried if queried else 0.0)

    def _vllm_families(self, model: str, values: Dict[str, float]):
        labels = [model, VLLM_ENGINE]
        vals = dict(values)
        vals["num_preemptions"] = (vals.get("num_retractions", 0)
                                   + vals.get("num_fair_retractions", 0)
                                   + vals.get("num_priority_retractions", 0))
        for table, kind in ((_VLLM_GAUGES, GaugeMetricFamily),
                            (_VLLM_COUNTERS, CounterMetricFamily)):
            for key, names in table.items():
                for name, doc in names:
                    f = kind(VLLM_PREFIX + name, doc, labels=["model_name", "engine"])
                    f.add_metric(labels, float(vals.get(key, 0)))
                    yield f
        args = getattr(self.engine, "server_args", None)
        page = max(int(getattr(args, "page_size", 1) or 1), 1)
        info = GaugeMetricFamily(
            VLLM_PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"])
        info.add_metric([str(page), str(int(vals.get("max_total_tokens", 0)) // page),
                         str(not getattr(args, "disable_radix_cache", False)), VLLM_ENGINE], 1.0)
        yield info


class RequestMetrics:
    """Per-sequence observation: latency histograms (when `histograms`) and one log line per
    finished sequence (when `log_requests`). track() gives a SequenceTracker per sequence."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str,
                 histograms: bool, log_requests: bool):
        self.model_name = model_name
        self.histograms = histograms
        self.log_requests = log_requests
        self.ttft = self.itl = self.tpot = self.e2e = self.queue_time = None
        self.request_success = None     # vLLM's request_success counter, under vllm: only
        vllm = prefix == VLLM_PREFIX
        if histograms:
            def hist(name, doc, buckets):
                if vllm:    # vLLM's name and labels
                    return Histogram(VLLM_PREFIX + _VLLM_HISTOGRAMS[name], doc,
                                     labelnames=["model_name", "engine"], buckets=buckets,
                                     registry=registry).labels(model_name, VLLM_ENGINE)
                return Histogram(prefix + name, doc, labelnames=["model_name"], buckets=buckets,
                                 registry=registry).labels(model_name)
            if vllm:
                self.request_success = Counter(
                    VLLM_PREFIX + "request_success", "Count of successfully processed requests.",
                    labelnames=["model_name", "engine", "finished_reason"], registry=registry)
            self.ttft = hist("time_to_first_token_seconds",
                             "Time from the server handing a sequence to the engine to its first "
                             "output", TTFT_BUCKETS)
            self.itl = hist("inter_token_latency_seconds",
                            "Time between a sequence's consecutive tokens (an output of k tokens "
                            "counts k intervals of 1/k of its wait)", ITL_BUCKETS)
            self.tpot = hist("time_per_output_token_seconds",
                             "Per sequence: (e2e latency - TTFT) / (output tokens - 1)",
                             ITL_BUCKETS)
            self.e2e = hist("e2e_request_latency_seconds",
                            "Time from the server handing a sequence to the engine to its last "
                            "output", E2E_BUCKETS)
            self.queue_time = hist("queue_time_seconds",
                                   "Time from a sequence's arrival in the engine to its first "
                                   "admission into a batch", QUEUE_BUCKETS)

    @property
    def active(self) -> bool:
        return self.histograms or self.log_requests

    def track(self, reqs: Sequence[GenerateReqInput]) -> Optional[List["SequenceTracker"]]:
        """One tracker per sequence, started now; None when nothing is observed."""
        if not self.active:
            return None
        now = time.perf_counter()
        return [SequenceTracker(self, r.rid, now) for r in reqs]


class SequenceTracker:
    """Timings of one sequence. observe(out) on every GenerateOutput, close() when its
    consumer is done (a sequence that never finished is logged as an abort)."""
    __slots__ = ("owner", "rid", "start", "first", "last", "queue_time_s", "prompt_tokens",
                 "completion_tokens", "cached_tokens", "done")

    def __init__(self, owner: RequestMetrics, rid: str, start: float):
        self.owner = owner
        self.rid = rid
        self.start = start
        self.first: Optional[float] = None     # perf_counter of the first output
        self.last: Optional[float] = None      # perf_counter of the latest output with tokens
        self.queue_time_s: Optional[float] = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.done = False

    def observe(self, out: GenerateOutput) -> None:
        if self.done:
            return
        now = time.perf_counter()
        m = self.owner
        num_new = len(out.output_ids_delta)
        if self.first is None:
            self.first = now
            if m.histograms:
                m.ttft.observe(now - self.start)
        elif num_new and m.histograms:
            gap = (now - self.last) / num_new
            for _ in range(num_new):
                m.itl.observe(gap)
        if num_new or self.last is None:
            self.last = now
        qt = out.queue_time_s
        if qt is not None and self.queue_time_s is None:
            self.queue_time_s = qt
            if m.histograms:
                m.queue_time.observe(max(qt, 0.0))
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens or self.completion_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        if out.finished:
            self._end(now, out.finish_reason)

    def close(self) -> None:
        if not self.done:
            self._end(time.perf_counter(), None)

    def _end(self, now: float, reason: Optional[Dict[str, Any]]) -> None:
        self.done = True
        m = self.owner
        e2e = now - self.start
        ttft = None if self.first is None else self.first - self.start
        if m.request_success is not None and reason is not None:
            m.request_success.labels(m.model_name, VLLM_ENGINE,
                                     str(reason.get("type"))).inc()
        if m.histograms and reason is not None:
            m.e2e.observe(e2e)
            if ttft is not None and self.completion_tokens > 1:
                m.tpot.observe((e2e - ttft) / (self.completion_tokens - 1))
        if m.log_requests:
            logger.info(
                "Finish request. rid=%s, prompt_tokens=%d, completion_tokens=%d, "
                "cached_tokens=%d, queue_time=%s, ttft=%s, e2e_latency=%.4f s, finish_reason=%s",
                self.rid, self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                _secs(self.queue_time_s), _secs(ttft), e2e, _reason_text(reason))


def _secs(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f} s"


def _reason_text(reason: Optional[Dict[str, Any]]) -> str:
    if reason is None:
        return "abort (not finished: client gone or error)"
    text = str(reason.get("type"))
    if reason.get("matched") is not None:
        text += f" (matched {reason['matched']!r})"
    if reason.get("message"):
        text += f" ({reason['message']})"
    return text


class MetricsRegistry(CollectorRegistry):
    """The app's registry: the engine collector, and the request instruments in `.requests`."""

    def __init__(self, engine):
        super().__init__(auto_describe=False)
        args = engine.server_args
        prefix = check_prefix(getattr(args, "metrics_prefix", DEFAULT_PREFIX))
        self.prefix = prefix
        vllm = prefix == VLLM_PREFIX
        # under vllm: what vLLM names comes under its names, the rest (and all of it again)
        # under radixserve:, so that no made-up name enters vLLM's namespace
        self.register(EngineCollector(engine, DEFAULT_PREFIX if vllm else prefix, vllm=vllm))
        self.requests = RequestMetrics(self, prefix, engine.served_model_name,
                                       histograms=bool(getattr(args, "enable_metrics", False)),
                                       log_requests=bool(getattr(args, "log_requests", False)))


def request_metrics(request) -> Optional[RequestMetrics]:
    """The RequestMetrics of the app serving a starlette `request` (None if it has none)."""
    registry = getattr(request.app.state, "metrics_registry", None)
    return getattr(registry, "requests", None)
