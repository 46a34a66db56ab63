"""The cache dashboard (--enable-dashboard): a page of the prefix cache served by the server
itself, the JSON it draws from, and the prefix-cache advisor's report.

Routes (registered by app.create_app only with the flag; without it they are 404s), behind the
door like every API route (server/security.py: Host, Origin, the API key); with an admin key
(--admin-api-key) they take only that key, as /metrics does: the page shows every client's
traffic and, unless --no-dashboard-show-text, their prompts' text.
  GET /dashboard          static/dashboard.html: plain HTML, CSS, JS and SVG, no build step, no
                          request but to the two routes below (its Content-Security-Policy
                          allows nothing else: inline code by hash, connections to itself)
  GET /dashboard/data     the time series (a row per sampling interval), totals and the radix
                          tree's summary (?since=T: only the rows after T, a time of the
                          server's clock, which is how the page polls: the rows it lacks;
                          ?window=S: only the last S seconds; ?tree_since=T: no tree summary
                          when the current one is the one computed at T, which the caller has)
  GET /dashboard/advice   cache/advisor.advise over the recent prompts (?last=N: only the
                          last N of them; ?min_members=, ?min_tail=: the advisor's thresholds)
Any other query parameter, or a bad value, is a 400 naming it.

What it costs the loop (bench/dashboard_overhead.py measures it under load):
  * a sampler task reads engine.metrics() (what a /metrics scrape reads) and the tree's two
    logical clocks once every SAMPLE_INTERVAL_S into a ring of HISTORY_SAMPLES samples
    (ten minutes), and the row of rates of that interval into a ring of rows; a poll returns
    the rows it asks for (the page asks for the ones it lacks: O(1) a poll);
  * the scheduler appends (ids by reference, salt offset, cached tokens) of every request's
    first admission to a deque of RECENT_PROMPTS (SchedulerStats.prompt_admitted: O(1));
  * the tree's summary (cache/tree_stats.py) is computed at most once per TREE_TTL_S, only when
    /dashboard/data is asked for (and sent only to a poller that lacks it: ?tree_since=), by
    a walk of TREE_STEP_NODES nodes per loop turn up to TREE_MAX_NODES (beyond: the summary
    says `partial`), plus one read-only walk per recent prompt not seen by an earlier
    summary, to attribute hits; concurrent polls share one computation;
  * the advice is computed at most once per ADVICE_TTL_S per set of parameters, on a worker
    thread (asyncio.to_thread) over a snapshot of the recent prompts; then one read-only walk
    per distinct member prompt of its suggestions, on the loop, measures the KV they hold.
The page polls /dashboard/data every 5 s and /dashboard/advice every 60 s. The dashboard's
own CPU seconds are on /metrics as <prefix>dashboard_cpu_seconds_total{part="sampler"|"polls"|
"advisor"} (CpuCollector).
Nothing here changes what the server computes: the tree is only read (no access time touched,
no split, no lock), and requests are only observed.
"""
from __future__ import annotations

import asyncio
import base64
import bisect
import collections
import contextlib
import hashlib
import importlib.resources
import itertools
import logging
import re
import threading
import time
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Tuple

from prometheus_client.core import CounterMetricFamily
from starlette.requests import Request
from starlette.responses import Response

from radixserve.cache import advisor, tree_stats
from radixserve.errors import ApiError, bad_request
from radixserve.server import metrics
from radixserve.server.jsonio import JSONResponse
from radixserve.server.security import ADMIN_IDENTITY

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
HISTORY_SAMPLES = 600            # ten minutes at one sample a second
RECENT_PROMPTS = 256             # the advisor's sample (token ids kept by reference)
TREE_TTL_S = 60.0                # a tree summary is reused this long (bench/dashboard_overhead.py)
TREE_MAX_NODES = 200_000         # a walk stops here (the summary is `partial` then)
TREE_STEP_NODES = 2_000          # nodes visited per loop turn
TOP_K = 12                       # subtrees listed by tokens and by hits
ADVICE_TTL_S = 30.0              # an advice is reused this long (per parameters)
TEXT_DECODE = dict(skip_special_tokens=False)
# a row of the series per sampling interval (Dashboard.add)
COLUMNS = ("t", "hit_rate", "prompt_tps", "computed_tps", "gen_tps", "running", "queued",
           "kv_request", "kv_cache_locked", "kv_evictable", "kv_free", "prefill_share",
           "decode_share", "idle_share", "loop_cpu_share")

