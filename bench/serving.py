"""Serving load generator (in the manner of SGLang's bench_serving): streams requests at a running
radixserve (or any server with SGLang's /generate or OpenAI's /v1/completions) and reports
TTFT / ITL / end-to-end latency percentiles, request and token throughput, and the cache hit rate.

Prompts are token ids (both routes accept them), so lengths are exact and no tokenizer is needed.

Datasets
  random                   --random-input-len, --random-output-len, --random-range-ratio
  generated-shared-prefix  --gsp-num-groups groups of --gsp-prompts-per-group prompts; each prompt is
                           its group's system prompt (--gsp-system-prompt-len) + a question
                           (--gsp-question-len); --gsp-output-len new tokens; --gsp-order
  multi-turn               --num-prompts conversations of --mt-turns turns; turn k's prompt is turn
                           k-1's prompt + its answer + a new message, sent when turn k-1 returns

Arrivals: --request-rate (Poisson, requests/s; inf = all at once) and/or --max-concurrency.

--compare NAME launches the server itself (`python -m radixserve.launch_server` on a free port, one
configuration after another), runs the same workload against each, and reports throughput and
mean TTFT / ITL ratios from that one run. NAME radix (the default): radix cache + fcfs,
--disable-radix-cache, radix cache + lpm; NAME overlap: overlap scheduling, --disable-overlap-schedule.
--launch does the same for one server; --preset NAME serves bench/presets.py's model directory of
that name with --load-format dummy. --sweep-concurrency 1,2,4,... runs the workload at each
max-concurrency. --output-file writes JSON (with per-request TTFT and ITL lists) and, next to it,
the PNG plots of bench/plots.py.

Examples (see bench/README.md):
  python bench/serving.py --port 30000 --dataset random --num-prompts 64 --request-rate 8
  python bench/serving.py --compare --dataset generated-shared-prefix --output-file out.json
  python bench/serving.py --preset llama-3.1-8b --compare overlap --dataset random \
      --sweep-concurrency 1,2,4,8,16,32,64,128,256 --output-file out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import httpx
import numpy as np
from tqdm.asyncio import tqdm

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:          # `radixserve bench` runs this file with runpy
    sys.path.insert(0, BENCH_DIR)

from launcher import (LaunchedServer, free_port, radixserve_command, source_revision,  # noqa: E402
                      stop_servers_on_sigterm)


# ----------------------------------------------------------------------------- workloads

@dataclass
class BenchRequest:
    prompt_ids: List[int]
    output_len: int


@dataclass
class Conversation:
    messages: List[List[int]]   # the user message of each turn (turn 0's includes the opening)
    output_len: int


def _ids(rng: random.Random, n: int, lo: int, hi: int) -> List[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def sample_random(rng, num, input_len, output_len, range_ratio, lo, hi) -> List[BenchRequest]:
    """Lengths uniform in [len * range_ratio, len]; token ids uniform in [lo, hi)."""
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        out.append(BenchRequest(_ids(rng, n_in, lo, hi), n_out))
    return out


def sample_shared_prefix(rng, num_groups, per_group, system_len, question_len, output_len, order,
                         lo, hi) -> List[BenchRequest]:
    """num_groups x per_group prompts = group system prompt + own question. order: interleaved
    (round-robin over groups: the cache-unfriendly arrival order), grouped, or shuffled."""
    systems = [_ids(rng, system_len, lo, hi) for _ in range(num_groups)]
    groups = [[BenchRequest(systems[g] + _ids(rng, question_len, lo, hi), output_len)
               for _ in range(per_group)] for g in range(num_groups)]
    if order == "grouped":
        return [r for g in groups for r in g]
    out = [groups[g][j] for j in range(per_group) for g in range(num_groups)]
    if order == "shuffled":
        rng.shuffle(out)
    return out


def sample_conversations(rng, num, turns, first_len, message_len, output_len, lo, hi):
    return [Conversation([_ids(rng, first_len, lo, hi)] +
                         [_ids(rng, message_len, lo, hi) for _ in range(turns - 1)], output_len)
            for _ in range(num)]


# ----------------------------------------------------------------------------- one request

@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0                       # seconds to the first output token
    latency: float = 0.0                    # seconds to the last byte
    itl: List[float] = field(default_factory=list)   # gaps between chunks carrying new tokens
    output_ids: List[int] = field(default_factory=list)


def _sse_payloads(line: str) -> Optional[str]:
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def send_generate(client: httpx.AsyncClient, base_url: str, prompt_ids: List[int],
                        output_len: int, ignore_eos: bool) -> RequestResult:
    """Stream one request through SGLang's native /generate (cumulative output_ids per chunk)."""
    payload = {"input_ids": prompt_ids, "stream": True,
               "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0,
                                   "ignore_eos": ignore_eos}}
    res = RequestResult(prompt_len=len(prompt_ids))
    start = last = time.perf_counter()
    meta: Dict = {}
    try:
        async with client.stream("POST", base_url + "/generate", json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            async for line in resp.aiter_lines():
                data = _sse_payloads(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                now = time.perf_counter()
                ids = chunk.get("output_ids") or []
                if len(ids) > len(res.output_ids):
                    if not res.output_ids:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.output_ids = list(ids)
                meta = chunk.get("meta_info") or meta
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.prompt_len = meta.get("prompt_tokens", len(prompt_ids))
    res.output_len = meta.get("completion_tokens", len(res.output_ids))
    res.cached_tokens = meta.get("cached_tokens", 0)
    res.success = True
    return res


async def send_completions(client: httpx.AsyncClient, base_url: str, model: str,
                           prompt_ids: List[int], output_len: int, ignore_eos: bool) -> RequestResult:
    """Stream one request through /v1/completions; counts come from the final usage chunk."""
    payload = {"model": model, "prompt": prompt_ids, "max_tokens": output_len, "temperature": 0.0,
               "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_len=len(prompt_ids))
    start = last = time.perf_counter()
    usage: Dict = {}
    got_text = False
    try:
        async with client.stream("POST", base_url + "/v1/completions", json=payload) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
                return res
            async for line in resp.aiter_lines():
                data = _sse_payloads(line)
                if data is None:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        if not got_text:
                            res.ttft = now - start
                            got_text = True
                        else:
                            res.itl.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.prompt_len = usage.get("prompt_tokens", len(prompt_ids))
    res.output_len = usage.get("completion_tokens", 0)
    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    res.success = True
    return res


# ----------------------------------------------------------------------------- the run

def _percentiles(xs: List[float], scale: float) -> Dict[str, float]:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: List[RequestResult], duration: float) -> Dict:
    ok = [r for r in results if r.success]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:5],
        "duration_s": duration,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "total_cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else 0.0,
        "request_throughput": len(ok) / duration,
        "input_token_throughput": prompt / duration,
        "output_token_throughput": output / duration,
        "total_token_throughput": (prompt + output) / duration,
        "ttft_ms": _percentiles([r.ttft for r in ok], 1e3),
        "tpot_ms": _percentiles(tpot, 1e3),
        "itl_ms": _percentiles([x for r in ok for x in r.itl], 1e3),
        "e2e_latency_ms": _percentiles([r.latency for r in ok], 1e3),
        # per successful request, in completion order: what CDF plots need (bench/plots.py)
        "per_request": {
            "ttft_ms": [round(r.ttft * 1e3, 3) for r in ok],
            "latency_ms": [round(r.latency * 1e3, 3) for r in ok],
            "output_len": [r.output_len for r in ok],
            "itl_ms": [[round(x * 1e3, 3) for x in r.itl] for r in ok],
        },
    }


