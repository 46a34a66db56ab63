"""The numbers of one `radixserve bench serving` run, under the key names of SGLang's
bench_serving (so its readers read ours): completed, duration, total_input_tokens,
total_output_tokens, request_throughput, input_throughput, output_throughput, total_throughput,
concurrency (sum of latencies / duration) and {mean, median, std, p90, p99}_{ttft, tpot, itl,
e2e_latency}_ms, plus p95_itl_ms and max_itl_ms. Ours alongside: failed, failure_reasons
({reason: count}, the reasons of backends.FAILURES), error_samples (per reason, the first line
of one of its errors, "reason: line"), total_cached_tokens, cache_hit_rate (cached / prompt
tokens) and per_request (the lists that CDF plots need). Every number but failed and
failure_reasons is over the successful requests. TPOT is (latency - TTFT) / (output tokens -
1) over requests with more than one output token."""
from __future__ import annotations

import json
from collections import Counter
from typing import Dict, List

import numpy as np

from radixserve.bench.backends import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")
STATS = ("mean", "median", "std", "p90", "p99")


def latency_stats(name: str, seconds: List[float]) -> Dict[str, float]:
    """{mean,median,std,p90,p99}_{name}_ms of seconds (all 0.0 when empty, as SGLang's)."""
    a = np.asarray(seconds if seconds else [0.0], dtype=float) * 1e3
    values = {"mean": a.mean(), "median": np.median(a), "std": a.std(),
              "p90": np.percentile(a, 90), "p99": np.percentile(a, 99)}
    return {f"{stat}_{name}_ms": float(values[stat]) for stat in STATS}


def _per_request(ok: List[RequestResult], t0: float) -> Dict[str, list]:
    """Per successful request, in completion order: what CDF plots need (plots.py), and each
    one's send time in seconds from the run's start t0 (the arrival schedule as it ran)."""
    return {"arrival_s": [round(r.start - t0, 6) for r in ok],
            "ttft_ms": [round(r.ttft * 1e3, 3) for r in ok],
            "latency_ms": [round(r.latency * 1e3, 3) for r in ok],
            "input_len": [r.prompt_len for r in ok],
            "output_len": [r.output_len for r in ok],
            "itl_ms": [[round(x * 1e3, 3) for x in r.itl] for r in ok]}


def failure_account(results: List[RequestResult]) -> Dict:
    """{"failed", "failure_reasons": {reason: count}, "error_samples"} of results (module doc);
    a failed result without a failure reason counts as "error"."""
    failed = [r for r in results if not r.success]
    reasons = Counter(r.failure or "error" for r in failed)
    samples = {}
    for r in sorted(failed, key=lambda r: (r.failure or "error", r.error)):
        lines = r.error.strip().splitlines()
        samples.setdefault(r.failure or "error", lines[0][:200] if lines else "")
    return {"failed": len(failed), "failure_reasons": dict(sorted(reasons.items())),
            "error_samples": [f"{reason}: {line}" for reason, line in samples.items()]}


