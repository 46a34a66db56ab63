"""bench/serving.py's arguments, JSON and ratios, and bench/plots.py, without a server."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import serving  # noqa: E402


def _metrics(out_tps, ttft_ms, itl_ms):
    """A RequestResult-summarized run of 3 requests with the given TTFT and constant ITL."""
    results = [serving.RequestResult(success=True, prompt_len=10, output_len=4, ttft=t / 1e3,
                                     latency=(t + 3 * itl_ms) / 1e3, itl=[itl_ms / 1e3] * 3)
               for t in ttft_ms]
    m = serving.summarize(results, duration=12.0 / out_tps)
    return m


def test_compare_takes_a_value_and_stays_backwards_compatible():
    assert serving.parse_args(["--compare"]).compare == "radix"
    assert serving.parse_args(["--compare", "--dataset", "random"]).compare == "radix"
    a = serving.parse_args(["--compare", "overlap"])
    assert a.compare == "overlap" and a.launch
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
    assert m["output_token_throughput"] == pytest.approx(10.0)


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
        assert r["output_token_throughput"] == pytest.approx(2.0)
        assert r["mean_ttft_speedup"] == pytest.approx(2.0)
        assert r["mean_itl_speedup"] == pytest.approx(2.0)
    runs = {name: pts[0] for name, pts in sweep.items()}
    once = serving.compare_ratios("overlap", runs, {})["overlap_over_no_overlap"]
    assert once["request_throughput"] == pytest.approx(2.0)


def test_plots_are_written_next_to_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    import plots

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
