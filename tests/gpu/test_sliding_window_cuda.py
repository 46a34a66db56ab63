"""Sliding windows and soft-capping served on CUDA (issue 40 point 1), end to end through the
scheduler and the real ModelRunner: tiny random Mistral (a window on every layer), Gemma 3
(interleaved local / global layers, two rope bases) and Gemma 2 (attention and final-logit
soft-capping), written by transformers (tests/unit/test_sliding_window.py builds them).

  * fp32: greedy outputs equal HF's greedy (CPU, fp32) on prompts of 3.75 windows, prefilled in
    5-token chunks, with a second prompt reusing 26 tokens (> 3 windows) from the radix cache,
    and the two decoded side by side with a short third request. fp32 attention runs the torch
    reference on any device (the kernels take bf16/fp16).
  * bf16, context longer than the window: Gemma 2's soft-cap keeps CUDA graphs off (the
    reference is not capturable; model/cuda_graph_runner.py's docstring) and it still serves;
    Mistral and Gemma 3 decode in CUDA graphs (the decode kernel takes the window) with the
    eager runner's outputs.
  * bf16, context no longer than the window (Mistral, Gemma 3): the window hides nothing, so
    the kernels and CUDA graphs serve every layer (ForwardBatch.max_seq_len), with the same
    outputs as the eager runner.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List, Sequence

import pytest
import torch

from _gpu import requires_kernels, run_until_done
from radixserve.config import ModelConfig, ServerArgs
from radixserve.engine.req import Req
from radixserve.engine.scheduler import Scheduler
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from radixserve.sampling.params import SamplingParams

# the tiny models and HF oracles live beside the CPU tests
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "unit"))
import test_sliding_window as sw  # noqa: E402
from test_model_parity import _randomize  # noqa: E402

pytestmark = requires_kernels


@pytest.fixture(scope="module", params=sorted(sw.TINY))
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = sw.TINY[request.param](head_dim=64).eval()     # a head_dim the kernels take
    _randomize(hf, seed=1)
    path = sw._write(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, ModelConfig.from_path(path), path


def _scheduler(path: str, config: ModelConfig, dtype: str, **overrides) -> Scheduler:
    kw = dict(model_path=path, device="cuda", dtype=dtype, max_total_tokens=512,
              max_running_requests=4, context_length=128, chunked_prefill_size=5, random_seed=0)
    kw.update(overrides)
    args = ServerArgs(**kw)
    model = load_model(path, config, "safetensors", args.resolved_dtype(), torch.device("cuda"))
    runner = ModelRunner(args, config, path, context_len=args.context_length, model=model)
    return Scheduler(args, runner)


def _greedy(rid: str, prompt: Sequence[int], n: int) -> Req:
    return Req(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0,
                                                 ignore_eos=True), n)


def _run(sched: Scheduler, reqs: List[Req]) -> None:
    for r in reqs:
        sched.add_request(r)
    run_until_done(sched)


def test_fp32_greedy_matches_hf_with_chunks_and_radix_reuse(tiny):
    _, hf, config, path = tiny
    sched = _scheduler(path, config, "float32")
    prompt_a = sw._seq(config, 30, 11)
    prompt_b = prompt_a[:26] + sw._seq(config, 6, 12)
    n = 12
    a = _greedy("a", prompt_a, n)
    _run(sched, [a])
    b, c = _greedy("b", prompt_b, n), _greedy("c", sw._seq(config, 5, 13), n)
    _run(sched, [b, c])                                 # decoded side by side
    assert a.cached_tokens == 0 and b.cached_tokens >= 25 > 3 * sw.WINDOW
    outputs: Dict[str, List[int]] = {r.rid: list(r.output_ids) for r in (a, b, c)}
    for r in (a, b, c):
        assert outputs[r.rid] == sw._hf_greedy(hf, r.origin_input_ids, n), r.rid


def test_bf16_windowed_context_keeps_graphs_unless_soft_capped(tiny, caplog):
    """Context longer than the window. Gemma 2 (soft-capped) captures no CUDA graphs and still
    serves. Mistral and Gemma 3 capture them (the decode kernel takes the window), and their
    replayed greedy outputs equal the eager runner's: windowed prefill on the reference in
    both, windowed decode on the kernel in both."""
    name, _, config, path = tiny
    with caplog.at_level("WARNING", logger="radixserve.model.runner"):
        fast = _scheduler(path, config, "bfloat16")
    prompts = [sw._seq(config, 20 + i, 20 + i) for i in range(3)]
    got = [_greedy(f"g{i}", p, 10) for i, p in enumerate(prompts)]
    if name == "gemma2":
        assert fast.runner.graph_runner is None
        assert any("CUDA graphs off" in r.getMessage() for r in caplog.records)
        _run(fast, got)
        assert all(len(r.output_ids) == 10 for r in got)
        return
    assert fast.runner.graph_runner is not None
    eager = _scheduler(path, config, "bfloat16", disable_cuda_graph=True)
    want = [_greedy(f"e{i}", p, 10) for i, p in enumerate(prompts)]
    _run(eager, want)
    _run(fast, got)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_bf16_window_as_long_as_the_context_takes_the_kernels(tiny):
    name, _, config, path = tiny
    if name == "gemma2":
        pytest.skip("Gemma 2's soft-capping keeps the reference whatever the context")
    context = sw.WINDOW - 1                  # every request's KV fits in the window
    eager = _scheduler(path, config, "bfloat16", context_length=context,
                       disable_cuda_graph=True)
    fast = _scheduler(path, config, "bfloat16", context_length=context)
    assert eager.runner.graph_runner is None and fast.runner.graph_runner is not None
    prompts = [sw._seq(config, 3, 30 + i) for i in range(3)]
    want = [_greedy(f"e{i}", p, 4) for i, p in enumerate(prompts)]
    got = [_greedy(f"g{i}", p, 4) for i, p in enumerate(prompts)]
    _run(eager, want)
    _run(fast, got)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