def summarize(results: List[RequestResult], duration: float, t0: float = 0.0) -> Dict:
    """The metrics of a run of results that took duration seconds from t0 (time.perf_counter()
    at its start; see the module doc)."""
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    itl = [x for r in ok for x in r.itl]
    m: Dict = {
        "completed": len(ok), **failure_account(results),
        "duration": duration,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "total_cached_tokens": cached, "cache_hit_rate": cached / prompt if prompt else 0.0,
        "request_throughput": len(ok) / duration, "input_throughput": prompt / duration,
        "output_throughput": output / duration, "total_throughput": (prompt + output) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    m.update(latency_stats("ttft", [r.ttft for r in ok]))
    m.update(latency_stats("tpot", [(r.latency - r.ttft) / (r.output_len - 1)
                                    for r in ok if r.output_len > 1]))
    m.update(latency_stats("itl", itl))
    m["p95_itl_ms"] = float(np.percentile(itl, 95) * 1e3) if itl else 0.0
    m["max_itl_ms"] = float(max(itl) * 1e3) if itl else 0.0
    m.update(latency_stats("e2e_latency", [r.latency for r in ok]))
    m["per_request"] = _per_request(ok, t0)
    return m


def print_metrics(name: str, m: Dict) -> None:
    """A table of m, in the order SGLang prints it."""
    print(f"\n{(' ' + name + ' '):=^60}")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Benchmark duration (s)", m["duration"]),
            ("Total input tokens", m["total_input_tokens"]),
            ("Total cached tokens", m["total_cached_tokens"]),
            ("Cache hit rate", m["cache_hit_rate"]),
            ("Total generated tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Input token throughput (tok/s)", m["input_throughput"]),
            ("Output token throughput (tok/s)", m["output_throughput"]),
            ("Total token throughput (tok/s)", m["total_throughput"]),
            ("Concurrency", m["concurrency"])]
    for what, label in zip(LATENCIES, ("TTFT", "TPOT", "ITL", "E2E Latency")):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", m[f"{stat}_{what}_ms"]))
    steps = m.get("server_steps")
    if steps:   # the server's own counters over the run (server_steps.py)
        rows += [("Server device busy (fraction)", steps["device_busy"]),
                 ("Server decode steps", steps["decode_steps"]),
                 ("Server mean decode step (ms)", steps["mean_decode_step_ms"]),
                 ("Server tokens per decode step", steps["tokens_per_decode_step"]),
                 ("Server prefill device time (s)", steps["extend_device_s"]),
                 ("Server idle before decode (s)", steps["idle_before_decode_s"])]
        if "loop_cpu_us_per_token" in steps:
            rows.append(("Server loop CPU per token (us)", steps["loop_cpu_us_per_token"]))
        if "server_cpu_us_per_token" in steps:      # --engine-process: the HTTP side's
            rows.append(("Server process CPU per token (us)", steps["server_cpu_us_per_token"]))
        if "decode_step_per_token_ms" in steps:
            rows += [("Server decode step per token (ms)", steps["decode_step_per_token_ms"]),
                     ("Median ITL / decode step per token", steps["median_itl_over_decode_step"])]
        if "floor_bound_duration_s" in steps:
            rows += [("Server weight floor, batch 1 (ms)", steps["weight_floor_ms"]),
                     ("Floor-bound duration (s)", steps["floor_bound_duration_s"]),
                     ("Duration / floor-bound duration", steps["duration_over_floor_bound"])]
        if "memory_bound_duration_s" in steps:
            rows += [("Memory-bound duration (s)", steps["memory_bound_duration_s"]),
                     ("Duration / memory-bound duration", steps["duration_over_memory_bound"])]
    for label, v in rows:
        print(f"{label:<40}{v:>14.3f}" if isinstance(v, float) else f"{label:<40}{v:>14}")
    for reason, count in (m.get("failure_reasons") or {}).items():
        print(f"{'Failed: ' + reason:<40}{count:>14}")
    if m["error_samples"]:
        print("Errors (one per failure reason, its first line):")
    for e in m["error_samples"]:
        print("  " + e)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def pair_ratios(this: Dict, peer: Dict) -> Dict[str, float]:
    """this over peer: throughputs as this / peer, latencies as a speed-up (peer / this)."""
    return {
        "request_throughput": ratio(this["request_throughput"], peer["request_throughput"]),
        "output_throughput": ratio(this["output_throughput"], peer["output_throughput"]),
        "total_throughput": ratio(this["total_throughput"], peer["total_throughput"]),
        "mean_ttft_speedup": ratio(peer["mean_ttft_ms"], this["mean_ttft_ms"]),
        "mean_itl_speedup": ratio(peer["mean_itl_ms"], this["mean_itl_ms"]),
    }


def to_json(obj, indent: int = 0) -> str:
    """JSON with one key per line, except that a list of numbers (a per-request series) stays on
    one line, so files with thousands of latencies remain readable and small."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {to_json(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)) and obj and any(isinstance(v, (dict, list, tuple)) for v in obj):
        if all(isinstance(v, (list, tuple)) and not any(isinstance(x, (dict, list)) for x in v)
               for v in obj):
            return "[" + ", ".join(json.dumps(list(v)) for v in obj) + "]"
        return "[\n" + ",\n".join(inner + to_json(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj)


def finite(value):
    """value with float infinities as the string "inf" (-inf: "-inf"), so the JSON is strict."""
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