_NO_STORE = {"Cache-Control": "no-store"}


class Sample(NamedTuple):
    """One reading of the engine (counters are totals since start; the rest gauges)."""
    t: float                     # wall time (time.time())
    prompt: int                  # prompt tokens admitted
    cached: int                  # of which the prefix cache served
    generated: int
    extend_s: float              # device seconds of prefill (extend) steps
    decode_s: float              # device seconds of decode steps
    loop_cpu_s: float            # CPU seconds of the event-loop thread
    running: int
    queued: int
    used: int                    # KV slots held by requests (own) and by locked cache nodes
    locked: int                  # of which cache nodes that a lock protects
    evictable: int               # KV slots held only by the cache
    total: int                   # KV slots in the pool
    tick: int                    # the tree's access clock
    node_ids: int                # node ids the tree handed out


# --------------------------------------------------------------------------- the page

def _load_page() -> Tuple[bytes, str]:
    """The page's bytes and its Content-Security-Policy: its one inline <script> and <style>
    allowed by their SHA-256, connections to its own origin only, nothing else."""
    page = importlib.resources.files("radixserve.server").joinpath(
        "static", "dashboard.html").read_bytes()
    text = page.decode("utf-8")

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
        return " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(b.encode("utf-8"))
                                                         .digest()).decode("ascii")
                        for b in bodies)

    csp = (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
           "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
           "frame-ancestors 'none'")
    return page, csp


# --------------------------------------------------------------------------- the state

