"""bench/roofline.py: the ideal schedule's duration of a serving run's arrivals (weights + KV
bytes or FLOPs a step, prefills riding the next step) and the byte counts of a Llama config."""
import pytest

from radixserve.bench.presets import PRESETS
from radixserve.bench.roofline import StepCost, llama_bytes, roofline_duration
from radixserve.bench.server_steps import floor_bound_duration


def test_one_request_without_kv_or_flops_is_the_floor_bound():
    cost = StepCost(weights_s=0.005, kv_s_per_token=0.0, flop_s_per_token=0.0)
    end, steps = roofline_duration([0.25], [100], [40], cost)
    assert steps == 40                       # the prefill step gives the first token
    assert end == pytest.approx(floor_bound_duration([0.25], [40], 0.005))


def test_kv_reads_grow_each_step_by_the_running_contexts():
    # prefill step: nothing running yet, 1.0; then contexts 11 and 12 tokens: 2.1, 2.2
    cost = StepCost(weights_s=1.0, kv_s_per_token=0.1, flop_s_per_token=0.0)
    end, steps = roofline_duration([0.0], [10], [3], cost)
    assert steps == 3 and end == pytest.approx(1.0 + 2.1 + 2.2)


def test_a_long_prompt_is_compute_bound_and_rides_one_step():
    cost = StepCost(weights_s=1.0, kv_s_per_token=0.0, flop_s_per_token=0.01)
    end, steps = roofline_duration([0.0], [1000], [1], cost)
    assert (end, steps) == (pytest.approx(10.0), 1)


def test_arrivals_join_the_next_step_and_share_it():
    # two requests: the second arrives mid-way through the first's second step, so it is
    # prefilled in the third step, beside the first's decode; the idle gap before the first
    # arrival is skipped
    cost = StepCost(weights_s=1.0, kv_s_per_token=0.0, flop_s_per_token=0.0)
    end, steps = roofline_duration([2.0, 3.5], [5, 5], [3, 2], cost)
    # steps end at 3 (prefill A), 4 (A), 5 (A's last + B's prefill), 6 (B's last)
    assert steps == 4 and end == pytest.approx(6.0)
    assert end >= floor_bound_duration([2.0, 3.5], [3, 2], 1.0)


def test_prefill_apart_stalls_the_running_decodes_for_one_step():
    # A (4 tokens) arrives at 0, B (3 tokens) at 1.5, during A's second step
    cost = StepCost(weights_s=1.0, kv_s_per_token=0.0, flop_s_per_token=0.0)
    # mixed: steps end at 1 (A's prefill), 2, 3 (A decodes, B's prefill rides), 4 (A's last),
    # 5 (B's last)
    assert roofline_duration([0.0, 1.5], [5, 5], [4, 3], cost) == (pytest.approx(5.0), 5)
    # apart: 1 (A's prefill), 2, 3 (B's prefill alone: A waits), 4 (both), 5 (both end)
    assert roofline_duration([0.0, 1.5], [5, 5], [4, 3], cost, prefill_apart=True) == \
        (pytest.approx(5.0), 5)
    # with FLOPs the prompt's step costs 2.5 s alone, and A's wait shows in the end time
    slow = StepCost(weights_s=1.0, kv_s_per_token=0.0, flop_s_per_token=0.5)
    mixed = roofline_duration([0.0, 1.5], [5, 5], [4, 3], slow)[0]
    apart = roofline_duration([0.0, 1.5], [5, 5], [4, 3], slow, prefill_apart=True)[0]
    # (B now arrives during A's 2.5 s prefill step)
    # mixed: 2.5 (A's prefill), 5.5 (A's row + B's 5 prompt tokens: 3.0), 6.5, 7.5 (both end)
    # apart: 2.5, 5.0 (B's prefill alone), 6.0, 7.0 (B ends), 8.0 (A ends: it lost a step)
    assert (mixed, apart) == (pytest.approx(7.5), pytest.approx(8.0))


def test_requests_of_at_most_one_token_end_with_their_prefill():
    cost = StepCost(weights_s=1.0, kv_s_per_token=0.5, flop_s_per_token=0.0)
    assert roofline_duration([0.0, 0.0], [7, 9], [0, 1], cost) == (pytest.approx(1.0), 1)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b", "qwen3-8b"])
def test_llama_bytes_counts_the_published_parameters(name):
    preset = PRESETS[name]
    config = preset.config
    mb = llama_bytes(config)
    embedding = config["vocab_size"] * config["hidden_size"]
    # the published count includes the embedding and the norms (under 0.01% of it)
    assert mb.linear_params + embedding == pytest.approx(preset.num_params, rel=1e-4)
    assert mb.streamed_weight_bytes == 2 * mb.linear_params
    head = config["vocab_size"] * config["hidden_size"]
    fp8 = llama_bytes(config, weight_bytes=1, kv_bytes=1)
    assert fp8.streamed_weight_bytes == mb.linear_params + head        # LM head stays bf16
    assert fp8.kv_bytes_per_token * 2 == mb.kv_bytes_per_token


def test_llama_3_1_8b_kv_bytes():
    # 32 layers x (K and V) x 8 kv heads x 128 x 2 bytes
    assert llama_bytes(PRESETS["llama-3.1-8b"].config).kv_bytes_per_token == 131072
