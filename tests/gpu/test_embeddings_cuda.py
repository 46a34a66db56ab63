"""Embeddings on CUDA (issue 40 point 2; tests/unit/test_embeddings.py is the CPU twin): a tiny
random Qwen3 written by transformers, served with is_embedding=True by the scheduler and the
real ModelRunner on the GPU. Last-token and mean pooling of a batch of lengths and of a prompt
prefilled in 16-token chunks equal HF's normalised final hidden states (CPU, fp32): within 1e-4
in fp32, 3e-2 in bf16 (unit vectors of 128 entries); every slot goes home after."""
from __future__ import annotations

import os
import sys
from typing import List

import pytest
import torch

from _gpu import requires_kernels, run_until_done
from radixserve.config import ModelConfig, ServerArgs
from radixserve.engine.pooling import PoolParams
from radixserve.engine.req import Req
from radixserve.engine.scheduler import Scheduler
from radixserve.model.loader import load_model
from radixserve.model.runner import ModelRunner
from radixserve.sampling.params import SamplingParams

# the CPU tests' weight randomizer (O(1) logits)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "unit"))
from test_model_parity import _randomize  # noqa: E402

pytestmark = requires_kernels
VOCAB = 211


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=192,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, tie_word_embeddings=True)
    hf = Qwen3ForCausalLM(cfg).eval()
    _randomize(hf, seed=1)
    path = tmp_path_factory.mktemp("qwen3-embed-cuda")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, str(path)


def _scheduler(path: str, dtype: str, **overrides) -> Scheduler:
    kw = dict(model_path=path, device="cuda", dtype=dtype, max_total_tokens=2048,
              max_running_requests=8, context_length=512, is_embedding=True)
    kw.update(overrides)
    args = ServerArgs(**kw)
    config = ModelConfig.from_path(path)
    model = load_model(path, config, "safetensors", args.resolved_dtype(), torch.device("cuda"))
    return Scheduler(args, ModelRunner(args, config, path, context_len=512, model=model))


def _ids(n: int, seed: int) -> List[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _expected(hf, ids: List[int], method: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].float()      # [len, hidden]
    return torch.nn.functional.normalize(h[-1] if method == "last" else h.mean(0), dim=0)


def _pool_all(sched: Scheduler, prompts: List[List[int]], method: str) -> List[torch.Tensor]:
    outputs = []
    reqs = [Req(f"r{k}", p, SamplingParams(max_new_tokens=0, temperature=0.0), 0,
                pool=PoolParams(method), sink=outputs.append) for k, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    run_until_done(sched, limit=200)
    final = {o.rid: o for o in outputs if o.finished}
    return [torch.tensor(final[r.rid].embedding) for r in reqs]


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 3e-2)])
@pytest.mark.parametrize("method", ["last", "mean"])
def test_pooled_embeddings_match_hf(tiny, dtype, atol, method):
    hf, path = tiny
    prompts = [_ids(n, seed) for seed, n in enumerate((13, 5, 29, 1, 8))]
    got = _pool_all(_scheduler(path, dtype), prompts, method)
    for p, g in zip(prompts, got):
        assert (g - _expected(hf, p, method)).abs().max().item() < atol
    chunked = _pool_all(_scheduler(path, dtype, chunked_prefill_size=16), [_ids(45, 7)], method)
    assert (chunked[0] - _expected(hf, _ids(45, 7), method)).abs().max().item() < atol