class Dashboard:
    """The dashboard of one app: the sample ring, the recent prompts (installed into the
    engine's SchedulerStats), the cached tree summary and advice. Loop thread."""

    def __init__(self, engine: Any, show_text: bool):
        self.engine = engine
        self.show_text = show_text
        self.samples: Deque[Sample] = collections.deque(maxlen=HISTORY_SAMPLES)
        self.rows: Deque[tuple] = collections.deque(maxlen=HISTORY_SAMPLES)   # COLUMNS each
        self.prompts: Deque[Any] = collections.deque(maxlen=RECENT_PROMPTS)
        scheduler = getattr(engine, "scheduler", None)
        stats = getattr(scheduler, "stats", None)
        if stats is not None:
            stats.recent_prompts = self.prompts
        self._task: Optional[asyncio.Task] = None
        self._tree: Optional[Dict[str, Any]] = None
        self._tree_at = float("-inf")
        self._tree_job: Optional[asyncio.Future] = None
        self._paths: Dict[int, Tuple[Any, List[Tuple[int, int]]]] = {}   # _hit_paths' memo
        # CPU seconds of the dashboard's own code: "sampler" and "polls" on the loop thread
        # (the polls' synchronous parts: parsing, the tree summary, rendering; not the HTTP
        # server's share of a request), "advisor" on the worker threads
        self.cpu: Dict[str, float] = {"sampler": 0.0, "polls": 0.0, "advisor": 0.0}
        self._cpu_lock = threading.Lock()          # advisor runs may end on two threads at once
        self._advice: Dict[Any, Tuple[float, Dict[str, Any]]] = {}
        self._advice_jobs: Dict[Any, asyncio.Future] = {}
        self.page, self.csp = _load_page()

    @contextlib.contextmanager
    def account(self, kind: str):
        """Add the calling thread's CPU time inside the block to cpu[kind]."""
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._cpu_lock:
                self.cpu[kind] += spent

    # the engine's parts (None for an engine without them)
    @property
    def cache(self) -> Any:
        return getattr(getattr(self.engine, "scheduler", None), "cache", None)

    def _decode(self, ids: List[int]) -> str:
        return self.engine.tokenizer.decode(ids, **TEXT_DECODE)

    # ------------------------------------------------------------------ the sampler
    def start(self) -> None:
        """Start sampling (in the running loop); a second call does nothing."""
        if self._task is None:
            with self.account("sampler"):
                self.sample()
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="radixserve-dashboard")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            try:
                with self.account("sampler"):
                    self.sample()
            except Exception:       # noqa: BLE001 - a reading never stops the sampler
                logger.exception("dashboard: reading the engine failed")

    def sample(self) -> None:
        """Append one reading of the engine to the ring, and the row of the interval since
        the previous one (O(1))."""
        m = self.engine.metrics()
        cache = self.cache
        locked = cache.protected_size() if hasattr(cache, "protected_size") else 0
        tick, node_ids = tree_stats.clock(cache)

        def num(key: str) -> float:
            v = m.get(key, 0)
            return v if isinstance(v, (int, float)) else 0

        self.add(Sample(
            t=time.time(), prompt=int(num("prompt_tokens")), cached=int(num("cached_tokens")),
            generated=int(num("generation_tokens")), extend_s=float(num("extend_device_seconds")),
            decode_s=float(num("decode_device_seconds")),
            loop_cpu_s=float(num("loop_thread_cpu_seconds")),
            running=int(num("num_running_reqs")), queued=int(num("num_waiting_reqs")),
            used=int(num("num_used_tokens")), locked=int(locked),
            evictable=int(num("evictable_tokens")), total=int(num("max_total_tokens")),
            tick=tick, node_ids=node_ids))

    def add(self, b: Sample) -> None:
        """b joins the ring; with a previous sample a, the row of the interval (a, b]: its end
        time, the hit rate (None without prompt tokens), throughputs (tokens/s), gauges, KV
        bands (tokens) and shares of wall time (0..1) in the order of COLUMNS."""
        a = self.samples[-1] if self.samples else None
        self.samples.append(b)
        if a is None or b.t <= a.t:
            return
        dt = b.t - a.t
        prompt, cached = b.prompt - a.prompt, b.cached - a.cached
        prefill = min(max((b.extend_s - a.extend_s) / dt, 0.0), 1.0)
        decode = min(max((b.decode_s - a.decode_s) / dt, 0.0), 1.0 - prefill)
        self.rows.append((
            round(b.t, 3), round(cached / prompt, 4) if prompt > 0 else None,
            round(prompt / dt, 2), round((prompt - cached) / dt, 2),
            round((b.generated - a.generated) / dt, 2), b.running, b.queued,
            max(b.used - b.locked, 0), b.locked, b.evictable,
            max(b.total - b.used - b.evictable, 0), round(prefill, 4), round(decode, 4),
            round(max(1.0 - prefill - decode, 0.0), 4),
            round(min(max((b.loop_cpu_s - a.loop_cpu_s) / dt, 0.0), 1.0), 4)))

    # ------------------------------------------------------------------ /dashboard/data
    def series(self, since: Optional[float] = None,
               window_s: Optional[float] = None) -> Dict[str, Any]:
        """{"columns": COLUMNS, "rows": the rows of the intervals that end after `since` (a
        time of the server's clock, e.g. the last row a poller has) and within the last
        window_s seconds}: O(the rows returned)."""
        rows = self.rows
        start = since if since is not None else float("-inf")
        if window_s is not None and rows:
            start = max(start, rows[-1][0] - window_s)
        n = 0
        for row in reversed(rows):
            if row[0] <= start:
                break
            n += 1
        return {"columns": COLUMNS, "rows": list(itertools.islice(rows, len(rows) - n, None))}

    def totals(self) -> Dict[str, Any]:
        if not self.samples:
            return {}
        s = self.samples[-1]
        return {"prompt_tokens": s.prompt, "cached_tokens": s.cached,
                "hit_rate": s.cached / s.prompt if s.prompt else None,
                "generation_tokens": s.generated, "running": s.running, "queued": s.queued,
                "kv_total": s.total, "kv_used": s.used, "kv_cache_locked": s.locked,
                "kv_evictable": s.evictable, "kv_free": max(s.total - s.used - s.evictable, 0),
                "recent_prompts": len(self.prompts),
                "dashboard_cpu_s": {k: round(v, 6) for k, v in self.cpu.items()}}

    def _since(self, field: str) -> Callable[[int], float]:
        """value of the tree's clock `field` (tick or node_ids) -> seconds since the clock
        passed it, to the sampling interval; a value the oldest sample had passed gives the
        seconds since that sample (a lower bound: the page shows it as older than the
        history)."""
        samples = list(self.samples)
        marks = [getattr(s, field) for s in samples]
        now = time.time()

        def since(value: int) -> float:
            i = bisect.bisect_left(marks, value)
            if i >= len(samples):
                return 0.0
            return round(max(now - samples[i].t, 0.0), 1)
        return since

    async def tree(self) -> Optional[Dict[str, Any]]:
        """The tree's summary, at most TREE_TTL_S old (None without a radix cache)."""
        cache = self.cache
        if cache is None or not tree_stats.is_radix(cache):
            return None
        if self._tree is not None and time.monotonic() - self._tree_at < TREE_TTL_S:
            return self._tree
        if self._tree_job is None:
            self._tree_job = asyncio.ensure_future(self._summarize(cache))
        job = self._tree_job
        try:
            return await asyncio.shield(job)
        finally:
            if job.done() and self._tree_job is job:
                self._tree_job = None

    async def _summarize(self, cache: Any) -> Dict[str, Any]:
        started = time.perf_counter()
        with self.account("polls"):
            hits = tree_stats.sum_hits(self._hit_paths(cache))
            walk = tree_stats.TreeWalk(cache, TREE_MAX_NODES)
            done = walk.step(TREE_STEP_NODES)
        turns = 1
        while not done:
            await asyncio.sleep(0)          # let the engine and the routes run
            turns += 1
            with self.account("polls"):
                done = walk.step(TREE_STEP_NODES)
        with self.account("polls"):
            summary = walk.summary(TOP_K, hits, text=self._decode if self.show_text else None,
                                   idle_of=self._since("tick"), age_of=self._since("node_ids"))
        summary["computed_at"] = time.time()
        summary["loop_turns"] = turns
        summary["compute_s"] = round(time.perf_counter() - started, 4)
        summary["history_s"] = round(self.samples[-1].t - self.samples[0].t, 1) \
            if len(self.samples) > 1 else 0.0
        self._tree, self._tree_at = summary, time.monotonic()
        return summary

    def _hit_paths(self, cache: Any) -> List[List[Tuple[int, int]]]:
        """tree_stats.hit_path of every recent prompt, each walked once: when a summary
        first sees it (memo keyed by the ring entry, which the memo keeps alive so its id is
        not reused; entries gone from the ring are dropped)."""
        memo, paths = {}, []
        for entry in list(self.prompts):
            known = self._paths.get(id(entry))
            if known is None or known[0] is not entry:
                known = (entry, tree_stats.hit_path(cache, *entry))
            memo[id(entry)] = known
            paths.append(known[1])
        self._paths = memo
        return paths

    async def data(self, since: Optional[float], window_s: Optional[float],
                   tree_since: Optional[float] = None) -> Dict[str, Any]:
        """The body of /dashboard/data. tree_since: the computed_at of the tree summary the
        caller has: the same summary is left out then (`tree_unchanged`: true)."""
        tree = await self.tree()
        with self.account("polls"):
            return self._data(tree, since, window_s, tree_since)

    def _data(self, tree: Optional[Dict[str, Any]], since: Optional[float],
              window_s: Optional[float], tree_since: Optional[float]) -> Dict[str, Any]:
        unchanged = tree is not None and tree_since is not None and \
            tree["computed_at"] <= tree_since
        return {"now": time.time(), "model": getattr(self.engine, "served_model_name", None),
                "interval_s": SAMPLE_INTERVAL_S, "history_samples": HISTORY_SAMPLES,
                "show_text": self.show_text, "totals": self.totals(),
                "series": self.series(since, window_s), "tree": None if unchanged else tree,
                "tree_unchanged": unchanged}

    # ------------------------------------------------------------------ /dashboard/advice
    async def advice(self, params: advisor.AdvisorParams, last: Optional[int]) -> Dict[str, Any]:
        """advisor.advise over the last `last` recent prompts (all without), at most
        ADVICE_TTL_S old for the same arguments; computed on a worker thread."""
        key = (params, last)
        hit = self._advice.get(key)
        if hit is not None and time.monotonic() - hit[0] < ADVICE_TTL_S:
            return hit[1]
        job = self._advice_jobs.get(key)
        if job is None:
            job = asyncio.ensure_future(self._advise(params, last))
            self._advice_jobs[key] = job
        try:
            return await asyncio.shield(job)
        finally:
            if job.done() and self._advice_jobs.get(key) is job:
                del self._advice_jobs[key]

    async def _advise(self, params: advisor.AdvisorParams, last: Optional[int]) -> Dict[str, Any]:
        recent = list(self.prompts)
        if last is not None:
            recent = recent[-last:] if last else []
        samples = [advisor.PromptSample(ids, cached, salt) for ids, salt, cached in recent]
        decode = self._decode if getattr(self.engine, "tokenizer", None) is not None else None
        started = time.perf_counter()

        def run() -> Dict[str, Any]:
            with self.account("advisor"):
                return advisor.advise(samples, decode, params, self.show_text)

        report = await asyncio.to_thread(run)
        report["compute_s"] = round(time.perf_counter() - started, 4)
        with self.account("polls"):
            self._held_in_tree(report, recent)
        report["computed_at"] = time.time()
        self._advice[(params, last)] = (time.monotonic(), report)
        return report

    def _held_in_tree(self, report: Dict[str, Any], recent: List[Any]) -> None:
        """Each suggestion's `tree_tokens_held`: the KV slots the tree holds now for its
        members' prompts (distinct tokens: a shared part counts once); None without a radix
        cache. One read-only walk per distinct member prompt, on the loop (the tree's
        thread)."""
        cache = self.cache
        radix = cache is not None and tree_stats.is_radix(cache)
        paths: Dict[int, List[Tuple[int, int]]] = {}     # sample index -> (node id, tokens)
        for s in report["suggestions"]:
            if not radix:
                s["tree_tokens_held"] = None
                continue
            held: Dict[int, int] = {}
            for n in s["sample_indexes"]:
                if n not in paths:
                    ids, salt, _ = recent[n]
                    key = ids if not salt else [t + salt for t in ids]
                    paths[n] = [(node.node_id, tokens) for node, tokens
                                in tree_stats.cached_path(cache, key, len(key))]
                for node_id, tokens in paths[n]:
                    if tokens > held.get(node_id, 0):
                        held[node_id] = tokens
            s["tree_tokens_held"] = sum(held.values())


