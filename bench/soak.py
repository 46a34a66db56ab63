"""Soak: many random requests against one server, with clients hanging up, under memory pressure.

Launches `python -m radixserve.launch_server` (CPU default model unless --server-args say
otherwise) with --debug-integrity and a KV pool of --pool-fraction of the workload's demand (the
concurrency x the mean tokens one request of the stream asks for),
then:
  1. runs a fixed set of greedy prompts (the reference outputs);
  2. sends --num-requests random requests over /generate, /v1/completions and
     /v1/chat/completions, streamed and not, --concurrency at a time; --disconnect-fraction of
     the clients hang up at a random point (before the answer, or mid-stream);
  3. runs the greedy prompts again, waits for the server to be idle and reads /metrics.
Meanwhile a poller times /health every --health-interval seconds and samples the server's
resident memory (VmRSS).

Pass/fail figures (printed, and written to --output-file with the command):
  outputs_identical    the greedy set's outputs before == after (nothing lost or corrupted)
  leaked_tokens        KV tokens in use at idle (num_used_tokens: neither free nor evictable) = 0
  health_max_s         slowest /health answer (the mark: < 1 s)
  rss_growth_last_half resident memory, last sample / first sample of the second half - 1
                       (the mark: within 10%)
  server_errors        5xx answers (the mark: 0); other failures are counted separately

    PYTHONPATH=pysrc python bench/soak.py --num-requests 10000 --output-file bench/results/soak-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import LaunchedServer, free_port, radixserve_command  # noqa: E402

GREEDY_PROMPTS = ["The capital of France is", "def add(a, b):", "Water boils at",
                  "List three colors:", "Once upon a time"]
WORDS = ("alpha beta gamma delta river stone cloud paper garden window music light "
         "number table summer winter story engine").split()


def random_text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def random_request(rng: random.Random, max_words: int = 60):
    """(route, body, stream) of one random request."""
    stream = rng.random() < 0.5
    max_tokens = rng.randint(1, 24)
    text = random_text(rng, rng.randint(2, max_words))
    route = rng.choice(["/generate", "/v1/completions", "/v1/chat/completions"])
    sampling = {"temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9])}
    if route == "/generate":
        body = {"text": text, "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, **sampling}}
    elif route == "/v1/completions":
        body = {"prompt": text, "max_tokens": max_tokens, "stream": stream,
                "n": rng.choice([1, 1, 2]), **sampling}
    else:
        body = {"messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "stream": stream, **sampling}
    return route, body, stream


async def greedy_set(client: httpx.AsyncClient):
    outs = []
    for p in GREEDY_PROMPTS:
        r = await client.post("/generate", json={"text": p, "sampling_params":
                                                 {"max_new_tokens": 16, "temperature": 0}})
        r.raise_for_status()
        outs.append(r.json()["output_ids"] if "output_ids" in r.json() else r.json()["text"])
    return outs


async def one_request(client, rng, stats, disconnect_fraction, max_words=60):
    route, body, stream = random_request(rng, max_words)
    hang_up = rng.random() < disconnect_fraction
    try:
        if stream:
            async with client.stream("POST", route, json=body) as r:
                if r.status_code >= 500:
                    stats["server_errors"] += 1
                cut = rng.randint(0, 6) if hang_up else None
                n = 0
                async for _ in r.aiter_lines():
                    n += 1
                    if cut is not None and n >= cut:
                        stats["disconnects"] += 1
                        return                         # leaving the block closes the stream
        else:
            if hang_up:
                try:
                    await client.post(route, json=body, timeout=rng.uniform(0.01, 0.5))
                except httpx.TimeoutException:
                    stats["disconnects"] += 1
                    return
            r = await client.post(route, json=body)
            if r.status_code >= 500:
                stats["server_errors"] += 1
            elif r.status_code >= 400:
                stats["client_errors"] += 1
                stats.setdefault("client_error_examples", []).append(r.text[:200])
        stats["completed"] += 1
    except httpx.HTTPError as e:
        stats["transport_errors"] += 1
        stats.setdefault("examples", []).append(f"{type(e).__name__}: {e}"[:200])


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


async def poll(url: str, pid: int, interval: float, samples: dict, stop: asyncio.Event):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                await client.get("/health")
                samples["health_s"].append(time.perf_counter() - t)
            except httpx.HTTPError:
                samples["health_s"].append(float("inf"))
            samples["rss_kb"].append(rss_kb(pid))
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass


async def wait_idle(client, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = (await client.get("/metrics")).text
        running = re.search(r'num_running_reqs\{[^}]*\} (\S+)', m)
        waiting = re.search(r'num_waiting_reqs\{[^}]*\} (\S+)', m)
        if running and waiting and float(running.group(1)) == 0 and float(waiting.group(1)) == 0:
            return m
        await asyncio.sleep(0.2)
    raise RuntimeError("the server did not become idle")


def metric(text: str, name: str) -> float:
    m = re.search(rf'{name}\{{[^}}]*\}} (\S+)', text)
    return float(m.group(1)) if m else float("nan")


async def soak(args, url: str, pid: int):
    rng = random.Random(args.seed)
    samples = {"health_s": [], "rss_kb": []}
    stop = asyncio.Event()
    poller = asyncio.create_task(poll(url, pid, args.health_interval, samples, stop))
    stats = {"completed": 0, "disconnects": 0, "server_errors": 0, "client_errors": 0,
             "transport_errors": 0}
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        before = await greedy_set(client)
        sem = asyncio.Semaphore(args.concurrency)

        async def guarded(i):
            async with sem:
                await one_request(client, random.Random(args.seed * 1_000_003 + i), stats,
                                  args.disconnect_fraction, args.max_prompt_words)
        t0 = time.perf_counter()
        await asyncio.gather(*(guarded(i) for i in range(args.num_requests)))
        duration = time.perf_counter() - t0
        await wait_idle(client)
        after = await greedy_set(client)
        idle_metrics = await wait_idle(client)
    stop.set()
    await poller
    rss = samples["rss_kb"]
    half = rss[len(rss) // 2:] or rss
    return {
        "num_requests": args.num_requests, "duration_s": round(duration, 1), **stats,
        "outputs_identical": before == after,
        "leaked_tokens": metric(idle_metrics, "num_used_tokens"),
        "health_max_s": round(max(samples["health_s"]), 4) if samples["health_s"] else None,
        "health_samples": len(samples["health_s"]),
        "rss_first_half_start_mb": round(rss[0] / 1024, 1) if rss else None,
        "rss_growth_last_half": round(half[-1] / half[0] - 1, 4) if half else None,
        "retractions": metric(idle_metrics, "num_retractions_total"),
        "aborted": metric(idle_metrics, "num_aborted_requests_total"),
    }


def request_demand(args, sample: int = 2000) -> dict:
    """Mean and max KV tokens one request of the stream asks for: (prompt + max_tokens) x n,
    the prompt tokenized (chat template included) by the served model's tokenizer."""
    from radixserve.model.loader import resolve_model_path
    from radixserve.tokenizer.tokenizer import Tokenizer
    flags = args.server_args.split()
    model = flags[flags.index("--model-path") + 1] if "--model-path" in flags else None
    tok = Tokenizer.from_path(resolve_model_path(model))
    sizes = []
    for i in range(min(sample, args.num_requests)):
        _, body, _ = random_request(random.Random(args.seed * 1_000_003 + i),
                                    args.max_prompt_words)
        if "messages" in body:
            prompt = len(tok.encode_chat(body["messages"]))
        else:
            prompt = len(tok.encode(body.get("text") or body.get("prompt")))
        new = body.get("max_tokens") or body["sampling_params"]["max_new_tokens"]
        sizes.append((prompt + new) * body.get("n", 1))
    return {"mean": round(sum(sizes) / len(sizes), 1), "max": max(sizes)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--disconnect-fraction", type=float, default=0.2)
    p.add_argument("--pool-tokens", type=int, default=None,
                   help="KV pool size (default: --pool-fraction of the demand)")
    p.add_argument("--pool-fraction", type=float, default=0.1,
                   help="pool / demand, where demand = concurrency x the mean tokens (prompt + "
                        "max_tokens, times n) of the request stream, tokenized")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt-words", type=int, default=60,
                   help="random prompts have 2..this many words")
    p.add_argument("--server-args", default="", help="extra launch_server flags")
    p.add_argument("--server-log", default=None)
    p.add_argument("--output-file", default=None)
    args = p.parse_args(argv)
    demand = request_demand(args)
    pool = args.pool_tokens or max(2 * demand["max"], int(args.pool_fraction * args.concurrency
                                                          * demand["mean"]))
    extra = ["--max-total-tokens", str(pool), "--debug-integrity"] + args.server_args.split()
    port = free_port()
    log_path = args.server_log or os.path.join("/tmp", f"radixserve-soak-{port}.log")
    with LaunchedServer(radixserve_command(port, extra), port, log_path, timeout=900) as server:
        result = asyncio.run(soak(args, server.base_url, server.proc.pid))
    result["pool_tokens"] = pool
    result["demand_tokens_per_request"] = demand
    result["pool_fraction_of_demand"] = round(pool / (args.concurrency * demand["mean"]), 3)
    result["server_log"] = log_path
    print(json.dumps(result, indent=1))
    ok = (result["outputs_identical"] and result["leaked_tokens"] == 0
          and result["server_errors"] == 0 and (result["health_max_s"] or 0) < 1.0
          and abs(result["rss_growth_last_half"] or 0) <= 0.10)
    print("PASS" if ok else "FAIL")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"command": "python " + " ".join([sys.argv[0]] + (argv or sys.argv[1:])),
                       "result": result, "pass": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
