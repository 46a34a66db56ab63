"""radixserve.bench.offline (`radixserve bench offline`): --engine-arg reaches the engine, and
--hf-mode none writes the engine's numbers alone."""
import json

import pytest

from radixserve.bench import offline


def test_engine_args_parse_to_typed_values():
    args = offline.parse_args(["--engine-arg", "enable_mixed_chunk=true",
                               "--engine-arg", "chunked_prefill_size=16384",
                               "--engine-arg", "schedule_conservativeness=0.5",
                               "--engine-arg", "schedule_policy=lpm",
                               "--engine-arg", "disable_radix_cache=False"])
    assert args.engine_args == {"enable_mixed_chunk": True, "chunked_prefill_size": 16384,
                                "schedule_conservativeness": 0.5, "schedule_policy": "lpm",
                                "disable_radix_cache": False}
    assert offline.parse_args([]).engine_args == {}


@pytest.mark.parametrize("bad", ["enable_mixed_chunk", "=3", ""])
def test_engine_arg_without_a_name_and_value_is_a_usage_error(bad):
    with pytest.raises(SystemExit):
        offline.parse_args(["--engine-arg", bad])


SMALL = ["--num-prompts", "2", "--input-len", "8", "--output-len", "3", "--hf-mode", "none"]


def test_engine_only_run_records_its_engine_args(tmp_path):
    out = tmp_path / "r.json"
    offline.main(SMALL + ["--engine-arg", "enable_mixed_chunk=true",
                          "--engine-arg", "chunked_prefill_size=4", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["engine_args"] == {"enable_mixed_chunk": True, "chunked_prefill_size": 4}
    assert r["radixserve_tok_per_s"] > 0 and r["radixserve_s"] > 0
    assert r["hf_tok_per_s"] is None and r["ratio"] is None
    # where the time went: 16 prompt tokens in chunks of at most 4 are at least 4 extend steps,
    # and the steps' device seconds (the worker thread's, on the CPU) fit inside the wall time
    steps = r["radixserve_steps"]
    assert steps["prefill_steps"] >= 4 and steps["extend_device_s"] > 0
    assert 0 < steps["device_busy"] <= 1.0
    # the CPU has no step events: no idle gaps are measured there
    assert steps["idle_before_decode_s"] == 0 and steps["idle_before_extend_s"] == 0
    assert steps["gc_pause_s"] >= 0 and steps["gc_full_collections"] >= 0


def test_an_unknown_engine_arg_reaches_the_engine_and_is_refused():
    with pytest.raises(TypeError):
        offline.main(SMALL + ["--engine-arg", "no_such_setting=1"])