class CpuCollector:
    """/metrics: <prefix>dashboard_cpu_seconds_total{part="sampler"|"polls"|"advisor"}, the
    CPU seconds of the dashboard's own code (Dashboard.cpu; radixserve: under --metrics-prefix
    vllm:, whose namespace gets no made-up name)."""

    def __init__(self, dashboard: Dashboard, prefix: str):
        self.dashboard = dashboard
        self.prefix = metrics.DEFAULT_PREFIX if prefix == metrics.VLLM_PREFIX else prefix

    def collect(self):
        model = getattr(self.dashboard.engine, "served_model_name", "") or ""
        family = CounterMetricFamily(
            self.prefix + "dashboard_cpu_seconds", "CPU seconds of the dashboard's own code: "
            "the sampler and the polls' synchronous parts on the event-loop thread, the advisor "
            "on worker threads", labels=["model_name", "part"])
        for part, seconds in self.dashboard.cpu.items():
            family.add_metric([model, part], seconds)
        yield family


# --------------------------------------------------------------------------- the routes

def _dashboard(request: Request) -> Dashboard:
    return request.app.state.dashboard


def _check_access(request: Request, view: Any) -> None:
    """With an admin key the dashboard takes only that key (the door answered 401 already
    for a missing key where client keys are required)."""
    policy = request.app.state.door_policy
    if policy.admin_key is None:
        return
    identity = getattr(view, "identity", None)
    if identity == ADMIN_IDENTITY:
        return
    if isinstance(identity, str) and identity.startswith("key"):
        raise ApiError(f"{request.url.path} shows every client's traffic: it takes the admin "
                       "key (--admin-api-key), not a client key", 403)
    raise ApiError(f"{request.url.path} needs the admin key: send it as "
                   "'Authorization: Bearer <key>'", 401, headers={"WWW-Authenticate": "Bearer"})


