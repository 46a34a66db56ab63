"""The cache dashboard and the prefix-cache advisor against a live CPU server of the default
model, started here with --enable-dashboard and an API key (one server for this module).

  * The advisor, on 4 families of prompts whose system prompts carry a varying timestamp or
    user name at a known token position, names each family's divergence position (exact) and
    its varying text; after the workload is changed as it suggests (the span moved after the
    shared text, cache flushed first), the hit rate the server's own counters measure is
    within 10% of the advisor's estimate, overall and per family. `radixserve advise` prints
    the same report.
  * A real browser (headless Chromium from the OS packages, over the DevTools protocol) loads
    /dashboard while a load runs: the charts draw (SVG paths with data points) and update (two
    DOM dumps differ), the tree lists the load's shared prefix with its decoded text, the
    advisor's table its family; the page fetches nothing it may not; without the key the page
    is a 401. Skipped when no chromium binary is on PATH.
"""
import asyncio
import importlib.util
import os
import re
import threading
import time

import httpx
import pytest

from conftest import launched_server
from radixserve import cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _load_bench_module(name: str):
    """bench/<name>.py as a module, without putting bench/ on sys.path (its kernels.py would
    shadow the `kernels` package transformers looks for)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Opt-in under the full suite: beside every other worker's servers on a 2-core 23 GB machine the
# pool sized from MemAvailable shrank to 23 tokens once and Chromium's DevTools endpoint did not
# come up in time (both tests pass alone: `RADIXSERVE_ACCEPTANCE=1 pytest tests/e2e/test_dashboard.py`).
if os.environ.get("RADIXSERVE_ACCEPTANCE") != "1":
    pytest.skip("the dashboard's server + headless Chromium: opt-in, set RADIXSERVE_ACCEPTANCE=1",
                allow_module_level=True)

_chromium = _load_bench_module("headless_chromium")
Chromium, find_chromium = _chromium.Chromium, _chromium.find_chromium

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
APT_LINE = "apt-get update && apt-get install -y chromium"


@pytest.fixture(scope="module")
def dash_server(tmp_path_factory):
    """A server of the default model with --enable-dashboard --api-key KEY: its URL."""
    args = ["--enable-dashboard", "--api-key", KEY, "--debug-integrity",
            "--max-total-tokens", "16384"]
    with launched_server(tmp_path_factory.mktemp("dashboard"), args,
                         env={"RADIXSERVE_API_KEY": None, "RADIXSERVE_ADMIN_API_KEY": None},
                         headers=AUTH) as srv:
        yield srv.url


def counter(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    m = re.search(rf"^radixserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def lcp(seqs):
    n = 0
    while all(len(s) > n for s in seqs) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


# --------------------------------------------------------------------------- the advisor

FAMILIES = [
    ("You are the help desk of Acme Tools. Current time:",
     [f" 2025-03-14 {h:02d}:{m:02d}:{s:02d} UTC" for h, m, s in
      ((9, 26, 53), (11, 2, 17), (14, 45, 8), (16, 30, 41), (8, 5, 32), (19, 58, 4),
       (12, 13, 29), (7, 49, 16))],
     ". Answer questions about orders, shipping and returns; keep every answer under fifty "
     "words and never promise a refund.\n",
     "Customer: where is my order number {}?"),
    ("You are Chef Remy, a cooking assistant. You are talking to",
     [" Alice", " Bob", " Carol", " Dave", " Erin", " Frank", " Grace", " Heidi"],
     ", who is cooking dinner tonight. Suggest one simple recipe with at most six ingredients "
     "and explain it step by step.\n",
     "User: I have {} eggs and some rice."),
    ("System status report generated at",
     [f" 2024-11-02 {h:02d}:{m:02d}" for h, m in
      ((3, 14), (6, 28), (10, 42), (13, 56), (17, 11), (20, 25), (22, 39), (1, 53))],
     ". The cluster has eight nodes; summarize any failures and list the services that need a "
     "restart, in order of priority.\n",
     "Operator: check node {} first."),
    ("Tutoring session for the student",
     [" Ming", " Priya", " Olu", " Sven", " Hana", " Diego", " Fatima", " Lukas"],
     ". Explain the concept gently, check understanding with exactly one question, and praise "
     "progress warmly.\n",
     "Student: what is a prime number bigger than {}?"),
]


def _workload(tokenizer):
    """[(family, member, prefix ids, value ids, tail ids, question ids)], families interleaved."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)   # noqa: E731
    out = []
    for member in range(8):
        for f, (prefix, values, tail, question) in enumerate(FAMILIES):
            out.append((f, member, enc(prefix), enc(values[member]), enc(tail),
                        enc(question.format(10 + 7 * member))))
    return out