class Runner:
    """Sends a workload with the configured arrival process and concurrency limit."""

    def __init__(self, args, base_url: str, model: str, max_concurrency: Optional[int] = None):
        """max_concurrency: requests in flight at most (default: --max-concurrency; None: no cap)."""
        self.args = args
        self.base_url = base_url
        self.model = model
        limit = max_concurrency or args.max_concurrency
        self.sem = asyncio.Semaphore(limit) if limit else None

    async def _send(self, client, prompt_ids, output_len) -> RequestResult:
        if self.args.backend == "generate":
            call = send_generate(client, self.base_url, prompt_ids, output_len, not self.args.disable_ignore_eos)
        else:
            call = send_completions(client, self.base_url, self.model, prompt_ids, output_len,
                                    not self.args.disable_ignore_eos)
        if self.sem is None:
            return await call
        async with self.sem:
            return await call

    async def _arrivals(self, n: int):
        rng = random.Random(self.args.seed + 1)
        for i in range(n):
            yield i
            if math.isfinite(self.args.request_rate) and i + 1 < n:
                await asyncio.sleep(rng.expovariate(self.args.request_rate))

    async def run(self, requests: List[BenchRequest] = None,
                  conversations: List[Conversation] = None):
        timeout = httpx.Timeout(self.args.request_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        results: List[RequestResult] = []
        total = len(requests) if requests is not None else len(conversations) * self.args.mt_turns
        pbar = None if self.args.disable_tqdm else tqdm(total=total)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

            async def one(req: BenchRequest):
                r = await self._send(client, req.prompt_ids, req.output_len)
                results.append(r)
                if pbar:
                    pbar.update(1)

            async def conversation(conv: Conversation):
                history: List[int] = []
                for message in conv.messages:
                    prompt = history + message
                    r = await self._send(client, prompt, conv.output_len)
                    results.append(r)
                    if pbar:
                        pbar.update(1)
                    if not r.success:
                        return
                    history = prompt + r.output_ids

            start = time.perf_counter()
            tasks = []
            items = requests if requests is not None else conversations
            work = one if requests is not None else conversation
            async for i in self._arrivals(len(items)):
                tasks.append(asyncio.create_task(work(items[i])))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
        if pbar:
            pbar.close()
        return summarize(results, duration)


def build_workload(args, vocab_size: int):
    rng = random.Random(args.seed)
    lo = args.token_id_low
    hi = min(vocab_size, args.token_id_high) if args.token_id_high else vocab_size
    if not lo < hi:
        raise ValueError(f"token id range [{lo}, {hi}) is empty; change --token-id-low/--token-id-high")
    if args.dataset == "random":
        return sample_random(rng, args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, lo, hi), None
    if args.dataset == "generated-shared-prefix":
        return sample_shared_prefix(rng, args.gsp_num_groups, args.gsp_prompts_per_group,
                                    args.gsp_system_prompt_len, args.gsp_question_len,
                                    args.gsp_output_len, args.gsp_order, lo, hi), None
    if args.backend != "generate":
        raise ValueError("--dataset multi-turn needs --backend generate (it replays output ids)")
    return None, sample_conversations(rng, args.num_prompts, args.mt_turns, args.mt_first_len,
                                      args.mt_message_len, args.mt_output_len, lo, hi)


async def server_facts(base_url: str) -> Dict:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(base_url + "/get_model_info")
        r.raise_for_status()
        return r.json()


async def benchmark_once(args, base_url: str, workload,
                         max_concurrency: Optional[int] = None) -> Dict:
    """Run workload (requests, conversations) once against base_url; its metrics (summarize)."""
    facts = await server_facts(base_url)
    model = args.model or facts.get("served_model_name") or ""
    requests, conversations = workload
    metrics = await Runner(args, base_url, model, max_concurrency).run(requests, conversations)
    return metrics


def print_metrics(name: str, m: Dict) -> None:
    print(f"\n============ {name} ============")
    rows = [("Successful requests", m["completed"]), ("Failed requests", m["failed"]),
            ("Duration (s)", m["duration_s"]), ("Total input tokens", m["total_input_tokens"]),
            ("Total cached tokens", m["total_cached_tokens"]),
            ("Cache hit rate", m["cache_hit_rate"]),
            ("Total output tokens", m["total_output_tokens"]),
            ("Request throughput (req/s)", m["request_throughput"]),
            ("Input token throughput (tok/s)", m["input_token_throughput"]),
            ("Output token throughput (tok/s)", m["output_token_throughput"]),
            ("Total token throughput (tok/s)", m["total_token_throughput"])]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat} {key.replace('_ms', '')} (ms)", m[key][stat]))
    for label, v in rows:
        print(f"{label:<36}{v:>14.3f}" if isinstance(v, float) else f"{label:<36}{v:>14}")
    for e in m["errors"]:
        print("error:", e)