# the query parameters of /dashboard/data and /dashboard/advice: name -> (type, low, high);
# server/openapi.py documents them from these tables
DATA_QUERY: Dict[str, Tuple[type, float, float]] = {
    "window": (int, 1, int(HISTORY_SAMPLES * SAMPLE_INTERVAL_S)),
    "since": (float, 0, 1e12), "tree_since": (float, 0, 1e12)}
ADVICE_QUERY: Dict[str, Tuple[type, float, float]] = {
    "last": (int, 1, RECENT_PROMPTS), "min_members": (int, 2, RECENT_PROMPTS),
    "min_tail": (int, 1, 4096)}


def _query(request: Request, allowed: Dict[str, Tuple[type, float, float]]) -> Dict[str, Any]:
    """The query's parameters, each of its type (int or float) within its [low, high]; 400
    naming an unknown parameter, a repeated one or a bad value."""
    out: Dict[str, Any] = {}
    for name, raw in request.query_params.multi_items():
        if name not in allowed:
            known = ", ".join(allowed) or "none"
            raise bad_request(f"unknown query parameter {name[:40]!r} (this route takes: "
                              f"{known})", param=name[:40])
        if name in out:
            raise bad_request(f"query parameter {name!r} is given twice", param=name)
        kind, low, high = allowed[name]
        what = "an integer" if kind is int else "a number"
        try:
            value = kind(raw.strip())
        except ValueError:
            value = None
        if value is None or not low <= value <= high:     # NaN fails the range too
            raise bad_request(f"query parameter {name!r} must be {what} in [{low:g}, {high:g}], "
                              f"got {raw[:40]!r}", param=name)
        out[name] = value
    return out


