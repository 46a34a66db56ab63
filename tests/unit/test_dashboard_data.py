"""server/dashboard.py over the fake engine (with a real RadixCache) and over a real Scheduler:
404s without --enable-dashboard, the page and its Content-Security-Policy, the series made of
the sample ring, the tree summary and the advice (text, and none with
--no-dashboard-show-text), query errors, the API key and the admin key, the recent-prompt hook
(first admissions only, ids by reference) and that observing changes nothing computed."""
import base64
import collections
import hashlib
import re
from types import SimpleNamespace

import pytest
import torch
from starlette.testclient import TestClient

from radixserve.cache import tree_stats
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import ServerArgs
from radixserve.engine.scheduler.stats import SchedulerStats
from radixserve.server import dashboard
from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeEngine

PATHS = ("/dashboard", "/dashboard/data", "/dashboard/advice")


def fake_engine(**args):
    engine = FakeEngine()
    engine.server_args = ServerArgs(model_path="/models/fake", enable_dashboard=True, **args)
    pool = KVPool(4096, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")
    engine.scheduler = SimpleNamespace(cache=RadixCache(pool), stats=SchedulerStats())
    return engine


def serve_prompts(engine, texts):
    """What the scheduler does for each prompt: match, record the first admission, publish."""
    cache, stats = engine.scheduler.cache, engine.scheduler.stats
    for text in texts:
        ids = list(text.encode())
        cached = int(cache.match_prefix(ids).indices.numel())
        stats.recent_prompts.append((ids, 0, cached))
        cache.insert(ids, cache.kv_pool.alloc(len(ids)))


FAMILY = [f"SYSTEM: you help. Time {h:02d}:{(7 * h) % 60:02d}. You answer questions about the "
          f"weather, politely and briefly, in English. Question {h}: is it sunny?" for h in
          range(10, 18)]


def test_without_the_flag_every_dashboard_path_is_a_404():
    engine = FakeEngine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        for path in PATHS:
            assert client.get(path).status_code == 404
    assert create_app(engine).state.dashboard is None


def test_the_page_is_self_contained_and_its_csp_allows_only_its_own_code():
    with TestClient(create_app(fake_engine()), base_url=LOCAL) as client:
        r = client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page, csp = r.text, r.headers["content-security-policy"]
    assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert len(re.findall(r"<script>", page)) == 1 and "<script src" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)   # nothing fetched
    assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", page)      # but the SVG ns
    assert ".innerHTML" not in page                       # prompt text only as textContent
    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp


def test_series_are_rates_of_the_sample_ring():
    engine = fake_engine()
    app = create_app(engine)
    dash = app.state.dashboard
    base = dict(extend_s=0.0, decode_s=0.0, loop_cpu_s=0.0, running=0, queued=0, used=0,
                locked=0, evictable=0, total=1000, tick=0, node_ids=0)
    for sample in (
            dashboard.Sample(t=100.0, prompt=0, cached=0, generated=0, **base),
            dashboard.Sample(t=102.0, prompt=400, cached=300, generated=50,
                             **{**base, "extend_s": 0.5, "decode_s": 1.0, "loop_cpu_s": 0.2,
                                "running": 3, "queued": 2, "used": 200, "locked": 120,
                                "evictable": 500}),
            dashboard.Sample(t=103.0, prompt=400, cached=300, generated=60, **base)):
        dash.add(sample)
    out = dash.series()
    assert out["columns"] == dashboard.COLUMNS
    s = {name: [row[i] for row in out["rows"]] for i, name in enumerate(out["columns"])}
    assert s["t"] == [102.0, 103.0]
    assert s["hit_rate"] == [0.75, None]                  # no prompt in the second interval
    assert s["prompt_tps"] == [200.0, 0.0] and s["computed_tps"] == [50.0, 0.0]
    assert s["gen_tps"] == [25.0, 10.0]
    assert (s["prefill_share"][0], s["decode_share"][0], s["idle_share"][0]) == (0.25, 0.5, 0.25)
    assert s["loop_cpu_share"][0] == 0.1
    assert (s["kv_request"][0], s["kv_cache_locked"][0], s["kv_evictable"][0], s["kv_free"][0]) \
        == (80, 120, 500, 300)
    assert s["running"] == [3, 0] and s["queued"] == [2, 0]
    assert [r[0] for r in dash.series(window_s=1)["rows"]] == [103.0]      # the last second
    assert [r[0] for r in dash.series(since=102.0)["rows"]] == [103.0]     # what a poller lacks
    assert dash.series(since=103.0)["rows"] == [] and len(dash.series(since=0)["rows"]) == 2
    for t in range(104, 104 + 2 * dashboard.HISTORY_SAMPLES):            # the rings are bounded
        dash.add(dashboard.Sample(t=float(t), prompt=0, cached=0, generated=0, **base))
    assert len(dash.rows) == len(dash.samples) == dashboard.HISTORY_SAMPLES