def _generate(url, prompts):
    """Send prompts one at a time (max_new_tokens 1); their cached_tokens."""
    cached = []
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        for ids in prompts:
            r = client.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 1, "temperature": 0.0}})
            assert r.status_code == 200, r.text
            cached.append(r.json()["meta_info"]["cached_tokens"])
    return cached


def test_advisor_names_each_family_and_its_estimate_holds(dash_server, default_tokenizer,
                                                          capsys):
    url = dash_server
    work = _workload(default_tokenizer)
    original = [p + v + t + q for _, _, p, v, t, q in work]
    assert httpx.post(url + "/flush_cache", headers=AUTH, timeout=30).status_code == 200
    _generate(url, original)
    r = httpx.get(url + f"/dashboard/advice?last={len(original)}", headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["prompts"] == len(original)
    by_members = {tuple(s["sample_indexes"]): s for s in report["suggestions"]}
    decode = lambda ids: default_tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    expected, spans = {}, {}
    for f in range(len(FAMILIES)):
        rows = [i for i, w in enumerate(work) if w[0] == f]
        prefix, values = work[rows[0]][2], [work[i][3] for i in rows]
        start = lcp(values)
        end = lcp([v[::-1] for v in values])          # a common last token joins the tail
        s = by_members[tuple(rows)]
        assert s["divergence"] == len(prefix) + start, FAMILIES[f][0]
        if f in (1, 3):                                # names: diverge where the name starts
            assert start == 0
        assert {v["text"] for v in s["varying"]} == {decode(v[start:len(v) - end]) for v in values}
        assert s["distinct_spans"] == s["covered"] == s["members"] == 8
        assert s["tail_text"].startswith(decode(values[0][len(values[0]) - end:] + work[rows[0]][4])[:30])
        assert s["tail_tokens"] >= end + len(work[rows[0]][4])
        expected[f] = s
        spans.update({i: (s["divergence"], len(v) - start - end, s["tail_tokens"])
                      for i, v in zip(rows, values)})
    # the CLI prints the same report
    assert cli.main(["advise", "--url", url, "--api-key", KEY, "--last", str(len(original))]) == 0
    printed = capsys.readouterr().out
    for s in expected.values():
        assert f"diverging at token {s['divergence']} into 8 distinct spans" in printed
    # the workload as the advisor suggests: each varying span moved after the shared tokens
    # that follow it (the family's text, and whatever its questions share after it)
    reordered = []
    for i, ids in enumerate(original):
        d, o, t = spans[i]
        reordered.append(ids[:d] + ids[d + o:d + o + t] + ids[d:d + o] + ids[d + o + t:])
    assert httpx.post(url + "/flush_cache", headers=AUTH, timeout=30).status_code == 200
    prompt0, cached0 = counter(url, "prompt_tokens_total"), counter(url, "cached_tokens_total")
    cached = _generate(url, reordered)
    measured = (counter(url, "cached_tokens_total") - cached0) / \
        (counter(url, "prompt_tokens_total") - prompt0)
    estimate = report["overall"]["estimated_hit_rate"]
    assert measured == pytest.approx(estimate, rel=0.10)
    assert measured > report["overall"]["observed_hit_rate"] + 0.3
    for f, s in expected.items():
        rows = [i for i, w in enumerate(work) if w[0] == f]
        family = sum(cached[i] for i in rows) / sum(len(reordered[i]) for i in rows)
        assert family == pytest.approx(s["estimated_hit_rate"], rel=0.10), FAMILIES[f][0]


# --------------------------------------------------------------------------- the browser

LOAD_SYSTEM = ("You are the dashboard browser test assistant. The user's name is {}. Always "
               "answer in one short friendly sentence and mention the weather in Paris.")
LOAD_NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank"]


class Load:
    """Chat requests sharing LOAD_SYSTEM, two at a time, until stopped."""

    def __init__(self, url):
        self.url, self.done, self.errors = url, 0, []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]

    def _run(self, k):
        i = k
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=120) as client:
            while not self.stop.is_set():
                r = client.post("/v1/chat/completions", json={"max_tokens": 4, "messages": [
                    {"role": "system", "content": LOAD_SYSTEM.format(LOAD_NAMES[i % len(LOAD_NAMES)])},
                    {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"}]})
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.done += 1
                i += 2

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


SERIES_POINTS = ("[...document.querySelectorAll('svg.chart path')]"
                 ".map(p => +p.getAttribute('data-points'))")


async def _browse(url, shots):
    async with Chromium() as browser:
        locked = await browser.page()
        await locked.navigate(url + "/dashboard")               # no key: the door says no
        refused = await locked.evaluate("document.body.innerText")
        page = await browser.page(width=1400, height=1000)
        await page.set_headers(AUTH)
        await page.navigate(url + "/dashboard")
        await page.wait_for(f"{SERIES_POINTS}.every(n => n > 1) && "
                            "document.querySelectorAll('#tree-tokens tbody tr').length > 0 && "
                            "document.querySelectorAll('#advice tbody tr').length > 0", 60)
        first = await page.dom()
        await page.screenshot(os.path.join(shots, "dashboard-1.png"))
        before = await page.evaluate("document.getElementById('updated').textContent")
        await page.wait_for(f"document.getElementById('updated').textContent !== {before!r}", 30)
        second = await page.dom()
        await page.screenshot(os.path.join(shots, "dashboard-2.png"))
        paths = await page.evaluate("[...document.querySelectorAll('svg.chart path')]"
                                    ".map(p => [p.getAttribute('data-series'), p.getAttribute('d')])")
        tree = await page.evaluate("document.getElementById('tree-tokens').innerText")
        hits = await page.evaluate("document.getElementById('tree-hits').innerText")
        advice = await page.evaluate("document.getElementById('advice').innerText")
        return dict(refused=refused, first=first, second=second, paths=paths, tree=tree,
                    hits=hits, advice=advice, console=page.console, failed=page.failed)


def test_the_dashboard_in_a_real_browser(dash_server, tmp_path):
    if find_chromium() is None:
        pytest.skip(f"no chromium binary on PATH (Debian: {APT_LINE})")
    url = dash_server
    assert httpx.get(url + "/dashboard", timeout=30).status_code == 401
    assert httpx.get(url + "/dashboard/data", timeout=30).status_code == 401
    with Load(url) as load:
        deadline = time.monotonic() + 120
        while load.done < 6 and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = asyncio.run(_browse(url, str(tmp_path)))
    assert not load.errors, load.errors[:2]
    assert "this route needs an API key" in seen["refused"]
    assert seen["first"] != seen["second"]                       # the page updates
    assert len(seen["paths"]) >= 14 and all(d and d.startswith("M") for _, d in seen["paths"])
    shared = "You are the dashboard browser test assistant. The user's name is"
    assert shared in seen["tree"].replace("\u21b5", "\n") and shared in seen["hits"]
    assert "weather in Paris" in seen["advice"]
    assert sum(name in seen["advice"] for name in LOAD_NAMES) >= 3   # its varying span
    assert seen["failed"] == [] and seen["console"] == []
    for name in ("dashboard-1.png", "dashboard-2.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
