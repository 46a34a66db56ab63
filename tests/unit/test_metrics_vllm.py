"""--metrics-prefix vllm: over the fake engine of test_metrics.py: vLLM's names, types and
labels (vllm/v1/metrics/loggers.py: model_name and engine on every series) for the gauges and
counters stacks hard-code (llm-d / Gateway API inference extension read num_requests_waiting,
num_requests_running, kv_cache_usage_perc; the prefix-cache counters), the histograms under
vLLM's names with --enable-metrics, and radixserve: for everything vLLM has no name for."""
import pytest
from starlette.testclient import TestClient

from radixserve.config import ServerArgs
from radixserve.server.app import create_app

from test_metrics import CountingEngine, generate, hist, scrape, value
from test_server_fake_engine import LOCAL

LABELS = {"model_name": "fake-model", "engine": "0"}
VLLM_GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "gpu_cache_usage_perc", "cache_config_info"]
VLLM_COUNTERS = ["prompt_tokens", "generation_tokens", "prefix_cache_queries",
                 "prefix_cache_hits", "prompt_tokens_cached", "gpu_prefix_cache_queries",
                 "gpu_prefix_cache_hits", "num_preemptions"]
VLLM_HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
                   "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                   "request_queue_time_seconds"]


def vllm_engine(**kw):
    engine = CountingEngine(metrics_prefix="vllm:", **kw)
    base = engine.metrics
    engine.metrics = lambda: {**base(), "num_retractions": 2, "num_fair_retractions": 1,
                              "num_waiting_reqs": 3}
    return engine


def test_vllm_names_types_and_labels():
    engine = vllm_engine()
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "abcdefgh", max_new_tokens=4)
        generate(c, "abcdefgh", max_new_tokens=3)        # 7 tokens from the cache
        samples, types = scrape(c)
    fams = {name for name in types if name.startswith("vllm:")}
    assert fams == {"vllm:" + n for n in VLLM_GAUGES + VLLM_COUNTERS}   # nothing made up
    for n in VLLM_GAUGES:
        assert types["vllm:" + n] == "gauge", n
    for n in VLLM_COUNTERS:
        assert types["vllm:" + n] == "counter", n
        assert "vllm:" + n + "_total" in samples
    for name, rows in samples.items():
        if name.startswith("vllm:") and name != "vllm:cache_config_info":
            for labels, _ in rows:
                assert labels == LABELS, (name, labels)
    assert value(samples, "vllm:num_requests_running", **LABELS) == 0
    assert value(samples, "vllm:num_requests_waiting") == 3
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.25        # a fraction, as vLLM's
    assert value(samples, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(samples, "vllm:prefix_cache_queries_total") == 16
    assert value(samples, "vllm:prefix_cache_hits_total") == 7
    assert value(samples, "vllm:gpu_prefix_cache_queries_total") == 16
    assert value(samples, "vllm:gpu_prefix_cache_hits_total") == 7
    assert value(samples, "vllm:prompt_tokens_cached_total") == 7
    assert value(samples, "vllm:prompt_tokens_total") == 16
    assert value(samples, "vllm:generation_tokens_total") == 7
    assert value(samples, "vllm:num_preemptions_total") == 3         # memory + fairness
    (info_labels, info), = samples["vllm:cache_config_info"]
    assert info == 1 and info_labels == {"block_size": "1", "num_gpu_blocks": "256",
                                         "enable_prefix_caching": "True", "engine": "0"}
    # what vLLM has no name for stays radixserve:, and all of ours is still there
    assert value(samples, "radixserve:num_running_reqs", model_name="fake-model") == 0
    assert value(samples, "radixserve:evictable_tokens") == 32
    assert value(samples, "radixserve:cache_hit_tokens_total") == 7
    assert not any(n.startswith("vllm:") and "evictable" in n for n in samples)
    # no histogram without --enable-metrics
    assert not any("_bucket" in n for n in samples)


def test_vllm_histograms_and_request_success_with_enable_metrics():
    engine = vllm_engine(enable_metrics=True)
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        generate(c, "hello", max_new_tokens=5)
        generate(c, "hello", max_new_tokens=3, stream=True)
        samples, types = scrape(c)
    for n in VLLM_HISTOGRAMS:
        assert types["vllm:" + n] == "histogram", n
        for labels, _ in samples["vllm:" + n + "_count"]:
            assert labels == LABELS
    counts = {n: hist(samples, n, prefix="vllm:")[0] for n in VLLM_HISTOGRAMS}
    assert counts == {"time_to_first_token_seconds": 2, "inter_token_latency_seconds": 4 + 2,
                      "request_time_per_output_token_seconds": 2,
                      "e2e_request_latency_seconds": 2, "request_queue_time_seconds": 2}
    assert types["vllm:request_success"] == "counter"
    assert value(samples, "vllm:request_success_total", finished_reason="length",
                 **LABELS) == 2
    # the histograms are vLLM's only: not observed twice
    assert not any(n.startswith("radixserve:") and n.endswith("_bucket") for n in samples)


def test_other_prefixes_serve_no_vllm_names():
    for prefix in ("radixserve:", "sglang:", "vllm_"):
        engine = CountingEngine(metrics_prefix=prefix, enable_metrics=True)
        with TestClient(create_app(engine), base_url=LOCAL) as c:
            generate(c, "hi")
            samples, _ = scrape(c)
        assert not any(n.startswith("vllm:") for n in samples), prefix
        assert prefix + "num_running_reqs" in samples


def test_cli_flag():
    from radixserve import cli
    ns = cli.build_parser().parse_args(["serve", "--metrics-prefix", "vllm:"])
    assert ServerArgs.from_cli_args(ns).metrics_prefix == "vllm:"
    import dataclasses
    help_ = next(f for f in dataclasses.fields(ServerArgs)
                 if f.name == "metrics_prefix").metadata["help"]
    assert "vllm:num_requests_waiting" in help_


@pytest.mark.parametrize("page_size", [1, 16])
def test_cache_config_info_counts_blocks_of_the_page_size(page_size):
    engine = vllm_engine(page_size=page_size)
    with TestClient(create_app(engine), base_url=LOCAL) as c:
        samples, _ = scrape(c)
    (labels, _), = samples["vllm:cache_config_info"]
    assert labels["block_size"] == str(page_size)
    assert labels["num_gpu_blocks"] == str(256 // page_size)