# ----------------------------------------------------------------------------- launched servers

# --compare NAME: the server configurations run in turn (extra launch_server flags each) ...
COMPARE_SETS: Dict[str, List[Tuple[str, List[str]]]] = {
    "radix": [("radix-fcfs", []),
              ("no-radix-fcfs", ["--disable-radix-cache"]),
              ("radix-lpm", ["--schedule-policy", "lpm"])],
    "overlap": [("overlap", []),
                ("no-overlap", ["--disable-overlap-schedule"])],
}
# ... and the ratios reported: (name, this configuration, its peer)
COMPARE_PAIRS: Dict[str, List[Tuple[str, str, str]]] = {
    "radix": [("radix_over_no_radix", "radix-fcfs", "no-radix-fcfs"),
              ("lpm_over_fcfs", "radix-lpm", "radix-fcfs")],
    "overlap": [("overlap_over_no_overlap", "overlap", "no-overlap")],
}
# kept for callers of the old module-level name
COMPARE_CONFIGS = COMPARE_SETS["radix"]


async def warm_up(base_url: str, vocab_size: int) -> None:
    """One short unrelated request (first-call overheads), then an empty cache."""
    async with httpx.AsyncClient(timeout=600) as client:
        ids = [random.Random(-1).randrange(100, vocab_size) for _ in range(32)]
        r = await client.post(base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        r.raise_for_status()
        await flush_cache(base_url)


async def flush_cache(base_url: str) -> None:
    """POST /flush_cache (the server must be idle), so no run reuses an earlier run's KV."""
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(base_url + "/flush_cache")
        r.raise_for_status()


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def pair_ratios(this: Dict, peer: Dict) -> Dict[str, float]:
    """this over peer: throughputs as this / peer, latencies as a speed-up (peer / this)."""
    return {
        "request_throughput": ratio(this["request_throughput"], peer["request_throughput"]),
        "output_token_throughput": ratio(this["output_token_throughput"],
                                         peer["output_token_throughput"]),
        "total_token_throughput": ratio(this["total_token_throughput"],
                                        peer["total_token_throughput"]),
        "mean_ttft_speedup": ratio(peer["ttft_ms"]["mean"], this["ttft_ms"]["mean"]),
        "mean_itl_speedup": ratio(peer["itl_ms"]["mean"], this["itl_ms"]["mean"]),
    }


def _head(workload, n: int):
    """The first n requests (or conversations) of a workload."""
    requests, conversations = workload
    return (requests[:n] if requests is not None else None,
            conversations[:n] if conversations is not None else None)


def run_sweep(args, base_url: str, workload) -> List[Dict]:
    """The workload at each --sweep-concurrency level, the cache flushed before each; one point
    (max_concurrency, num_requests and the metrics) per level. With
    --sweep-prompts-per-concurrency K, level c sends the first c * K requests of the workload."""
    points = []
    total = len(workload[0] if workload[0] is not None else workload[1])
    print(f"{'concurrency':>11} {'requests':>9} {'out tok/s':>11} {'mean TTFT ms':>13} "
          f"{'mean ITL ms':>12} {'failed':>7}")
    for c in args.sweep_concurrency:
        n = min(total, c * args.sweep_prompts_per_concurrency) \
            if args.sweep_prompts_per_concurrency else total
        asyncio.run(flush_cache(base_url))
        m = asyncio.run(benchmark_once(args, base_url, _head(workload, n), max_concurrency=c))
        points.append({"max_concurrency": c, "num_requests": n, **m})
        print(f"{c:>11} {n:>9} {m['output_token_throughput']:>11.1f} "
              f"{m['ttft_ms']['mean']:>13.1f} {m['itl_ms']['mean']:>12.2f} {m['failed']:>7}")
    return points


def _prepare_model(args, work_dir: str) -> Tuple[List[str], Optional[int]]:
    """launch_server flags naming the model (--preset: a built directory, dummy weights) and the
    highest prompt token id to use (the preset's ordinary vocabulary; None: the server's)."""
    if not args.preset:
        return [], None
    from presets import PRESETS, build_preset, ordinary_vocab_end

    out = args.preset_dir or os.path.join(work_dir, f"preset-{args.preset}")
    build_preset(args.preset, out)
    print(f"--- preset {args.preset} ({PRESETS[args.preset].hf_name} shapes) built in {out}")
    return (["--model-path", out, "--load-format", "dummy"],
            ordinary_vocab_end(PRESETS[args.preset]))


def run_launched(args) -> Dict:
    """Launch `python -m radixserve.launch_server` per configuration (--compare NAME: each of
    COMPARE_SETS[NAME]; else one), warm each up, run the identical workload (or the sweep), stop
    it. Returns {"runs" | "sweep", "ratios" (with --compare), "server_logs", ...}."""
    stop_servers_on_sigterm()   # the `with` blocks below then stop the server on SIGTERM too
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="radixserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    model_args, token_limit = _prepare_model(args, log_dir)
    base_args = model_args + shlex.split(args.server_args)
    configs = COMPARE_SETS[args.compare] if args.compare else [("default", [])]
    runs: Dict[str, Dict] = {}
    sweep: Dict[str, List[Dict]] = {}
    facts: Dict = {}
    workload = None
    for name, extra in configs:
        log_path = os.path.join(log_dir, f"{name}.log")
        port = free_port()
        cmd = radixserve_command(port, base_args + extra)
        print(f"\n--- {name}: launching server ({' '.join(base_args + extra)}); log {log_path}")
        with LaunchedServer(cmd, port, log_path, args.server_timeout) as server:
            facts = asyncio.run(server_facts(server.base_url))
            if workload is None:
                vocab = facts["vocab_size"] if token_limit is None else min(token_limit,
                                                                            facts["vocab_size"])
                workload = build_workload(args, vocab)
            asyncio.run(warm_up(server.base_url, facts["vocab_size"]))
            if args.sweep_concurrency:
                sweep[name] = run_sweep(args, server.base_url, workload)
                for point in sweep[name]:
                    point["server_args"] = base_args + extra
            else:
                metrics = asyncio.run(benchmark_once(args, server.base_url, workload))
                metrics["server_args"] = base_args + extra
                runs[name] = metrics
                print_metrics(name, metrics)
    out: Dict = {"server_logs": log_dir, "server": facts}
    if args.sweep_concurrency:
        out["sweep"] = sweep
    else:
        out["runs"] = runs
    if args.compare:
        out["ratios"] = compare_ratios(args.compare, runs, sweep)
    return out


def compare_ratios(compare: str, runs: Dict[str, Dict], sweep: Dict[str, List[Dict]]) -> Dict:
    """COMPARE_PAIRS[compare] as ratios: of the runs, or per concurrency level of the sweep."""
    ratios: Dict = {}
    print("\n============ ratios (one run each) ============")
    for pair, this, peer in COMPARE_PAIRS[compare]:
        if runs:
            ratios[pair] = pair_ratios(runs[this], runs[peer])
            print(pair + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios[pair].items()))
        else:
            ratios[pair] = [{"max_concurrency": a["max_concurrency"], **pair_ratios(a, b)}
                            for a, b in zip(sweep[this], sweep[peer])]
            print(pair + " by concurrency:")
            for r in ratios[pair]:
                print(f"  {r['max_concurrency']:>4}: output tok/s {r['output_token_throughput']:.2f}x, "
                      f"mean TTFT {r['mean_ttft_speedup']:.2f}x, mean ITL {r['mean_itl_speedup']:.2f}x")
    return ratios