def test_data_tree_and_advice_over_a_real_radix_cache():
    engine = fake_engine()
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        serve_prompts(engine, FAMILY)
        data = client.get("/dashboard/data").json()
        assert data["show_text"] and data["totals"]["recent_prompts"] == len(FAMILY)
        assert data["series"]["columns"] == list(dashboard.COLUMNS)
        tree = data["tree"]
        assert tree["nodes"] == engine.scheduler.cache.num_nodes() - 1
        assert tree["tokens"] == engine.scheduler.cache.total_size()
        top = tree["by_tokens"][0]
        assert top["text_head"] == "SYSTEM: you help. Time 1" and top["hits"] == len(FAMILY) - 1
        assert top["subtree_tokens"] == tree["tokens"]
        advice = client.get("/dashboard/advice").json()
        (s,) = advice["suggestions"]
        assert s["divergence"] == len("SYSTEM: you help. Time 1")
        assert s["before_text"].endswith("Time 1") and s["members"] == len(FAMILY)
        assert s["tail_text"].startswith(". You answer questions about the weather")
        assert {v["text"] for v in s["varying"]} == {t[24:28] for t in FAMILY}
        assert s["tree_tokens_held"] == tree["tokens"]        # the family is the whole tree
        assert s["estimated_hit_rate"] > s["current_hit_rate"]
        last = client.get("/dashboard/advice?last=2").json()
        assert last["prompts"] == 2 and last["suggestions"] == []
        at = tree["computed_at"]
        same = client.get(f"/dashboard/data?tree_since={at!r}").json()
        assert same["tree"] is None and same["tree_unchanged"] is True
        older = client.get(f"/dashboard/data?tree_since={at - 1!r}").json()
        assert older["tree"] == tree and older["tree_unchanged"] is False
        again = client.get("/dashboard/advice").json()
        assert again["computed_at"] == advice["computed_at"]   # reused within ADVICE_TTL_S


def test_each_recent_prompt_is_walked_once(monkeypatch):
    engine = fake_engine()
    app = create_app(engine)
    dash = app.state.dashboard
    serve_prompts(engine, FAMILY)
    walked = []
    real = tree_stats.hit_path
    monkeypatch.setattr(tree_stats, "hit_path", lambda cache, *e: walked.append(e) or real(cache, *e))
    first = dash._hit_paths(engine.scheduler.cache)
    assert len(walked) == len(FAMILY)
    serve_prompts(engine, FAMILY[:2])
    second = dash._hit_paths(engine.scheduler.cache)
    assert len(walked) == len(FAMILY) + 2 and second[:len(FAMILY)] == first
    assert tree_stats.sum_hits(second) == tree_stats.attribute_hits(
        engine.scheduler.cache, list(dash.prompts))


def test_no_text_anywhere_with_no_dashboard_show_text():
    engine = fake_engine(dashboard_show_text=False)
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        serve_prompts(engine, FAMILY)
        data = client.get("/dashboard/data").json()
        advice = client.get("/dashboard/advice").json()
    assert not data["show_text"] and not advice["show_text"]
    body = str(data) + str(advice)
    assert "weather" not in body and "SYSTEM" not in body and "text_head" not in body
    assert advice["suggestions"][0]["divergence"] == 24


def test_query_errors_are_400s_naming_the_parameter():
    with TestClient(create_app(fake_engine()), base_url=LOCAL) as client:
        for path, param in (("/dashboard/data?window=0", "window"),
                            ("/dashboard/data?window=x", "window"),
                            ("/dashboard/data?window=5&window=6", "window"),
                            ("/dashboard/data?since=nan", "since"),
                            ("/dashboard/data?since=-1", "since"),
                            ("/dashboard/data?until=1", "until"),
                            ("/dashboard/advice?last=0", "last"),
                            ("/dashboard/advice?last=100000", "last"),
                            ("/dashboard/advice?min_members=1", "min_members"),
                            ("/dashboard/advice?min_tail=abc", "min_tail"),
                            ("/dashboard?x=1", "x")):
            r = client.get(path)
            assert r.status_code == 400, path
            assert r.json()["error"]["param"] == param, path
        assert client.post("/dashboard/data").status_code == 405


