"""The acceptance of `radixserve bench serving` (issue 14): the same command, --backend
completions, against radixserve and against a stand-in OpenAI-compatible server (the test double
of tests/unit/test_bench_standin.py) writes JSONL lines with the same keys, SGLang's among them,
and numbers that add up; the stand-in is asked for no radixserve-only route (nor /metrics:
server_steps is radixserve's alone)."""
import importlib.util
import json
import os
import sys

import pytest

from radixserve import cli

pytestmark = pytest.mark.slow

_PATH = os.path.join(os.path.dirname(__file__), "..", "unit", "test_bench_standin.py")
_spec = importlib.util.spec_from_file_location("bench_standin_double", _PATH)
double = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = double
_spec.loader.exec_module(double)

# the tiny workload: 4 prompts x 8 input tokens x 4 output tokens (fixed lengths)
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 8, 4
WORKLOAD = ["--backend", "completions", "--dataset", "random", "--num-prompts", str(NUM_PROMPTS),
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--random-range-ratio", "1.0", "--no-plots"]


@pytest.fixture
def standin():
    s = double.StandIn()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _line(path):
    with open(path) as f:
        [line] = [json.loads(x) for x in f]
    return line


def test_same_keys_against_radixserve_and_a_stand_in(server, standin, tmp_path):
    ours, peer = str(tmp_path / "radixserve.jsonl"), str(tmp_path / "standin.jsonl")
    # radixserve: the vocabulary size comes from its /v1/models card
    assert cli.main(["bench", "serving", "--base-url", server.url, *WORKLOAD,
                     "--output-file", ours]) == 0
    assert cli.main(["bench", "serving", "--base-url", standin.url, *WORKLOAD,
                     "--vocab-size", str(double.VOCAB), "--output-file", peer]) == 0
    a, b = _line(ours), _line(peer)
    assert set(a) == set(b)
    assert double.SGLANG_KEYS <= set(a)
    assert set(standin.routes) <= double.OPENAI_ROUTES
    for line, model in ((a, server.model), (b, double.MODEL)):
        assert line["model"] == model and line["backend"] == "completions"
        assert line["completed"] == NUM_PROMPTS and line["failed"] == 0
        assert line["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
        assert line["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN    # EOS ignored
        assert line["mean_ttft_ms"] > 0 and line["mean_e2e_latency_ms"] >= line["mean_ttft_ms"]
        assert line["output_throughput"] == pytest.approx(
            line["total_output_tokens"] / line["duration"])
    # radixserve's own step counters over the run (bench/server_steps.py); none from the peer
    steps = a["server_steps"]
    assert b["server_steps"] is None
    assert steps["generation_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert steps["decode_steps"] >= OUTPUT_LEN - 1 and steps["prefill_steps"] >= 1
    assert steps["decode_device_s"] > 0 and steps["extend_device_s"] > 0
    assert 0 < steps["device_busy"] < 1.5 and steps["mean_decode_step_ms"] > 0
    # the host threads' CPU clocks advanced over the run (no bound against wall time: that
    # would be a timed assertion)
    assert steps["loop_cpu_s"] > 0 and steps["forward_cpu_s"] > 0
    assert steps["loop_cpu_us_per_token"] == pytest.approx(
        1e6 * steps["loop_cpu_s"] / steps["generation_tokens"])
    server.wait_idle()
