"""What the cache dashboard costs the event loop: the loop thread's CPU seconds per generated
token (`radixserve:loop_thread_cpu_seconds_total` / `generation_tokens_total`, the server's own
counters) under a serving load, with the dashboard page open (its polls: /dashboard/data every
5 s, /dashboard/advice every 60 s of being open, with the page's parameters, as
static/dashboard.html does; --browser: a real headless Chromium showing the page instead)
against closed, in the SAME run: one server started with --enable-dashboard, short phases
alternating closed / open (ABAB..., so that what else the machine does falls on both; the
emulated page keeps its state across its open phases, like one tab shown and hidden).
The bar: open adds < 2% loop CPU per token.

    PYTHONPATH=pysrc python bench/dashboard_overhead.py [--phases 40 --phase-s 10]
        [--concurrency 8 --max-tokens 64] [--no-advice] [--browser] [--out result.json]

The load: streamed chat requests over a few system prompts that carry a varying user name
(so the radix tree has families and branches and the advisor has something to find), each
with its own question. Per phase: loop CPU and tokens from /metrics at its start and end.
The A/B figure is the loop CPU per token of all open phases over that of all closed phases,
minus 1 (and the median of the closed/open pairs); each phase's numbers are in the JSON.
On a busy machine that A/B figure carries the phases' noise (a few percent from phase to
phase), so the script also gives the direct figure: the loop CPU of the dashboard's own code
in the open phases (`radixserve:dashboard_cpu_seconds_total{part="polls"}`) plus each of
their requests times the HTTP server's cost of a plain request (measured at the end, idle),
per generated token, over the closed phases' loop CPU per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time

import aiohttp
import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from launcher import LaunchedServer, free_port, radixserve_command, source_revision  # noqa: E402

SYSTEMS = [
    "You are the support assistant of a bicycle shop. The customer's name is {}. Be brief, "
    "friendly and concrete; recommend at most one product.",
    "You are a travel planner. You are helping {} plan a weekend trip. Suggest one city, one "
    "museum and one restaurant, in three short sentences.",
    "You are a math tutor for {}. Explain each step, check the arithmetic twice and end with a "
    "one-line summary of the answer.",
]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
DATA_EVERY_S, ADVICE_EVERY_S = 5.0, 60.0


def counters(url: str, headers: dict) -> dict:
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out = {}
    for name in ("loop_thread_cpu_seconds_total", "generation_tokens_total",
                 "prompt_tokens_total", "cached_tokens_total"):
        m = re.search(rf"^radixserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    for part in ("sampler", "polls", "advisor"):
        m = re.search(rf'^radixserve:dashboard_cpu_seconds_total\{{[^}}]*part="{part}"\}} (\S+)$',
                      text, re.M)
        out["dashboard_" + part] = float(m.group(1)) if m else float("nan")
    return out


async def client_loop(url: str, headers: dict, k: int, stop: asyncio.Event, max_tokens: int,
                      stats: dict) -> None:
    i = k
    async with aiohttp.ClientSession(headers=headers) as session:
        while not stop.is_set():
            system = SYSTEMS[i % len(SYSTEMS)].format(NAMES[(i // len(SYSTEMS)) % len(NAMES)])
            body = {"max_tokens": max_tokens, "stream": True, "temperature": 0.7, "seed": i,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"Request {i}: what should I do "
                                                             f"first, and why?"}]}
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    stats["errors"] += 1
                async for _ in r.content:
                    pass
            stats["requests"] += 1
            i += 1000


class PagePoller:
    """The page's requests, at its cadence and with its parameters (static/dashboard.html:
    /dashboard/data every DATA_EVERY_S with ?since= the last row it has and ?tree_since= the
    tree summary it has; /dashboard/advice every ADVICE_EVERY_S), while `open`: one page that
    is shown during the open phases and hidden during the closed ones (its state and its
    advice schedule, in seconds of being open, carry over)."""

    def __init__(self, url: str, headers: dict, metrics_only: bool = False):
        self.url, self.headers, self.metrics_only = url, headers, metrics_only
        self.opened = asyncio.Event()
        self.busy = asyncio.Lock()            # held while a poll is in flight
        self.stats = {"data_polls": 0, "advice_polls": 0}
        self._open_total, self._open_since = 0.0, None

    def open_seconds(self) -> float:
        extra = time.monotonic() - self._open_since if self._open_since is not None else 0.0
        return self._open_total + extra

    def open(self) -> None:
        self._open_since = time.monotonic()
        self.opened.set()

    async def close(self) -> None:
        """Hide the page; returns once no poll is in flight."""
        self.opened.clear()
        if self._open_since is not None:
            self._open_total += time.monotonic() - self._open_since
            self._open_since = None
        async with self.busy:
            pass

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession(headers=self.headers) as session:
            next_advice = 0.0
            last_row, tree_at = None, None
            while not stop.is_set():
                if not self.opened.is_set():
                    waiters = [asyncio.ensure_future(e.wait()) for e in (self.opened, stop)]
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    for w in waiters:
                        w.cancel()
                    continue
                async with self.busy:
                    if self.metrics_only:          # the control: a Prometheus scraper
                        async with session.get(self.url + "/metrics") as r:
                            await r.read()
                            self.stats["data_polls"] += r.status == 200
                        await asyncio.sleep(0)
                        try:
                            await asyncio.wait_for(stop.wait(), DATA_EVERY_S)
                        except asyncio.TimeoutError:
                            pass
                        continue
                    params = {}
                    if last_row is not None:
                        params["since"] = repr(last_row)
                    if tree_at is not None:
                        params["tree_since"] = repr(tree_at)
                    async with session.get(self.url + "/dashboard/data", params=params) as r:
                        body = json.loads(await r.read())
                        self.stats["data_polls"] += r.status == 200
                    if body["series"]["rows"]:
                        last_row = body["series"]["rows"][-1][0]
                    if body.get("tree"):
                        tree_at = body["tree"]["computed_at"]
                    if ADVICE_EVERY_S is not None and self.open_seconds() >= next_advice:
                        async with session.get(self.url + "/dashboard/advice") as r:
                            await r.read()
                            self.stats["advice_polls"] += r.status == 200
                        next_advice = self.open_seconds() + ADVICE_EVERY_S
                try:
                    await asyncio.wait_for(stop.wait(), DATA_EVERY_S)
                except asyncio.TimeoutError:
                    pass


async def http_cost(url: str, headers: dict, n: int = 300) -> float:
    """Loop CPU microseconds the server spends on one plain request (/health) beyond what it
    spends anyway, measured with no load: the HTTP server's and the door's share of a poll."""
    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.sleep(1.0)
        a, t0 = counters(url, headers)["loop_thread_cpu_seconds_total"], time.monotonic()
        await asyncio.sleep(3.0)
        b, t1 = counters(url, headers)["loop_thread_cpu_seconds_total"], time.monotonic()
        idle = (b - a) / (t1 - t0)
        t0 = time.monotonic()
        for _ in range(n):
            async with session.get(url + "/health") as r:
                await r.read()
        c, t1 = counters(url, headers)["loop_thread_cpu_seconds_total"], time.monotonic()
    return 1e6 * max(c - b - idle * (t1 - t0), 0.0) / n


async def browser_page(url: str, headers: dict, stop: asyncio.Event, stats: dict) -> None:
    from headless_chromium import Chromium
    async with Chromium() as browser:
        page = await browser.page()
        await page.set_headers(headers)
        await page.navigate(url + "/dashboard")
        await stop.wait()
        stats["data_polls"] += await page.evaluate(
            "performance.getEntriesByType('resource').filter(e => e.name.includes('/data'))"
            ".length")


async def run(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"}
    port = free_port()
    cmd = radixserve_command(port, ["--enable-dashboard", "--api-key", args.api_key,
                                    *args.server_args])
    log = args.log or os.path.join(HERE, "results", "logs", "dashboard-overhead-server.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    phases = []
    with LaunchedServer(cmd, port, log, timeout=900) as server:
        url = server.base_url
        stop_load = asyncio.Event()
        load = {"requests": 0, "errors": 0}
        clients = [asyncio.ensure_future(client_loop(url, headers, k, stop_load, args.max_tokens,
                                                     load)) for k in range(args.concurrency)]
        await asyncio.sleep(args.warmup_s)
        poller = PagePoller(url, headers, metrics_only=args.control_metrics)
        stop_page = asyncio.Event()
        polling = None if args.browser else asyncio.ensure_future(poller.run(stop_page))
        for n in range(args.phases):
            open_ = n % 2 == 1
            counted = dict(poller.stats)
            browser, browser_stop = None, asyncio.Event()
            if open_ and args.browser:
                browser = asyncio.ensure_future(browser_page(url, headers, browser_stop,
                                                             poller.stats))
            elif open_:
                poller.open()
            before, t0 = counters(url, headers), time.monotonic()
            await asyncio.sleep(args.phase_s)
            if open_ and not args.browser:
                await poller.close()
            after, t1 = counters(url, headers), time.monotonic()
            if browser is not None:
                browser_stop.set()
                await browser
            polls = {k: poller.stats[k] - counted[k] for k in counted}
            tokens = after["generation_tokens_total"] - before["generation_tokens_total"]
            cpu = after["loop_thread_cpu_seconds_total"] - before["loop_thread_cpu_seconds_total"]
            own = {part: round(after["dashboard_" + part] - before["dashboard_" + part], 5)
                   for part in ("sampler", "polls", "advisor")}
            phases.append({"page": "open" if open_ else "closed", "seconds": round(t1 - t0, 2),
                           "tokens": tokens, "loop_cpu_s": round(cpu, 4),
                           "loop_cpu_us_per_token": round(1e6 * cpu / max(tokens, 1), 3),
                           "dashboard_cpu_s": own,
                           "tokens_per_s": round(tokens / (t1 - t0), 1), **polls})
            print(json.dumps(phases[-1]), flush=True)
        stop_page.set()
        if polling is not None:
            await polling
        stop_load.set()
        await asyncio.gather(*clients)
        tree = httpx.get(url + "/dashboard/data", headers=headers, timeout=60).json()["tree"]
        http_us = await http_cost(url, headers)
    def us_per_token(kind: str) -> float:
        """Loop CPU per token over all phases of a kind (sums: a phase in which the machine
        stalled the server weighs by its tokens, not as an outlier ratio)."""
        picked = [p for p in phases if p["page"] == kind]
        return 1e6 * sum(p["loop_cpu_s"] for p in picked) / max(sum(p["tokens"] for p in picked), 1)
    closed, opened = us_per_token("closed"), us_per_token("open")
    added = opened / closed - 1
    pairs = [round(o["loop_cpu_us_per_token"] / c["loop_cpu_us_per_token"] - 1, 4)
             for c, o in zip(phases[::2], phases[1::2])]
    # the direct figure: the loop CPU of the dashboard's own code in the open phases (its
    # counters) plus the HTTP server's share of each of their requests (http_us, measured
    # idle), per token, over the closed phases' loop CPU per token
    open_phases = [p for p in phases if p["page"] == "open"]
    own_s = sum(p["dashboard_cpu_s"]["polls"] for p in open_phases)
    requests = sum(p["data_polls"] + p["advice_polls"] for p in open_phases)
    open_tokens = sum(p["tokens"] for p in open_phases)
    direct = (own_s + requests * http_us / 1e6) / open_tokens / (closed / 1e6)
    return {"bench": "dashboard_overhead", "source": source_revision(), "argv": sys.argv[1:],
            "load": load, "phases": phases,
            "tree_at_end": {k: tree.get(k) for k in ("nodes", "tokens", "compute_s", "loop_turns")}
            if tree else None,
            "closed_us_per_token": round(closed, 3),
            "open_us_per_token": round(opened, 3),
            "added_fraction": round(added, 4),
            "ab_phase_pairs": pairs, "ab_median_pair": round(statistics.median(pairs), 4),
            "http_us_per_request": round(http_us, 1),
            "direct_polls_cpu_s": round(own_s, 4), "direct_requests": requests,
            "direct_added_fraction": round(direct, 4),
            "bar": 0.02, "pass": added < 0.02}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", type=int, default=40,
                   help="alternating closed/open phases (even)")
    p.add_argument("--phase-s", type=float, default=10.0, help="seconds per phase")
    p.add_argument("--warmup-s", type=float, default=10.0, help="load before the first phase")
    p.add_argument("--concurrency", type=int, default=8, help="streaming clients")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--no-advice", action="store_true",
                   help="the page's data polls only (no /dashboard/advice): to tell the parts apart")
    p.add_argument("--control-metrics", action="store_true",
                   help="the control: the open phases scrape /metrics at the page's cadence "
                   "instead of polling the dashboard (what its cost is to be compared with)")
    p.add_argument("--browser", action="store_true",
                   help="open the page in headless Chromium instead of emulating its polls")
    p.add_argument("--api-key", default="dashboard-bench")
    p.add_argument("--log", default=None, help="the server's log file")
    p.add_argument("--out", default=None, help="write the result JSON here")
    p.add_argument("server_args", nargs="*", help="more `radixserve serve` flags (after --)")
    args = p.parse_args(argv)
    if args.phases < 2 or args.phases % 2:
        p.error("--phases must be even and >= 2")
    if args.no_advice:
        global ADVICE_EVERY_S
        ADVICE_EVERY_S = None
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    print(f"loop CPU per generated token: closed {result['closed_us_per_token']} us, open "
          f"{result['open_us_per_token']} us: {100 * result['added_fraction']:+.2f}% "
          f"({'pass' if result['pass'] else 'FAIL'}: the bar is < 2%); median of "
          f"{len(result['ab_phase_pairs'])} closed/open pairs {100 * result['ab_median_pair']:+.2f}%")
    print(f"direct: the dashboard's own loop CPU in the open phases ({result['direct_polls_cpu_s']} "
          f"s) + {result['direct_requests']} requests x {result['http_us_per_request']} us of "
          f"HTTP = {100 * result['direct_added_fraction']:+.2f}% of the closed loop CPU per token")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
