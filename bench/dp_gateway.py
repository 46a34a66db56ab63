"""`radixserve serve --dp-size N` behind the real gateway (smg): prefix-cache hits per routing
policy on a multi-tenant workload, and a replica killed mid-run.

For each policy of --policies (default: cache_aware, round_robin) it launches
`python -m radixserve.launch_server --dp-size N --router-policy P` (N CPU replicas of the
default model on loopback, the gateway on one port) and sends the workload through the
gateway's port: --tenants tenants, each with its own system prompt of about --system-tokens
tokens and --questions short questions, interleaved (question 1 of every tenant in a seeded
random order, then question 2 of every tenant, ...; --order fixed keeps the tenants' order,
which with 16 tenants and 4 replicas makes round_robin send each tenant to one replica every
time), --concurrency requests in flight, non-streamed chat completions of
--max-tokens tokens at temperature 0. The hit rate is the replicas' own counters: the sum over
replicas of cached_tokens_total / prompt_tokens_total from each replica's /metrics (replicas
found through the gateway's GET /workers), before and after the run.

With --kill, one more cache_aware run kills replica --kill-replica with SIGKILL once a third of
the requests are answered: it records the requests on that replica just before the kill
(running + waiting from its /v1/loads: the ones allowed to fail), every request's status, the
5xx count, and how long the replica took to be back in service (the supervisor's "back in
service" log line, and the gateway's /workers showing it healthy).

Pass marks: cache_aware's hit rate >= 1.5 x round_robin's, every request answered 200 in the
policy runs; in the kill run, non-200 answers <= the requests in flight on the killed replica,
and the replica back within --restart-within seconds.

    PYTHONPATH=pysrc python bench/dp_gateway.py --kill --output-file bench/results/dp-gateway-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import signal
import sys
import time
from typing import Dict, List, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launcher import LaunchedServer, free_port, source_revision  # noqa: E402

WORDS = ("policy customer account order refund shipping invoice support product warranty "
         "delivery payment billing address service contract region manager request ticket "
         "priority escalation response window holiday return label carrier tracking balance "
         "credit discount subscription renewal cancel upgrade device network setting").split()
QUESTIONS = ("How do I get a refund?", "Where is my order?", "Can I change my address?",
             "What is the warranty?", "How do I cancel?", "Who is my manager?",
             "When is the holiday window?", "How do I upgrade my plan?", "Is shipping free?",
             "How do I reset my device?")


def system_prompt(tenant: int, tokens: int) -> str:
    """About `tokens` tokens (one common word is one token of SmolLM2's tokenizer, roughly):
    a tenant-specific header, then seeded random words."""
    rng = random.Random(1000 + tenant)
    words = [rng.choice(WORDS) for _ in range(max(tokens - 20, 1))]
    return (f"You are the support assistant of tenant {tenant} (company {tenant * 7919 % 10007}). "
            f"Follow these rules: " + " ".join(words))


def workload(tenants: int, questions: int, tokens: int, order: str = "shuffled",
             seed: int = 0) -> List[dict]:
    """Round q holds question q of every tenant; within a round the tenants come in a seeded
    random order ("shuffled"), or always 0..tenants-1 ("fixed": then round_robin over a replica
    count dividing the tenant count sends each tenant to one replica every time, a cache-aware
    routing by accident)."""
    systems = [system_prompt(t, tokens) for t in range(tenants)]
    rng = random.Random(seed)
    out = []
    for q in range(questions):                       # interleaved: round q of every tenant
        tenant_order = list(range(tenants))
        if order == "shuffled":
            rng.shuffle(tenant_order)
        for t in tenant_order:
            out.append({"tenant": t, "question": q, "messages": [
                {"role": "system", "content": systems[t]},
                {"role": "user", "content": f"{QUESTIONS[q % len(QUESTIONS)]} (#{q})"}]})
    return out


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def replica_counters(client: httpx.AsyncClient, urls: List[str]) -> Dict[str, dict]:
    out = {}
    for url in urls:
        text = (await client.get(url + "/metrics", timeout=30)).text
        out[url] = {"prompt_tokens": _metric(text, "radixserve:prompt_tokens_total"),
                    "cached_tokens": _metric(text, "radixserve:cached_tokens_total"),
                    "requests": _metric(text, "radixserve:num_requests_total")}
    return out


async def run_load(base: str, model: str, reqs: List[dict], concurrency: int, max_tokens: int,
                   on_progress=None) -> List[dict]:
    sem = asyncio.Semaphore(concurrency)
    results: List[Optional[dict]] = [None] * len(reqs)
    done = 0
    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(i: int, r: dict) -> None:
            nonlocal done
            async with sem:
                t0 = time.perf_counter()
                row = {"i": i, "tenant": r["tenant"], "question": r["question"],
                       "start_s": round(time.monotonic(), 3)}
                try:
                    resp = await client.post(base + "/v1/chat/completions", json={
                        "model": model, "messages": r["messages"], "max_tokens": max_tokens,
                        "temperature": 0})
                    row["status"] = resp.status_code
                    if resp.status_code == 200:
                        usage = resp.json()["usage"]
                        row["prompt_tokens"] = usage["prompt_tokens"]
                        row["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0)
                    else:
                        row["error"] = resp.text[:200]
                except httpx.HTTPError as e:
                    row["status"], row["error"] = None, f"{type(e).__name__}: {e}"[:200]
                row["latency_s"] = round(time.perf_counter() - t0, 3)
                results[i] = row
                done += 1
                if on_progress is not None:
                    await on_progress(done)
        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return results  # type: ignore[return-value]


def _server_cmd(port: int, replicas: int, policy: str, extra: List[str]) -> List[str]:
    return [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port",
            str(port), "--dp-size", str(replicas), "--router-policy", policy, *extra]


async def one_run(args, policy: str, log_path: str, kill: bool) -> dict:
    port = free_port()
    cmd = _server_cmd(port, args.replicas, policy, shlex.split(args.server_args))
    reqs = workload(args.tenants, args.questions, args.system_tokens, args.order, args.seed)
    with LaunchedServer(cmd, port, log_path, timeout=args.startup_timeout,
                        health_path="/readiness") as server:
        base = server.base_url
        async with httpx.AsyncClient(timeout=60) as client:
            model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
            workers = (await client.get(base + "/workers")).json()["workers"]
            urls = sorted(w["url"] for w in workers)
            before = await replica_counters(client, urls)
        kill_info: dict = {}
        progress = None
        if kill:
            pids = dict(re.findall(r"replica (\d+) started: pid (\d+)", open(log_path).read()))
            victim_pid = int(pids[str(args.kill_replica)])
            victim_url = next(u for u in urls if f":{_port_of(log_path, args.kill_replica)}" in u)
            threshold = len(reqs) // 3

            async def progress(done: int) -> None:
                if done != threshold or kill_info:
                    return
                kill_info["victim"] = {"replica": args.kill_replica, "pid": victim_pid,
                                       "url": victim_url}
                async with httpx.AsyncClient(timeout=10) as c:
                    snap = (await c.get(victim_url + "/v1/loads?include=core")).json()["loads"][0]
                os.kill(victim_pid, signal.SIGKILL)
                kill_info["killed_at"] = time.monotonic()
                kill_info["answered_before_kill"] = done
                kill_info["in_flight_on_victim"] = snap["num_running_reqs"] + \
                    snap["num_waiting_reqs"]
                asyncio.get_running_loop().create_task(_watch_restart(
                    base, log_path, args.kill_replica, victim_url, kill_info))
        t0 = time.perf_counter()
        rows = await run_load(base, model, reqs, args.concurrency, args.max_tokens, progress)
        wall = time.perf_counter() - t0
        if kill:
            deadline = time.monotonic() + args.restart_within
            while "gateway_healthy_after_s" not in kill_info and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=60) as client:
            workers = (await client.get(base + "/workers")).json()["workers"]
            after = await replica_counters(client, urls)
    per_replica = {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in urls}
    prompt = sum(v["prompt_tokens"] for v in per_replica.values())
    cached = sum(v["cached_tokens"] for v in per_replica.values())
    statuses: Dict[str, int] = {}
    for r in rows:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    ok = [r for r in rows if r["status"] == 200]
    out = {
        "policy": policy, "command": shlex.join(cmd), "requests": len(rows),
        "statuses": statuses, "all_answered": len(ok) == len(rows),
        "wall_s": round(wall, 2),
        "hit_rate_replica_counters": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate_client_usage": round(sum(r["cached_tokens"] for r in ok) /
                                       max(1, sum(r["prompt_tokens"] for r in ok)), 4),
        "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in ok) / max(1, len(ok)), 1),
        "per_replica": per_replica,
        "latency_s": _quantiles([r["latency_s"] for r in ok]),
        "workers_healthy_at_end": [w["is_healthy"] for w in workers],
    }
    if kill:
        failed = [r for r in rows if r["status"] != 200]
        fivexx = [r for r in rows if r["status"] is not None and r["status"] >= 500]
        kill_info.pop("killed_at", None)
        out["kill"] = {**kill_info, "non_200": len(failed), "5xx": len(fivexx),
                       "transport_errors": sum(1 for r in rows if r["status"] is None),
                       "failed_requests": failed,
                       "pass": len(failed) <= kill_info.get("in_flight_on_victim", 0)
                       and kill_info.get("back_in_service_after_s", 1e9) <= args.restart_within}
    return out


def _port_of(log_path: str, replica: int) -> str:
    m = re.search(rf"replica {replica} started: pid \d+, http://127\.0\.0\.1:(\d+)",
                  open(log_path).read())
    return m.group(1)


async def _watch_restart(base: str, log_path: str, replica: int, url: str, info: dict) -> None:
    t0 = info["killed_at"]
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() - t0 < 600:
            if "back_in_service_after_s" not in info and \
                    f"replica {replica} back in service" in open(log_path).read():
                info["back_in_service_after_s"] = round(time.monotonic() - t0, 2)
            try:
                workers = (await client.get(base + "/workers")).json()["workers"]
                w = next((w for w in workers if w["url"] == url), None)
                if "back_in_service_after_s" in info and w is not None and w["is_healthy"]:
                    info["gateway_healthy_after_s"] = round(time.monotonic() - t0, 2)
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.25)


def _quantiles(xs: List[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p90": s[int(len(s) * 0.9)], "max": s[-1]}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--order", choices=("shuffled", "fixed"), default="shuffled",
                   help="tenants' order within each round of questions (workload())")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--server-args", default="--max-total-tokens 20000 --shutdown-timeout 5",
                   help="more flags of every launched server")
    p.add_argument("--kill", action="store_true", help="also the kill run (cache_aware)")
    p.add_argument("--kill-replica", type=int, default=1)
    p.add_argument("--restart-within", type=float, default=120.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--note", default="")
    p.add_argument("--output-file")
    args = p.parse_args(argv)
    runs = []
    for policy in args.policies.split(","):
        log = os.path.join(args.log_dir, f"dp-gateway-{policy}.log")
        print(f"== {policy} (log {log})", flush=True)
        runs.append(asyncio.run(one_run(args, policy, log, kill=False)))
        print(json.dumps({k: runs[-1][k] for k in ("policy", "statuses", "wall_s",
                                                   "hit_rate_replica_counters")}), flush=True)
    by = {r["policy"]: r for r in runs}
    result: dict = {"runs": runs}
    if "cache_aware" in by and "round_robin" in by:
        rr = by["round_robin"]["hit_rate_replica_counters"]
        result["cache_aware_over_round_robin"] = round(
            by["cache_aware"]["hit_rate_replica_counters"] / rr, 3) if rr else None
    if args.kill:
        log = os.path.join(args.log_dir, "dp-gateway-kill.log")
        print(f"== kill (cache_aware, log {log})", flush=True)
        result["kill_run"] = asyncio.run(one_run(args, "cache_aware", log, kill=True))
        print(json.dumps(result["kill_run"]["kill"], default=str)[:2000], flush=True)
    ratio = result.get("cache_aware_over_round_robin")
    passed = {"hit_rate_ratio_at_least_1.5": ratio is not None and ratio >= 1.5,
              "every_request_answered": all(r["all_answered"] for r in runs)}
    if args.kill:
        passed["kill"] = bool(result["kill_run"]["kill"]["pass"])
    report = {"command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
              "source": source_revision(),
              "machine": {"cpus": os.cpu_count(), "processor": platform.machine(),
                          "python": platform.python_version(),
                          "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
              "device": f"CPU, {os.cpu_count()} cores",
              "note": args.note, "result": result, "pass": passed}
    print(json.dumps(report["pass"]), flush=True)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 0 if all(passed.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
