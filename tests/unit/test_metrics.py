"""/metrics over a small fake engine: SGLang's names under the default and a custom
--metrics-prefix, the model_name label, counters that grow across requests, the cache-hit
counters, latency histograms observed for streamed and non-streamed requests (only with
--enable-metrics), --log-requests lines, and the Grafana dashboard: every metric that any of
its panels queries is on /metrics of a server that has served a few requests."""
import asyncio
import glob
import json
import logging
import os
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from radixserve.config import ServerArgs
from radixserve.engine.io import GenerateOutput
from radixserve.server.app import create_app

from test_server_fake_engine import LOCAL, FakeTokenizer  # noqa: E402 (the byte-level fake)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLY = "The quick brown fox jumps over the lazy dog. "
QUEUE_TIME_S = 0.0042


class CountingEngine:
    """Emits REPLY one byte-token per step (1 ms apart) and keeps the scheduler's counters: a
    prompt seen before is served from the 'cache' (len - 1 cached tokens, as the radix cache
    reports). The first output carries queue_time_s."""

    def __init__(self, **server_args):
        from types import SimpleNamespace
        self.server_args = ServerArgs(model_path="/models/fake", **server_args)
        self.model_config = SimpleNamespace(vocab_size=256, architecture="FakeForCausalLM")
        self.tokenizer = FakeTokenizer()
        self.model_path = "/models/fake"
        self.served_model_name = "fake-model"
        self.context_len = 256
        self.counters = dict(num_requests=0, num_finished_requests=0, num_aborted_requests=0,
                             prompt_tokens=0, cached_tokens=0, generation_tokens=0,
                             num_retractions=0, num_prefill_steps=0, num_decode_steps=0)
        self.seen_prompts = set()
        self.running = 0

    def start(self):
        pass

    async def shutdown(self):
        pass

    def validate(self, req, prompt_checked=False):
        if len(req.input_ids) >= self.context_len:
            raise ValueError("prompt too long")

    def abort(self, rid):
        pass

    async def flush_cache(self):
        return True

    def server_info(self):
        return {}

    def is_healthy(self):
        return True

    def metrics(self):
        return {**self.counters, "num_running_reqs": self.running, "num_waiting_reqs": 0,
                "token_usage": 0.25, "num_used_tokens": 64, "max_total_tokens": 256,
                "evictable_tokens": 32, "gen_throughput": 123.5, "gpu_busy_fraction": 0.5,
                "note": "not a number"}

    async def generate(self, req, validated=False):
        c = self.counters
        key = tuple(req.input_ids)
        cached = len(key) - 1 if key in self.seen_prompts else 0
        self.seen_prompts.add(key)
        c["num_requests"] += 1
        c["prompt_tokens"] += len(key)
        c["cached_tokens"] += cached
        c["num_prefill_steps"] += 1
        sp = req.sampling_params
        limit = sp.max_new_tokens or 8
        self.running += 1
        try:
            for step in range(1, limit + 1):
                await asyncio.sleep(0.001)
                c["generation_tokens"] += 1
                if step > 1:
                    c["num_decode_steps"] += 1
                done = step == limit
                if done:
                    c["num_finished_requests"] += 1
                ch = REPLY[(step - 1) % len(REPLY)]
                yield GenerateOutput(
                    rid=req.rid, text_delta=ch, output_ids_delta=[ord(ch)], finished=done,
                    finish_reason={"type": "length", "matched": None} if done else None,
                    prompt_tokens=len(key), completion_tokens=step, cached_tokens=cached,
                    queue_time_s=QUEUE_TIME_S if step == 1 else None)
        finally:
            self.running -= 1