def test_the_api_key_and_the_admin_key():
    with TestClient(create_app(fake_engine(api_key="k")), base_url=LOCAL) as client:
        for path in PATHS:
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer no"}).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 200
    engine = fake_engine(api_key="k", admin_api_key="adm")
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        for path in PATHS:
            assert client.get(path, headers={"Authorization": "Bearer k"}).status_code == 403
            assert client.get(path, headers={"Authorization": "Bearer adm"}).status_code == 200
            assert client.get(path).status_code == 401
    engine = fake_engine(admin_api_key="adm")          # no client keys: the door lets all in
    with TestClient(create_app(engine), base_url=LOCAL) as client:
        r = client.get("/dashboard/data")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert client.get("/dashboard/data", headers={"Authorization": "Bearer adm"}).status_code == 200


def test_the_sampler_runs_while_the_app_does_and_its_cpu_is_on_metrics():
    engine = fake_engine()
    app = create_app(engine)
    with TestClient(app, base_url=LOCAL) as client:
        dash = app.state.dashboard
        assert len(dash.samples) >= 1 and dash._task is not None
        serve_prompts(engine, FAMILY)
        assert client.get("/dashboard/advice").status_code == 200
        text = client.get("/metrics").text
        for part in ("sampler", "polls", "advisor"):
            value = re.search(rf'^radixserve:dashboard_cpu_seconds_total{{model_name="fake",'
                              rf'part="{part}"}} (\S+)$', text, re.M)
            assert value and float(value.group(1)) > 0, part
        assert engine.scheduler.stats.recent_prompts is dash.prompts
        assert dash.prompts.maxlen == dashboard.RECENT_PROMPTS
    assert dash._task is None


# --------------------------------------------------------------------------- a real scheduler

def _requests(tokenizer, n_new=3):
    from radixserve.engine.req import Req
    from radixserve.sampling.params import SamplingParams

    system = "You are a helpful assistant. The user's name is {}. Answer in one short sentence."
    names = ["Alice", "Bob", "Carol", "Dave"]
    return [Req(f"r{i}", tokenizer.encode(system.format(name) + " What is two plus two?"),
                SamplingParams(max_new_tokens=n_new, temperature=0.0, ignore_eos=True), n_new)
            for i, name in enumerate(names)]


def _run(sched, reqs, observe=None):
    """Step sched until reqs finish, one arriving every second step; observe(sched) after
    every step (the dashboard's reads)."""
    step = 0
    pending = list(reqs)
    while pending or sched.has_work():
        if pending and step % 2 == 0:
            sched.add_request(pending.pop(0))
        sched.step()
        if observe is not None:
            observe(sched)
        step += 1
        assert step < 1000


def test_recent_prompts_hold_first_admissions_and_observing_changes_nothing(
        make_scheduler, default_tokenizer):
    watched, plain = make_scheduler(), make_scheduler()
    watched.stats.recent_prompts = collections.deque(maxlen=dashboard.RECENT_PROMPTS)
    a, b = _requests(default_tokenizer), _requests(default_tokenizer)

    def observe(sched):
        hits = tree_stats.attribute_hits(sched.cache, list(sched.stats.recent_prompts))
        walk = tree_stats.TreeWalk(sched.cache, 1000)
        while not walk.step(1):
            pass
        walk.summary(5, hits, text=default_tokenizer.decode)
        sched.check_integrity()

    _run(watched, a, observe)
    _run(plain, b)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.cached_tokens for r in a] == [r.cached_tokens for r in b]
    assert watched.cache.total_size() == plain.cache.total_size()
    assert watched.counters == plain.counters
    recorded = list(watched.stats.recent_prompts)
    assert len(recorded) == len(a)
    for (ids, salt, cached), req in zip(recorded, a):
        assert ids is req.origin_input_ids and salt == 0 and cached == req.cached_tokens
    assert sum(c for _, _, c in recorded) > 0          # the shared system prompt was hit
    assert plain.stats.recent_prompts is None


# --------------------------------------------------------------------------- flags and CLI

def test_the_flags():
    from radixserve import cli

    def parse(*argv):
        return ServerArgs.from_cli_args(cli.build_parser().parse_args(["serve", *argv]))
    assert (parse().enable_dashboard, parse().dashboard_show_text) == (False, True)
    args = parse("--enable-dashboard", "--no-dashboard-show-text")
    assert (args.enable_dashboard, args.dashboard_show_text) == (True, False)
    assert parse("--dashboard-show-text").dashboard_show_text is True
    with pytest.raises(ValueError, match="--enable-dashboard"):
        ServerArgs(enable_dashboard=True, dp_size=2, device="cpu").check()


def test_advise_cli_errors(capsys):
    from radixserve import cli

    assert cli.main(["advise"]) == 2                                  # --url is required
    port = _closed_port()
    assert cli.main(["advise", "--url", f"http://127.0.0.1:{port}", "--timeout", "5"]) == 1
    assert "cannot read" in capsys.readouterr().err


def _closed_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
