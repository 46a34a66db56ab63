"""radixserve.bench.serving's arguments, JSON, JSONL lines and ratios, and
radixserve.bench.plots, without a server."""
import json
import os

import pytest

from radixserve.bench import metrics, plots, serving


def _metrics(out_tps, ttft_ms, itl_ms):
    """A RequestResult-summarized run of 3 requests with the given TTFT and constant ITL."""
    results = [serving.RequestResult(success=True, prompt_len=10, output_len=4, ttft=t / 1e3,
                                     latency=(t + 3 * itl_ms) / 1e3, itl=[itl_ms / 1e3] * 3)
               for t in ttft_ms]
    return serving.summarize(results, duration=12.0 / out_tps)


def test_compare_takes_a_value_and_stays_backwards_compatible():
    assert serving.parse_args(["--compare"]).compare == "radix"
    assert serving.parse_args(["--compare", "--dataset", "random"]).compare == "radix"
    a = serving.parse_args(["--compare", "overlap"])
    assert a.compare == "overlap" and a.launch
    # every ratio of every set names two of the set's configurations
    for name, pairs in serving.COMPARE_PAIRS.items():
        configs = [c for c, _ in serving.COMPARE_SETS[name]]
        assert all(this in configs and peer in configs for _, this, peer in pairs), name
    assert serving.parse_args(["--compare", "schedule"]).compare == "schedule"
    assert serving.parse_args([]).compare is None and not serving.parse_args([]).launch
    with pytest.raises(SystemExit):
        serving.parse_args(["--compare", "bogus"])


def test_preset_implies_launch_and_sweep_parses():
    a = serving.parse_args(["--preset", "smollm2-135m", "--sweep-concurrency", "1,2,4,256"])
    assert a.launch and a.sweep_concurrency == [1, 2, 4, 256]
    for bad in (["--preset", "gpt-5"], ["--sweep-concurrency", "0,2"],
                ["--sweep-concurrency", "a"]):
        with pytest.raises(SystemExit):
            serving.parse_args(bad)


def test_summary_keeps_per_request_lists():
    m = _metrics(10.0, [100.0, 200.0, 300.0], 5.0)
    per = m["per_request"]
    assert per["ttft_ms"] == [100.0, 200.0, 300.0]
    assert per["itl_ms"] == [[5.0] * 3] * 3
    assert per["output_len"] == [4, 4, 4]
    assert m["output_throughput"] == pytest.approx(10.0)


def test_to_json_is_json_and_keeps_series_on_one_line():
    obj = {"a": {"xs": [1.5, 2, 3], "nested": [[1, 2], [3]], "pts": [{"c": 1}, {"c": 2}]},
           "empty": [], "none": None}
    text = serving.to_json(obj)
    assert json.loads(text) == obj
    assert '"xs": [1.5, 2, 3]' in text and '"nested": [[1, 2], [3]]' in text


def test_overlap_ratios_per_sweep_level():
    sweep = {"overlap": [{"max_concurrency": c, **_metrics(20.0 * c, [100.0] * 3, 5.0)}
                         for c in (1, 2)],
             "no-overlap": [{"max_concurrency": c, **_metrics(10.0 * c, [200.0] * 3, 10.0)}
                            for c in (1, 2)]}
    ratios = serving.compare_ratios("overlap", {}, sweep)["overlap_over_no_overlap"]
    assert [r["max_concurrency"] for r in ratios] == [1, 2]
    for r in ratios:
        assert r["output_throughput"] == pytest.approx(2.0)
        assert r["mean_ttft_speedup"] == pytest.approx(2.0)
        assert r["mean_itl_speedup"] == pytest.approx(2.0)
    runs = {name: pts[0] for name, pts in sweep.items()}
    once = serving.compare_ratios("overlap", runs, {})["overlap_over_no_overlap"]
    assert once["request_throughput"] == pytest.approx(2.0)


