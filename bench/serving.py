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

--compare launches the server itself (`python -m radixserve.launch_server` on a free port, one
configuration after another: radix cache + fcfs, --disable-radix-cache, radix cache + lpm), runs the
same workload against each, and reports throughput and mean-TTFT ratios from that one run.

Examples (see bench/README.md):
  python bench/serving.py --port 30000 --dataset random --num-prompts 64 --request-rate 8
  python bench/serving.py --compare --dataset generated-shared-prefix --output-file out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import httpx
import numpy as np
from tqdm.asyncio import tqdm

PYSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "pysrc")
COMPARE_CONFIGS = [
    ("radix-fcfs", []),
    ("no-radix-fcfs", ["--disable-radix-cache"]),
    ("radix-lpm", ["--schedule-policy", "lpm"]),
]


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
    }


class Runner:
    """Sends a workload with the configured arrival process and concurrency limit."""

    def __init__(self, args, base_url: str, model: str):
        self.args = args
        self.base_url = base_url
        self.model = model
        self.sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

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


async def benchmark_once(args, base_url: str, workload) -> Dict:
    facts = await server_facts(base_url)
    model = args.model or facts.get("served_model_name") or ""
    requests, conversations = workload
    metrics = await Runner(args, base_url, model).run(requests, conversations)
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


# ----------------------------------------------------------------------------- --compare

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """`python -m radixserve.launch_server` in a subprocess, logging to a file, until stopped."""

    def __init__(self, extra_args: List[str], log_path: str, timeout: float):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1",
                    "--port", str(self.port)] + extra_args
        self.log_path = log_path
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self):
        self.log = open(self.log_path, "w")
        # the server imports radixserve from this checkout unless it is installed
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PYSRC, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise RuntimeError(f"server not healthy after {self.timeout}s; see {self.log_path}")

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def warm_up(base_url: str, vocab_size: int) -> None:
    """One short unrelated request (first-call overheads), then an empty cache."""
    async with httpx.AsyncClient(timeout=600) as client:
        ids = [random.Random(-1).randrange(100, vocab_size) for _ in range(32)]
        r = await client.post(base_url + "/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
        r.raise_for_status()
        r = await client.post(base_url + "/flush_cache")
        r.raise_for_status()


def ratio(a: float, b: float) -> float:
    return a / b if b else float("inf")


def run_compare(args) -> Dict:
    # a SIGTERM still runs the context managers below, so no server outlives the bench
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = args.server_log_dir or tempfile.mkdtemp(prefix="radixserve-bench-")
    os.makedirs(log_dir, exist_ok=True)
    base_args = shlex.split(args.server_args)
    runs: Dict[str, Dict] = {}
    workload = None
    for name, extra in COMPARE_CONFIGS:
        log_path = os.path.join(log_dir, f"{name}.log")
        print(f"\n--- {name}: launching server ({' '.join(base_args + extra)}); log {log_path}")
        with LaunchedServer(base_args + extra, log_path, args.server_timeout) as server:
            facts = asyncio.run(server_facts(server.base_url))
            if workload is None:
                workload = build_workload(args, facts["vocab_size"])
            asyncio.run(warm_up(server.base_url, facts["vocab_size"]))
            metrics = asyncio.run(benchmark_once(args, server.base_url, workload))
        metrics["server_args"] = base_args + extra
        runs[name] = metrics
        print_metrics(name, metrics)
    radix, plain, lpm = runs["radix-fcfs"], runs["no-radix-fcfs"], runs["radix-lpm"]
    ratios = {
        "radix_over_no_radix": {
            "request_throughput": ratio(radix["request_throughput"], plain["request_throughput"]),
            "total_token_throughput": ratio(radix["total_token_throughput"],
                                            plain["total_token_throughput"]),
            "mean_ttft_speedup": ratio(plain["ttft_ms"]["mean"], radix["ttft_ms"]["mean"]),
        },
        "lpm_over_fcfs": {
            "request_throughput": ratio(lpm["request_throughput"], radix["request_throughput"]),
            "total_token_throughput": ratio(lpm["total_token_throughput"],
                                            radix["total_token_throughput"]),
            "mean_ttft_speedup": ratio(radix["ttft_ms"]["mean"], lpm["ttft_ms"]["mean"]),
        },
    }
    print("\n============ ratios (one run each) ============")
    for pair, vals in ratios.items():
        print(pair + ": " + ", ".join(f"{k} {v:.2f}x" for k, v in vals.items()))
    return {"runs": runs, "ratios": ratios, "server_logs": log_dir}


# ----------------------------------------------------------------------------- CLI

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
    p.add_argument("--compare", action="store_true",
                   help="launch the server per configuration (radix/fcfs, no radix, radix/lpm) and compare")
    p.add_argument("--server-args", default="", help="extra launch_server flags for --compare")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--server-log-dir", default=None)
    args = p.parse_args(argv)
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
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.compare:
        result.update(run_compare(args))
    else:
        base_url = args.base_url or f"http://{args.host}:{args.port}"
        facts = asyncio.run(server_facts(base_url))
        workload = build_workload(args, facts["vocab_size"])
        result["metrics"] = asyncio.run(benchmark_once(args, base_url, workload))
        result["server"] = facts
        print_metrics(args.dataset, result["metrics"])
    if args.output_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.output_file}")
    return result


if __name__ == "__main__":
    main()
