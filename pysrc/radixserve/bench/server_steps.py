"""The server's own account of a benchmark run, when the server is radixserve: its step counters
on GET /metrics (server/metrics.py) scraped before and after the run, as deltas.

    decode_steps, prefill_steps          steps run
    decode_device_s, extend_device_s     device seconds of each kind (CUDA events)
    idle_before_decode_s, ..._extend_s   device seconds idle just before a step of each kind
    generation_tokens                    tokens generated
    device_busy                          (decode_device_s + extend_device_s) / the run's duration
    mean_decode_step_ms                  decode_device_s / decode_steps
    tokens_per_decode_step               generation_tokens / decode_steps (prefill steps also
                                         sample one token each: a slight overcount)
    loop_cpu_s, forward_cpu_s            CPU seconds of the server's loop thread and forward
                                         worker (only from a server that reports them)
    loop_cpu_us_per_token                loop_cpu_s per generated token, in microseconds: the
                                         host's per-token cost (HTTP, detokenizing, streaming,
                                         scheduling), which bounds a fast device's throughput
    server_cpu_s, server_cpu_us_per_token
                                         with --engine-process, the server process's CPU (HTTP,
                                         rendering, streaming) apart from the engine's loop
    decode_step_per_token_ms             the decode step a generated token waited for, averaged
                                         over tokens (decode_row_device_seconds over
                                         decode_rows): the pure decode step at the run's own
                                         batch sizes, weighted as ITLs are
    weight_floor_ms                      the server's batch-1 weight floor (streamed weight bytes
                                         over copy bandwidth, measured at its start; GPU only)

and, from the client's own record of the run (latency_ratios), issue 33's two ratios:

    median_itl_over_decode_step          the run's median ITL over decode_step_per_token_ms
    floor_bound_duration_s               max over requests of (its send time from the run's
                                         start + its output tokens x the weight floor): the
                                         duration of this arrival schedule if every token cost
                                         the batch-1 floor and nothing else
    duration_over_floor_bound            the run's duration over floor_bound_duration_s
    memory_bound_duration_s              the same schedule on an ideal server that also reads
                                         every running request's KV each step (roofline.py,
                                         memory traffic only; the server's streamed weight bytes
                                         and KV bytes per token from /metrics)
    duration_over_memory_bound           the run's duration over memory_bound_duration_s

They say where a serving run's time went on the server: a device busy well below 1 with
requests waiting, or idle before decode steps, points at the host loop, not the kernels. Only a
server whose /v1/models card is owned_by radixserve is asked (other servers name these
counters differently, or not at all); any metric-name prefix (--metrics-prefix) is accepted.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from prometheus_client.parser import text_string_to_metric_families

from radixserve.bench.roofline import StepCost, roofline_duration

# engine.metrics() key (the scheduler's running totals) -> key of the result. /metrics exposes
# each as the counter `<prefix><key>_total` (server/metrics.py); bench offline reads them from
# the engine in-process.
ENGINE_KEYS = {
    "num_decode_steps": "decode_steps",
    "num_prefill_steps": "prefill_steps",
    "decode_device_seconds": "decode_device_s",
    "extend_device_seconds": "extend_device_s",
    "device_idle_before_decode_seconds": "idle_before_decode_s",
    "device_idle_before_extend_seconds": "idle_before_extend_s",
    "generation_tokens": "generation_tokens",
}
# Reported alongside when the server has them (AsyncEngine on Linux; not the offline scheduler;
# the decode-row counters from servers of issue 33 on).
HOST_KEYS = {
    "loop_thread_cpu_seconds": "loop_cpu_s",
    "forward_thread_cpu_seconds": "forward_cpu_s",
    "server_process_cpu_seconds": "server_cpu_s",       # --engine-process only
    "decode_row_device_seconds": "decode_row_device_s",
    "decode_rows": "decode_rows",
}
# Gauges read as they stand after the run (not as deltas).
GAUGE_KEYS = {"weight_floor_seconds": "weight_floor_s",
              "streamed_weight_bytes": "streamed_weight_bytes",
              "kv_cache_bytes_per_token": "kv_bytes_per_token"}


def engine_totals(metrics: Dict[str, float]) -> Dict[str, float]:
    """engine.metrics() -> {result key: total} (the running totals a run's deltas come from)."""
    return {key: metrics[name] for name, key in ENGINE_KEYS.items()}


def parse(text: str) -> Optional[Dict[str, float]]:
    """Prometheus exposition text -> {result key: value} for every counter of ENGINE_KEYS
    (matched as a name suffix, so under any prefix), or None when one is missing; HOST_KEYS'
    counters are added where present."""
    wanted = {name + "_total": key for name, key in {**ENGINE_KEYS, **HOST_KEYS}.items()}
    wanted.update(GAUGE_KEYS)
    found: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, key in wanted.items():
                if sample.name.endswith(name) and not sample.name.endswith("_created"):
                    found[key] = sample.value
    return found if all(key in found for key in ENGINE_KEYS.values()) else None


async def scrape(base_url: str) -> Optional[Dict[str, float]]:
    """parse() of GET base_url/metrics; None when it does not answer 200. (The HTTP client is
    imported here: bench offline uses this module's other parts without one.)"""
    import httpx

    from radixserve.bench.backends import auth_headers
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.get(base_url + "/metrics", headers=auth_headers())
    except httpx.HTTPError:
        return None
    return parse(r.text) if r.status_code == 200 else None


def over_run(before: Optional[Dict[str, float]], after: Optional[Dict[str, float]],
             duration: float) -> Optional[Dict[str, float]]:
    """The module doc's deltas of one run of `duration` seconds; None without both scrapes."""
    if before is None or after is None:
        return None
    d = {key: after[key] - before[key] for key in ENGINE_KEYS.values()}
    for key in ("decode_steps", "prefill_steps", "generation_tokens"):
        d[key] = int(round(d[key]))
    d["device_busy"] = (d["decode_device_s"] + d["extend_device_s"]) / duration if duration else 0.0
    steps = d["decode_steps"]
    d["mean_decode_step_ms"] = 1e3 * d["decode_device_s"] / steps if steps else 0.0
    d["tokens_per_decode_step"] = d["generation_tokens"] / steps if steps else 0.0
    for key in HOST_KEYS.values():
        if key in before and key in after:
            d[key] = after[key] - before[key]
    if "loop_cpu_s" in d and d["generation_tokens"]:
        d["loop_cpu_us_per_token"] = 1e6 * d["loop_cpu_s"] / d["generation_tokens"]
    if d.get("server_cpu_s") and d["generation_tokens"]:       # 0 without --engine-process
        d["server_cpu_us_per_token"] = 1e6 * d["server_cpu_s"] / d["generation_tokens"]
    if d.get("decode_rows"):
        d["decode_rows"] = int(round(d["decode_rows"]))
        d["decode_step_per_token_ms"] = 1e3 * d["decode_row_device_s"] / d["decode_rows"]
    if after.get("weight_floor_s"):
        d["weight_floor_ms"] = 1e3 * after["weight_floor_s"]
    for key in ("streamed_weight_bytes", "kv_bytes_per_token"):
        if after.get(key):
            d[key] = int(after[key])
    return d


def floor_bound_duration(arrivals: List[float], output_lens: List[int], floor_s: float) -> float:
    """max_i(arrivals[i] + output_lens[i] * floor_s): when the last request of this arrival
    schedule would end if each of its tokens cost the batch-1 weight floor and nothing else
    (no prefill, no batching cost). arrivals: seconds from the run's start; 0.0 when empty."""
    return max((a + n * floor_s for a, n in zip(arrivals, output_lens)), default=0.0)


def latency_ratios(metrics: Dict, steps: Dict[str, float]) -> Dict[str, float]:
    """Issue 33's ratios of a run (module doc) from its metrics (metrics.summarize, with the
    per-request send times) and its over_run() deltas; only those the server's counters allow
    (none from a server without the decode-row counters or, on the CPU, the weight floor)."""
    out: Dict[str, float] = {}
    step_ms = steps.get("decode_step_per_token_ms")
    if step_ms:
        out["median_itl_over_decode_step"] = metrics["median_itl_ms"] / step_ms
    floor_ms = steps.get("weight_floor_ms")
    per = metrics.get("per_request") or {}
    if floor_ms and per.get("arrival_s"):
        bound = floor_bound_duration(per["arrival_s"], per["output_len"], floor_ms / 1e3)
        out["floor_bound_duration_s"] = bound
        out["duration_over_floor_bound"] = metrics["duration"] / bound if bound else 0.0
        if steps.get("streamed_weight_bytes") and steps.get("kv_bytes_per_token") \
                and per.get("input_len"):
            memory = memory_bound_duration(per["arrival_s"], per["input_len"],
                                           per["output_len"], floor_ms / 1e3,
                                           steps["streamed_weight_bytes"],
                                           steps["kv_bytes_per_token"])
            out["memory_bound_duration_s"] = memory
            out["duration_over_memory_bound"] = metrics["duration"] / memory if memory else 0.0
    return out


def memory_bound_duration(arrivals: List[float], input_lens: List[int], output_lens: List[int],
                          floor_s: float, weight_bytes: int, kv_bytes_per_token: int) -> float:
    """The run's arrival schedule on bench/roofline.py's ideal server with its memory traffic
    alone (every step reads the weights and every running request's KV; FLOPs not counted):
    the floor bound plus the KV reads no server avoids. The KV bytes cost what the server's
    weight bytes cost (bandwidth = weight_bytes / floor_s, the server's own)."""
    cost = StepCost(weights_s=floor_s, kv_s_per_token=kv_bytes_per_token * floor_s / weight_bytes,
                    flop_s_per_token=0.0)
    return roofline_duration(arrivals, input_lens, output_lens, cost)[0]