def test_plots_are_written_next_to_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    sweep = {name: [{"max_concurrency": c, **_metrics(scale * c, [100.0 * c] * 3, 5.0 * c)}
                    for c in (1, 2, 4)] for name, scale in (("overlap", 20.0), ("no-overlap", 10.0))}
    result = {"args": {"preset": "llama-3.1-8b", "dataset": "random"}, "sweep": sweep}
    out = str(tmp_path / "run.json")
    paths = plots.write_plots(result, out)
    assert sorted(os.path.basename(p) for p in paths) == ["run-latency-cdf.png", "run-throughput.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    series, caption = plots.latency_series(result)
    assert set(series) == {"overlap", "no-overlap"} and caption == "max concurrency 4"
    # a result without a sweep: only the CDFs
    single = {"metrics": sweep["overlap"][0]}
    assert [os.path.basename(p) for p in plots.write_plots(single, str(tmp_path / "one.json"))] \
        == ["one-latency-cdf.png"]


def test_summary_has_sglang_names_and_values():
    """3 requests of 4 tokens, TTFT 100/200/300 ms, ITL 5 ms, over 1.2 s."""
    m = _metrics(10.0, [100.0, 200.0, 300.0], 5.0)
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 12
    assert m["duration"] == pytest.approx(1.2)
    assert m["request_throughput"] == pytest.approx(2.5)
    assert m["input_throughput"] == pytest.approx(25.0)
    assert m["total_throughput"] == pytest.approx(35.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["mean_itl_ms"] == pytest.approx(5.0) and m["max_itl_ms"] == pytest.approx(5.0)
    assert m["mean_tpot_ms"] == pytest.approx(5.0)                # (latency - ttft) / 3
    assert m["mean_e2e_latency_ms"] == pytest.approx(215.0)
    assert m["concurrency"] == pytest.approx(0.645 / 1.2)         # sum of latencies / duration
    # an empty run: zeros, as SGLang writes them, not NaN
    empty = serving.summarize([serving.RequestResult(failure="http_status", error="HTTP 500")],
                              duration=1.0)
    assert empty["completed"] == 0 and empty["failed"] == 1
    assert empty["mean_ttft_ms"] == 0.0 and empty["p99_itl_ms"] == 0.0
    assert empty["failure_reasons"] == {"http_status": 1}
    assert empty["error_samples"] == ["http_status: HTTP 500"]


def test_failures_are_counted_per_reason_with_the_first_line_of_one_error_each():
    R = serving.RequestResult
    results = [R(success=True, output_len=4, ttft=0.1, latency=0.2),
               R(failure="abort", error="finish reason b"),
               R(failure="abort", error="finish reason a\nsecond line"),
               R(failure="truncated", error="the stream ended without a finish reason"),
               R(error="an older result without a reason")]
    m = serving.summarize(results, duration=1.0)
    assert m["completed"] == 1 and m["failed"] == 4
    assert m["failure_reasons"] == {"abort": 2, "error": 1, "truncated": 1}
    assert m["error_samples"] == ["abort: finish reason a",
                                  "error: an older result without a reason",
                                  "truncated: the stream ended without a finish reason"]
    assert m["total_output_tokens"] == 4                  # numbers over the successful ones
    result = {"sweep": {"a": [m, m]}, "runs": {}}
    assert serving.failures(result) == {"abort": 4, "error": 2, "truncated": 2}
    assert serving.failures({"metrics": serving.summarize(results[:1], 1.0)}) == {}


# SGLang's published H200 serving config: --dataset-name random --request-rate 16
# --num-prompts 200 --random-input-len 1024 --random-output-len 1024 (seed 1, range ratio 0.0)
SGLANG_H200 = ["--dataset", "random", "--request-rate", "16", "--num-prompts", "200",
               "--random-input-len", "1024", "--random-output-len", "1024"]
# the first gaps SGLang's get_request sleeps for that config: np.random.seed(1), the two
# randint calls of sample_random_requests, then np.random.exponential(1 / 16) per request
SGLANG_H200_GAPS = [0.0044154445182950945, 0.0296683309678502, 0.005185953389237671,
                    0.2539900859260264, 0.012526235466412064]


def test_random_lengths_and_gaps_are_sglangs_for_the_same_seed():
    from radixserve.bench import workloads
    args = serving.parse_args(SGLANG_H200)
    assert args.random_range_ratio == 0.0 and args.seed == 1        # SGLang's defaults
    requests, _ = workloads.build_workload(args, vocab_size=1000)
    assert sum(len(r.prompt_ids) for r in requests) == 103_005
    assert sum(r.output_len for r in requests) == 105_408
    assert [r.gap for r in requests[:5]] == pytest.approx(SGLANG_H200_GAPS, rel=1e-12)
    assert all(1 <= len(r.prompt_ids) <= 1024 and 0 <= r.output_len <= 1024 for r in requests)
    assert all(100 <= t < 1000 for r in requests for t in r.prompt_ids)
    d = workloads.describe(args, (requests, None))
    assert (d["num_requests"], d["total_input_tokens"], d["total_output_tokens"]) == \
        (200, 103_005, 105_408)
    assert workloads.describe_line(d).startswith(
        "workload: random, 200 requests, 103,005 input / 105,408 output tokens; lengths as "
        "SGLang's bench_serving draws them (range ratio 0.0, seed 1)")
    fixed = serving.parse_args(SGLANG_H200 + ["--random-range-ratio", "1.0"])
    requests, _ = workloads.build_workload(fixed, vocab_size=1000)
    assert [len(r.prompt_ids) for r in requests] == [1024] * 200
    assert [r.output_len for r in requests] == [1024] * 200
    inf = serving.parse_args(SGLANG_H200[:2] + SGLANG_H200[4:])      # no --request-rate
    assert all(r.gap == 0.0 for r in workloads.build_workload(inf, vocab_size=1000)[0])


def test_arrivals_wait_each_gap_but_not_after_the_last(monkeypatch):
    import asyncio
    from radixserve.bench import workloads
    slept = []

    async def sleep(seconds):
        slept.append(seconds)
    monkeypatch.setattr(serving.asyncio, "sleep", sleep)
    items = [workloads.BenchRequest([1], 1, gap=g) for g in (0.5, 0.25, 0.125)]

    async def arrivals():
        return [item async for item in serving.Runner._arrivals(items)]
    assert asyncio.run(arrivals()) == items
    assert slept == [0.5, 0.25]


def _result(**extra):
    args = vars(serving.parse_args(["--dataset", "random", "--max-concurrency", "8"]))
    return {"command": "radixserve bench serving --dataset random", "args": metrics.finite(args),
            "time": "t", "source": {"commit": None}, "server": {"model": "m"}, **extra}


def test_run_lines_one_per_run_with_ratios_on_the_first_of_a_pair():
    fast, slow = _metrics(20.0, [100.0] * 3, 5.0), _metrics(10.0, [200.0] * 3, 10.0)
    one = serving.run_lines(_result(metrics=fast))
    assert len(one) == 1 and one[0]["max_concurrency"] == 8 and one[0]["config"] == "default"
    assert one[0]["request_rate"] == "inf" and one[0]["dataset_name"] == "random"
    assert "per_request" not in one[0] and one[0]["model"] == "m"
    json.dumps(one[0], allow_nan=False)                          # strict JSON
    runs = {"overlap": fast, "no-overlap": slow}
    result = _result(runs=runs, ratios=serving.compare_ratios("overlap", runs, {}))
    result["args"]["compare"] = "overlap"
    lines = serving.run_lines(result)
    assert [line["config"] for line in lines] == ["overlap", "no-overlap"]
    assert lines[0]["ratios"]["overlap_over_no_overlap"]["output_throughput"] == pytest.approx(2.0)
    assert "ratios" not in lines[1]
    sweep = {"overlap": [{"max_concurrency": c, "num_requests": 3, **fast} for c in (1, 2)],
             "no-overlap": [{"max_concurrency": c, "num_requests": 3, **slow} for c in (1, 2)]}
    result = _result(sweep=sweep, ratios=serving.compare_ratios("overlap", {}, sweep))
    result["args"]["compare"] = "overlap"
    lines = serving.run_lines(result)
    assert [(x["config"], x["max_concurrency"]) for x in lines] == [
        ("overlap", 1), ("overlap", 2), ("no-overlap", 1), ("no-overlap", 2)]
    assert lines[1]["ratios"]["overlap_over_no_overlap"]["max_concurrency"] == 2


def test_flush_cache_default_follows_the_server_and_backend():
    def flush(*argv, launched=False):
        return serving.wants_flush(serving.parse_args(list(argv)), launched)
    assert flush() and flush("--backend", "completions", launched=True)
    assert not flush("--backend", "completions") and not flush("--backend", "chat")
    assert flush("--backend", "completions", "--flush-cache")
    assert not flush("--no-flush-cache", launched=True)


def test_plots_read_results_written_with_the_old_key_names(tmp_path):
    pytest.importorskip("matplotlib")
    old = {"sweep": {"default": [{"max_concurrency": c, "output_token_throughput": 10.0 * c}
                                 for c in (1, 2)]}}
    paths = plots.write_plots(old, str(tmp_path / "old.json"))
    assert [os.path.basename(p) for p in paths] == ["old-throughput.png"]


METRICS_TEXT = """# HELP {p}num_decode_steps_total Decode steps run
# TYPE {p}num_decode_steps counter
{p}num_decode_steps_total{{model_name="m"}} {decode}
{p}num_prefill_steps_total{{model_name="m"}} 4.0
{p}decode_device_seconds_total{{model_name="m"}} {dev}
{p}extend_device_seconds_total{{model_name="m"}} 0.5
{p}device_idle_before_decode_seconds_total{{model_name="m"}} 0.25
{p}device_idle_before_extend_seconds_total{{model_name="m"}} 0.0
{p}generation_tokens_total{{model_name="m"}} {tokens}
{p}loop_thread_cpu_seconds_total{{model_name="m"}} {loop}
{p}num_running_reqs{{model_name="m"}} 3.0
"""


@pytest.mark.parametrize("prefix", ["radixserve:", "sglang:"])
def test_server_steps_are_the_counters_deltas_over_the_run(prefix):
    from radixserve.bench import server_steps
    before = server_steps.parse(METRICS_TEXT.format(p=prefix, decode=10.0, dev=1.0, tokens=40.0,
                                                    loop=7.0))
    after = server_steps.parse(METRICS_TEXT.format(p=prefix, decode=110.0, dev=3.0, tokens=840.0,
                                                   loop=7.04))
    assert before["decode_steps"] == 10.0 and before["idle_before_decode_s"] == 0.25
    d = server_steps.over_run(before, after, duration=4.0)
    assert d["decode_steps"] == 100 and d["prefill_steps"] == 0 and d["generation_tokens"] == 800
    assert d["decode_device_s"] == pytest.approx(2.0) and d["extend_device_s"] == 0.0
    assert d["device_busy"] == pytest.approx(0.5)
    assert d["mean_decode_step_ms"] == pytest.approx(20.0)
    assert d["tokens_per_decode_step"] == pytest.approx(8.0)
    assert d["loop_cpu_s"] == pytest.approx(0.04) and "forward_cpu_s" not in d
    assert d["loop_cpu_us_per_token"] == pytest.approx(50.0)
    # the host counters are optional: without them the account has the rest
    no_host = "\n".join(line for line in METRICS_TEXT.format(p=prefix, decode=1, dev=1, tokens=1,
                                                             loop=1).splitlines()
                        if "loop_thread" not in line)
    assert "loop_cpu_s" not in server_steps.parse(no_host)
    assert "loop_cpu_us_per_token" not in server_steps.over_run(server_steps.parse(no_host),
                                                                after, 4.0)
    # a server without one of the counters (another engine), or a failed scrape: no account
    partial = "\n".join(line for line in METRICS_TEXT.format(p=prefix, decode=1, dev=1, tokens=1,
                                                             loop=1)
                        .splitlines() if "decode_device" not in line)
    assert server_steps.parse(partial) is None
    assert server_steps.over_run(before, None, 4.0) is None


class _Blocks:
    """A stand-in for an aiohttp response: .content.iter_any() yields the given byte blocks."""

    def __init__(self, blocks):
        self.content = self
        self.blocks = blocks

    async def iter_any(self):
        for b in self.blocks:
            yield b


def _read(blocks, backend="generate"):
    import asyncio
    from radixserve.bench import backends
    res, state = backends.RequestResult(), {}
    ok = asyncio.run(backends._read(_Blocks(blocks), backends.BACKENDS[backend], res, state,
                                    start=0.0))
    return ok, res, state


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_sse_reader_splits_lines_across_blocks_without_a_length_limit(eol):
    """Events split anywhere across network blocks, one line of 300k cumulative ids (past any
    reader's line limit), comment and blank lines, LF or CRLF line ends; chunks that add no ids
    are not counted."""
    import orjson
    events = [{"output_ids": [7]}, {"output_ids": [7]},           # the second adds nothing
              {"output_ids": list(range(300_000)), "meta_info": {"completion_tokens": 300_000}}]
    stream = b": comment" + eol + eol
    stream += b"".join(b"data: " + orjson.dumps(e) + eol + eol for e in events)
    stream += b"data: [DONE]" + eol + eol
    blocks = [stream[i:i + 4093] for i in range(0, len(stream), 4093)]
    ok, res, state = _read(blocks)
    assert ok and res.num_chunks == 2 and len(res.output_ids) == 300_000 and len(res.itl) == 1
    assert res.ttft > 0 and state["meta"]["completion_tokens"] == 300_000


def test_sse_reader_stops_at_an_error_chunk():
    ok, res, _ = _read([b'data: {"output_ids": [1]}\n\ndata: {"error": {"message": "boom"}}\n\n',
                        b'data: {"output_ids": [1, 2]}\n\n'])
    assert not ok and "boom" in res.error and res.num_chunks == 1


ROWS_TEXT = """\
radixserve:decode_row_device_seconds_total{{model_name="m"}} {rows_s}
radixserve:decode_rows_total{{model_name="m"}} {rows}
radixserve:weight_floor_seconds{{model_name="m"}} 0.005
"""


def test_latency_ratios_from_decode_rows_weight_floor_and_send_times():
    """Issue 33's two ratios: median ITL over the decode step per token (row-weighted), and the
    duration over max(send time + output tokens x weight floor)."""
    from radixserve.bench import server_steps
    from radixserve.bench.backends import RequestResult
    from radixserve.bench.metrics import summarize
    base = METRICS_TEXT.format(p="radixserve:", decode=10.0, dev=1.0, tokens=40.0, loop=7.0)
    before = server_steps.parse(base + ROWS_TEXT.format(rows_s=1.0, rows=100))
    after = server_steps.parse(base.replace("} 10.0", "} 20.0") + ROWS_TEXT.format(
        rows_s=1.0 + 0.008 * 400, rows=500))
    d = server_steps.over_run(before, after, duration=4.0)
    assert d["decode_rows"] == 400
    assert d["decode_step_per_token_ms"] == pytest.approx(8.0)
    assert d["weight_floor_ms"] == pytest.approx(5.0)
    # three requests sent at t0 + 0, 1, 2 s wanting 100, 300, 10 tokens: the floor-bound end is
    # max(0 + 0.5, 1 + 1.5, 2 + 0.05) = 2.5 s
    t0 = 50.0
    results = [RequestResult(success=True, output_len=n, start=t0 + a, ttft=0.1, latency=1.0,
                             itl=[0.009, 0.010, 0.011])
               for a, n in ((0.0, 100), (1.0, 300), (2.0, 10))]
    m = summarize(results, duration=3.0, t0=t0)
    assert m["per_request"]["arrival_s"] == [0.0, 1.0, 2.0]
    r = server_steps.latency_ratios(m, d)
    assert r["floor_bound_duration_s"] == pytest.approx(2.5)
    assert r["duration_over_floor_bound"] == pytest.approx(3.0 / 2.5)
    assert r["median_itl_over_decode_step"] == pytest.approx(10.0 / 8.0)
    # a CPU server (weight floor 0) and one without the row counters: no ratios, no error
    cpu = server_steps.parse(base + ROWS_TEXT.format(rows_s=1.0, rows=100).replace("0.005", "0"))
    assert "weight_floor_ms" not in server_steps.over_run(cpu, cpu, 4.0)
    old = server_steps.over_run(server_steps.parse(base), server_steps.parse(base), 4.0)
    assert server_steps.latency_ratios(m, old) == {}


def test_memory_bound_duration_from_the_servers_weight_and_kv_bytes():
    """With the server's streamed weight bytes and KV bytes per token on /metrics, the run's
    schedule on the ideal server that also reads every running request's KV (roofline.py,
    memory traffic only): one request of 100 prompt and 3 output tokens, weight floor 5 ms over
    1e9 bytes, so each cached token costs 1e6 bytes x 5e-12 s."""
    from radixserve.bench import server_steps
    from radixserve.bench.backends import RequestResult
    from radixserve.bench.metrics import summarize
    base = METRICS_TEXT.format(p="radixserve:", decode=10.0, dev=1.0, tokens=40.0, loop=7.0)
    gauges = ROWS_TEXT.format(rows_s=1.0, rows=100) + (
        'radixserve:streamed_weight_bytes{model_name="m"} 1e9\n'
        'radixserve:kv_cache_bytes_per_token{model_name="m"} 1e6\n')
    d = server_steps.over_run(server_steps.parse(base + gauges),
                              server_steps.parse(base + gauges), duration=0.02)
    assert (d["streamed_weight_bytes"], d["kv_bytes_per_token"]) == (10 ** 9, 10 ** 6)
    m = summarize([RequestResult(success=True, prompt_len=100, output_len=3, start=7.0,
                                 ttft=0.005, latency=0.016, itl=[0.005, 0.005])],
                  duration=0.02, t0=7.0)
    assert m["per_request"]["input_len"] == [100]
    r = server_steps.latency_ratios(m, d)
    # the prefill step reads the weights (5 ms), then 2 decode steps over 101 and 102 cached
    # tokens: 5 ms + 0.505 ms, 5 ms + 0.51 ms
    assert r["memory_bound_duration_s"] == pytest.approx(0.005 + 0.005505 + 0.00551)
    assert r["duration_over_memory_bound"] == pytest.approx(0.02 / 0.016015)
    assert r["floor_bound_duration_s"] == pytest.approx(0.015)
    # a server without the byte gauges: the floor bound alone
    plain = server_steps.over_run(server_steps.parse(base + ROWS_TEXT.format(rows_s=1.0, rows=100)),
                                  server_steps.parse(base + ROWS_TEXT.format(rows_s=1.0, rows=100)),
                                  duration=0.02)
    assert "memory_bound_duration_s" not in server_steps.latency_ratios(m, plain)
