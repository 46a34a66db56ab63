"""/health latency while huge prompts arrive: does one client's prompt stall everyone else?

Launches `python -m radixserve.launch_server` on the CPU default model (or measures the server at
--url), then for each scenario sends --concurrency prompts of --prompt-mb MB (ASCII words, each
within the body limit and the 4 Mi-character field limit) to /v1/completions at once, while a
separate process times GET /health every --health-interval seconds:

  idle        no prompts (the baseline)
  refused     plain prompts: each can only end in a 400 for the context length
  truncated   the same prompts with truncate_prompt_tokens: each is tokenized whole, cut to
              its last 32 tokens and generates 1 token
  chat        the prompt as one chat message (rendered by the chat template, then refused)

Per scenario: /health p50 / p99 / max (seconds, the mark: max < 0.1), the number of /health
answers, and each big request's status and latency. Printed, and with --output-file written as
JSON with the command and the source revision.

    PYTHONPATH=pysrc python bench/health_under_load.py --output-file bench/results/health-under-load-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import shlex
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import LaunchedServer, free_port, radixserve_command, source_revision  # noqa: E402

WORDS = ("alpha beta gamma delta river stone cloud paper garden window music light number table "
         "summer winter story engine").split()
SCENARIOS = ("idle", "refused", "truncated", "chat")
HEALTH_MARK_S = 0.1


def prompt_text(mb: float, seed: int) -> str:
    """About mb x 10^6 characters of random words (at most 4 Mi, the field limit)."""
    rng = random.Random(seed)
    chars = min(int(mb * 1_000_000), (1 << 22) - 16)
    words, size = [], 0
    while size < chars:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:chars]


def body_of(scenario: str, text: str) -> bytes:
    if scenario == "chat":
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    else:
        body = {"prompt": text, "max_tokens": 1, "temperature": 0}
        if scenario == "truncated":
            body["truncate_prompt_tokens"] = 32
    return json.dumps(body).encode()


def poll_health(url: str, interval: float, stop, out) -> None:
    """In its own process (no GIL shared with the senders): GET /health every `interval`
    seconds until `stop` is set; puts the list of latencies (seconds) on `out`."""
    latencies = []
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = client.get(url + "/health")
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.status_code
            time.sleep(interval)
    out.put(latencies)


def summary(latencies) -> dict:
    s = sorted(latencies)
    return {"n": len(s), "p50_s": round(statistics.median(s), 4),
            "p99_s": round(s[min(len(s) - 1, int(0.99 * len(s)))], 4), "max_s": round(s[-1], 4)}


async def send_all(url: str, bodies, route: str) -> list:
    async def one(body: bytes) -> dict:
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.post(url + route, content=body,
                                  headers={"content-type": "application/json"})
        out = {"status": r.status_code, "latency_s": round(time.perf_counter() - t0, 3)}
        if r.status_code != 200:
            out["message"] = r.json()["error"]["message"][:160]
        return out
    return await asyncio.gather(*(one(b) for b in bodies))


def run_scenario(url: str, scenario: str, args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=poll_health, args=(url, args.health_interval, stop, out))
    bodies = [] if scenario == "idle" else [
        body_of(scenario, prompt_text(args.prompt_mb, args.seed + i)) for i in range(args.concurrency)]
    poller.start()
    time.sleep(1.0)                      # the poller's first answers come before the load
    t0 = time.perf_counter()
    if scenario == "idle":
        time.sleep(args.idle_s)
        requests = []
    else:
        route = "/v1/chat/completions" if scenario == "chat" else "/v1/completions"
        requests = asyncio.run(send_all(url, bodies, route))
    wall = time.perf_counter() - t0
    time.sleep(0.5)
    stop.set()
    latencies = out.get(timeout=300)
    poller.join(60)
    result = {"health": summary(latencies), "load_wall_s": round(wall, 3), "requests": requests,
              "body_bytes": [len(b) for b in bodies[:1]],
              "machine_load_avg_1m": round(os.getloadavg()[0], 2)}   # other work on the host
    print(f"{scenario:10s} health p50 {result['health']['p50_s'] * 1000:.1f} ms, max "
          f"{result['health']['max_s'] * 1000:.1f} ms over {result['health']['n']} answers; "
          f"load {wall:.1f} s; statuses {sorted({r['status'] for r in requests})}", flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="measure this running server (else launch one)")
    p.add_argument("--concurrency", type=int, default=8, help="big prompts sent at once")
    p.add_argument("--prompt-mb", type=float, default=4.0, help="size of each prompt (MB)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--health-interval", type=float, default=0.01)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra launch_server flags")
    p.add_argument("--server-log", default=None)
    p.add_argument("--output-file", default=None)
    p.add_argument("--note", default=None, help="recorded with the result (how it was run)")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    assert all(s in SCENARIOS for s in scenarios), scenarios
    results = {}
    if args.url:
        for s in scenarios:
            results[s] = run_scenario(args.url.rstrip("/"), s, args)
        log_path = None
    else:
        port = free_port()
        log_path = args.server_log or os.path.join("/tmp", f"radixserve-health-{port}.log")
        with LaunchedServer(radixserve_command(port, args.server_args.split()), port, log_path,
                            timeout=900) as server:
            for s in scenarios:
                results[s] = run_scenario(server.base_url, s, args)
    loaded = [results[s]["health"]["max_s"] for s in scenarios if s != "idle"]
    ok = all(m < HEALTH_MARK_S for m in loaded)
    print("PASS" if ok else "FAIL", f"(the mark: /health max < {HEALTH_MARK_S * 1000:.0f} ms under load)")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump({"command": "python " + shlex.join([sys.argv[0]] + (argv or sys.argv[1:])),
                       "source": source_revision(), "machine": {
                           "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                           "python": platform.python_version()},
                       "server_log": log_path, "note": args.note, "result": results, "pass": ok},
                      f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