# kept for callers of the old name
run_compare = run_launched


# ----------------------------------------------------------------------------- CLI

def _int_list(text: str) -> List[int]:
    """'1,2,4' -> [1, 2, 4]; every value >= 1."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=["generate", "completions"], default="generate",
                   help="generate: native /generate; completions: /v1/completions")
    p.add_argument("--model", default=None, help="model name for /v1/completions (default: the served one)")
    p.add_argument("--dataset", choices=["random", "generated-shared-prefix", "multi-turn"],
                   default="generated-shared-prefix")
    p.add_argument("--num-prompts", type=int, default=64,
                   help="requests (random) or conversations (multi-turn)")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=32)
    p.add_argument("--random-range-ratio", type=float, default=1.0)
    p.add_argument("--gsp-num-groups", type=int, default=2)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=16)
    p.add_argument("--gsp-output-len", type=int, default=4)
    p.add_argument("--gsp-order", choices=["interleaved", "grouped", "shuffled"], default="interleaved")
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-first-len", type=int, default=256)
    p.add_argument("--mt-message-len", type=int, default=32)
    p.add_argument("--mt-output-len", type=int, default=16)
    p.add_argument("--token-id-low", type=int, default=100, help="prompt token ids are drawn from "
                   "[low, high); the low ids hold most special tokens")
    p.add_argument("--token-id-high", type=int, default=None, help="default: the vocab size")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (conversation starts for multi-turn); inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: exactly the requested output length)")
    p.add_argument("--request-timeout", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--output-file", default=None, help="write the results as JSON here")
    p.add_argument("--no-plots", action="store_true",
                   help="do not write PNG plots next to --output-file")
    g = p.add_argument_group("launching the server (--launch, --preset, --compare)")
    g.add_argument("--launch", action="store_true",
                   help="launch `python -m radixserve.launch_server` on a free port for the run "
                        "and stop it afterwards (implied by --preset and --compare)")
    g.add_argument("--preset", default=None, metavar="NAME",
                   help="serve the real shapes of NAME (bench/presets.py: llama-3.1-8b, "
                        "llama-3.2-1b, qwen2.5-7b, smollm2-135m) with dummy weights; implies --launch")
    g.add_argument("--preset-dir", default=None,
                   help="build the preset here (default: inside the server log directory)")
    g.add_argument("--compare", nargs="?", const="radix", default=None, choices=sorted(COMPARE_SETS),
                   help="launch one server per configuration and report ratios: radix (the default "
                        "when given alone): radix/fcfs vs --disable-radix-cache vs radix/lpm; "
                        "overlap: overlap scheduling vs --disable-overlap-schedule")
    g.add_argument("--server-args", default="", help="extra launch_server flags for every server")
    g.add_argument("--server-timeout", type=float, default=900.0)
    g.add_argument("--server-log-dir", default=None)
    g = p.add_argument_group("concurrency sweep")
    g.add_argument("--sweep-concurrency", type=_int_list, default=None, metavar="1,2,4,...",
                   help="run the workload at each max-concurrency (cache flushed between levels) "
                        "and record the throughput per level")
    g.add_argument("--sweep-prompts-per-concurrency", type=int, default=None, metavar="K",
                   help="level c sends the first c*K requests of the workload (default: all)")
    args = p.parse_args(argv)
    if args.preset:
        from presets import PRESETS
        if args.preset not in PRESETS:
            p.error(f"--preset must be one of {', '.join(PRESETS)}")
    args.launch = bool(args.launch or args.preset or args.compare)
    if args.sweep_prompts_per_concurrency is not None and args.sweep_prompts_per_concurrency < 1:
        p.error("--sweep-prompts-per-concurrency must be >= 1")
    for name in ("num_prompts", "random_input_len", "random_output_len", "gsp_num_groups",
                 "gsp_prompts_per_group", "gsp_question_len", "gsp_output_len", "mt_turns",
                 "mt_first_len", "mt_message_len", "mt_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.random_range_ratio <= 1:
        p.error("--random-range-ratio must be in [0, 1]")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf = all at once)")
    return args


def main(argv=None) -> Dict:
    args = parse_args(argv)
    result: Dict = {"command": "python bench/serving.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                    "args": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                             for k, v in vars(args).items()},
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "source": source_revision()}
    if args.launch:
        result.update(run_launched(args))
        if not args.compare and "runs" in result:      # one launched server: as against a running one
            result["metrics"] = result.pop("runs")["default"]
    else:
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        facts = asyncio.run(server_facts(base_url))
        workload = build_workload(args, facts["vocab_size"])
        result["server"] = facts
        if args.sweep_concurrency:
            result["sweep"] = {"default": run_sweep(args, base_url, workload)}
        else:
            result["metrics"] = asyncio.run(benchmark_once(args, base_url, workload))
            print_metrics(args.dataset, result["metrics"])
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            f.write(to_json(result) + "\n")
        print(f"\nwrote {args.output_file}")
        if not args.no_plots:
            write_plots(result, args.output_file)
    return result


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


def write_plots(result: Dict, output_file: str) -> List[str]:
    """bench/plots.py's PNGs next to output_file; a missing matplotlib is reported, not fatal."""
    try:
        import plots
        paths = plots.write_plots(result, output_file)
    except ImportError as e:
        print(f"no plots ({e}); pip install matplotlib, or pass --no-plots")
        return []
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