async def page(request: Request, engine: Any) -> Response:
    _check_access(request, engine)
    _query(request, {})
    dash = _dashboard(request)
    return Response(dash.page, media_type="text/html; charset=utf-8", headers={
        **_NO_STORE, "Content-Security-Policy": dash.csp, "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY"})


async def data(request: Request, engine: Any) -> Response:
    dash = _dashboard(request)
    with dash.account("polls"):
        _check_access(request, engine)
        q = _query(request, DATA_QUERY)
    body = await dash.data(q.get("since"), q.get("window"), q.get("tree_since"))
    with dash.account("polls"):
        return JSONResponse(body, headers=_NO_STORE)


async def advice(request: Request, engine: Any) -> Response:
    dash = _dashboard(request)
    with dash.account("polls"):
        _check_access(request, engine)
        q = _query(request, ADVICE_QUERY)
        defaults = advisor.AdvisorParams()
        page_size = int(getattr(getattr(engine, "server_args", None), "page_size", 1) or 1)
        params = advisor.AdvisorParams(min_members=q.get("min_members", defaults.min_members),
                                       min_tail=q.get("min_tail", defaults.min_tail),
                                       page_size=page_size)
    body = await dash.advice(params, q.get("last"))
    with dash.account("polls"):
        return JSONResponse(body, headers=_NO_STORE)


ROUTES = (("/dashboard", page), ("/dashboard/data", data), ("/dashboard/advice", advice))