def scrape(client):
    """{sample name: [(labels, value)]} from /metrics, and the TYPE of each family."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples, types = {}, {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples, types


def value(samples, name, **labels):
    """The one sample `name` whose labels include `labels`."""
    rows = [v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(rows) == 1, (name, labels, samples[name])
    return rows[0]


def generate(client, text, max_new_tokens=5, stream=False):
    r = client.post("/generate", json={"text": text, "stream": stream,
                                       "sampling_params": {"max_new_tokens": max_new_tokens}})
    assert r.status_code == 200, r.text
    return r


GAUGES = ["num_running_reqs", "num_queue_reqs", "num_waiting_reqs", "token_usage",
          "num_used_tokens", "max_total_num_tokens", "max_total_tokens", "evictable_tokens",
          "gen_throughput", "gpu_busy_fraction", "cache_hit_rate"]
COUNTERS = ["prompt_tokens_total", "generation_tokens_total", "cached_tokens_total",
            "num_requests_total", "num_finished_requests_total", "num_aborted_requests_total",
            "num_retracted_requests_total", "cache_query_tokens_total", "cache_hit_tokens_total",
            "decode_device_seconds_total", "extend_device_seconds_total",
            "device_idle_before_decode_seconds_total", "device_idle_before_extend_seconds_total"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "time_per_output_token_seconds", "e2e_request_latency_seconds",
              "queue_time_seconds"]


# --------------------------------------------------------------------------- names and labels

@pytest.mark.parametrize("prefix", [None, "sglang:"])
def test_names_types_and_labels(prefix):
    kw = {} if prefix is None else {"metrics_prefix": prefix}
    engine = CountingEngine(enable_metrics=True, **kw)
    expected = prefix or "radixserve:"
    other = "radixserve:" if prefix else "sglang:"
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "hello")
        samples, types = scrape(c)
    for name in GAUGES:
        assert types[expected + name] == "gauge", name
    for name in COUNTERS:
        assert types[expected + name[:-len("_total")]] == "counter", name
        assert expected + name in samples
    for name in HISTOGRAMS:
        assert types[expected + name] == "histogram", name
        for suffix in ("_bucket", "_sum", "_count"):
            assert expected + name + suffix in samples
    assert not any(n.startswith(other) for n in samples)
    ours = [n for n in samples if n.startswith(expected)]
    assert len(ours) > 20
    # every series of ours carries the model name
    for n in ours:
        assert all(lab.get("model_name") == "fake-model" for lab, _ in samples[n]), n
    assert value(samples, expected + "gen_throughput") == 123.5
    assert value(samples, expected + "gpu_busy_fraction") == 0.5
    assert value(samples, expected + "num_queue_reqs") == value(samples, expected + "num_waiting_reqs")
    assert value(samples, expected + "max_total_num_tokens") == 256
    assert value(samples, expected + "token_usage") == 0.25
    assert expected + "note" not in samples          # non-numeric engine keys are skipped


def test_histograms_only_with_enable_metrics_and_defaults_for_missing_keys():
    engine = CountingEngine()
    engine.metrics = lambda: {"prompt_tokens": 3, "future_key_total": 7, "future_gauge": 1.5}
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "hello")
        samples, types = scrape(c)
    assert not any(h in n for n in samples for h in HISTOGRAMS)      # no histogram
    # keys the engine does not report (yet) read as 0, so dashboards always find them
    for name in ("gen_throughput", "gpu_busy_fraction", "num_running_reqs", "num_queue_reqs"):
        assert value(samples, "radixserve:" + name) == 0.0
    assert value(samples, "radixserve:prompt_tokens_total") == 3
    assert value(samples, "radixserve:cache_hit_rate") == 0.0
    # unknown numeric keys pass through: `_total` ones as counters
    assert types["radixserve:future_key"] == "counter"
    assert value(samples, "radixserve:future_key_total") == 7
    assert types["radixserve:future_gauge"] == "gauge"


def test_bad_prefix_is_refused():
    with pytest.raises(ValueError, match="--metrics-prefix"):
        create_app(CountingEngine(metrics_prefix="9bad-prefix"))


def test_cli_flags():
    from radixserve import cli
    ns = cli.build_parser().parse_args(["serve", "--enable-metrics", "--log-requests",
                                        "--metrics-prefix", "sglang:"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.enable_metrics, args.log_requests, args.metrics_prefix) == (True, True, "sglang:")
    assert ServerArgs().metrics_prefix == "radixserve:" and not ServerArgs().enable_metrics


# --------------------------------------------------------------------------- counters

def test_counters_grow_across_requests_and_cache_hits_are_counted():
    engine = CountingEngine()
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "abcdefgh", max_new_tokens=4)
        s1, _ = scrape(c)
        generate(c, "abcdefgh", max_new_tokens=3)       # the same prompt: 7 tokens cached
        generate(c, "xyz", max_new_tokens=2)
        s2, _ = scrape(c)
    p = "radixserve:"
    assert value(s1, p + "num_requests_total") == 1 and value(s2, p + "num_requests_total") == 3
    assert value(s1, p + "prompt_tokens_total") == 8 and value(s2, p + "prompt_tokens_total") == 19
    assert value(s1, p + "generation_tokens_total") == 4
    assert value(s2, p + "generation_tokens_total") == 9
    assert value(s1, p + "cached_tokens_total") == 0 and value(s2, p + "cached_tokens_total") == 7
    # hit and query counters: a window's hit rate is their rates' ratio
    assert value(s2, p + "cache_query_tokens_total") == 19
    assert value(s2, p + "cache_hit_tokens_total") == 7
    assert value(s2, p + "cache_hit_rate") == pytest.approx(7 / 19)
    assert value(s2, p + "num_finished_requests_total") == 3


# --------------------------------------------------------------------------- histograms

def hist(samples, name, prefix="radixserve:"):
    """(count, sum, {le: cumulative count}) of one histogram."""
    buckets = {lab["le"]: v for lab, v in samples[prefix + name + "_bucket"]}
    return value(samples, prefix + name + "_count"), value(samples, prefix + name + "_sum"), buckets


def test_histograms_observe_non_streamed_and_streamed_requests():
    engine = CountingEngine(enable_metrics=True)
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        s0, _ = scrape(c)
        for name in HISTOGRAMS:
            assert hist(s0, name)[0] == 0
        generate(c, "hello", max_new_tokens=5)                        # non-streamed, 5 tokens
        s1, _ = scrape(c)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 4, "stream": True})
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        s2, _ = scrape(c)
        r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "n": 2})
        assert r.status_code == 200
        s3, _ = scrape(c)
        assert c.get("/health_generate").status_code == 200          # probes are not observed
        s4, _ = scrape(c)
    # one request of 5 tokens: 1 TTFT, 4 inter-token gaps, 1 TPOT, 1 e2e, 1 queue time
    counts = {n: hist(s1, n)[0] for n in HISTOGRAMS}
    assert counts == {"time_to_first_token_seconds": 1, "inter_token_latency_seconds": 4,
                      "time_per_output_token_seconds": 1, "e2e_request_latency_seconds": 1,
                      "queue_time_seconds": 1}
    ttft_n, ttft_sum, _ = hist(s1, "time_to_first_token_seconds")
    e2e_n, e2e_sum, e2e_buckets = hist(s1, "e2e_request_latency_seconds")
    itl_n, itl_sum, _ = hist(s1, "inter_token_latency_seconds")
    assert 0 < ttft_sum < e2e_sum and itl_sum > 0
    assert itl_sum <= e2e_sum - ttft_sum + 1e-9
    assert e2e_buckets["+Inf"] == 1
    q_n, q_sum, q_buckets = hist(s1, "queue_time_seconds")
    assert q_sum == pytest.approx(QUEUE_TIME_S)
    assert q_buckets["0.0025"] == 0 and q_buckets["0.005"] == 1      # 4.2 ms lands in (2.5, 5] ms
    # the streamed chat request (4 tokens) adds 1, 3, 1, 1, 1
    assert {n: hist(s2, n)[0] - counts[n] for n in HISTOGRAMS} == {
        "time_to_first_token_seconds": 1, "inter_token_latency_seconds": 3,
        "time_per_output_token_seconds": 1, "e2e_request_latency_seconds": 1,
        "queue_time_seconds": 1}
    # n=2: each sequence is observed
    assert hist(s3, "e2e_request_latency_seconds")[0] == 4
    assert hist(s3, "inter_token_latency_seconds")[0] == 4 + 3 + 2 * 2
    assert {n: hist(s4, n)[0] for n in HISTOGRAMS} == {n: hist(s3, n)[0] for n in HISTOGRAMS}


def test_log_requests_one_line_per_finished_request(caplog):
    engine = CountingEngine(log_requests=True)
    with caplog.at_level(logging.INFO, logger="radixserve.server.metrics"):
        with TestClient(create_app(engine), base_url=LOCAL) as c:
            c.post("/generate", json={"text": "hello", "rid": "req-42",
                                      "sampling_params": {"max_new_tokens": 3}})
            c.post("/generate", json={"text": "hello", "rid": "req-43", "stream": True,
                                      "sampling_params": {"max_new_tokens": 2}})
            samples, _ = scrape(c)
    lines = [r.getMessage() for r in caplog.records if r.name == "radixserve.server.metrics"]
    assert len(lines) == 2, lines
    first, second = lines
    assert "rid=req-42" in first and "prompt_tokens=5" in first and "completion_tokens=3" in first
    assert "cached_tokens=0" in first and "finish_reason=length" in first
    assert re.search(r"ttft=\d+\.\d+ s", first) and re.search(r"e2e_latency=\d+\.\d+ s", first)
    assert re.search(r"queue_time=0\.0042 s", first)
    assert "rid=req-43" in second and "cached_tokens=4" in second and "completion_tokens=2" in second
    # logging alone does not turn the histograms on
    assert not any(h in n for n in samples for h in HISTOGRAMS)      # no histogram


# --------------------------------------------------------------------------- dashboard

def dashboard_panels(dash):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])          # panels nested in collapsed rows


@pytest.mark.parametrize("prefix", ["radixserve:", "sglang:"])
def test_every_dashboard_panel_has_data(prefix):
    """Every metric any panel (or template variable) queries is on /metrics after a few
    requests, with the server's prefix substituted for the dashboard's $prefix variable; every
    histogram a panel reads has observations."""
    paths = sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json")))
    assert paths, "no dashboard under dashboards/"
    engine = CountingEngine(enable_metrics=True, metrics_prefix=prefix)
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "the same prompt", max_new_tokens=4)
        generate(c, "the same prompt", max_new_tokens=3, stream=True)
        c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3})
        samples, _ = scrape(c)
    name_re = re.compile(re.escape(prefix) + r"[A-Za-z_][A-Za-z0-9_:]*")
    for path in paths:
        with open(path) as f:
            dash = json.load(f)
        variables = {v["name"] for v in dash["templating"]["list"]}
        assert "prefix" in variables and "model_name" in variables
        prefix_var = next(v for v in dash["templating"]["list"] if v["name"] == "prefix")
        assert prefix in [o["value"] for o in prefix_var["options"]]
        queries = [(f"variable {v['name']}", v["query"]["query"]) for v in dash["templating"]["list"]
                   if v["type"] == "query"]
        panels = [p for p in dashboard_panels(dash) if p["type"] != "row"]
        assert len(panels) >= 10
        for p in panels:
            assert p.get("targets"), f"panel {p['title']!r} has no query"
            queries += [(f"panel {p['title']!r}", t["expr"]) for t in p["targets"]]
        for where, expr in queries:
            assert "radixserve:" not in expr and "sglang:" not in expr, \
                f"{where}: write the metric prefix as ${{prefix}}: {expr}"
            for var in re.findall(r"\$\{?(\w+)", expr):
                assert var in variables or var.startswith("__"), f"{where}: unknown ${var}"
            expr = expr.replace("${prefix}", prefix).replace("$prefix", prefix)
            names = name_re.findall(expr)
            assert names, f"{where} queries no metric: {expr}"
            for name in names:
                assert name in samples, f"{where}: {name} is not on /metrics"
                if name.endswith(("_bucket", "_count", "_sum")):
                    base = name.rsplit("_", 1)[0]
                    assert value(samples, base + "_count") > 0, f"{where}: {base} has no observations"
