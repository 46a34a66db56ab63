"""How the runner sizes the KV pool on a GPU (ModelRunner._kv_pool_tokens), with the device's
free memory stood in: by default the pool takes --mem-fraction-static's share (0.85) of what the
weights leave, but never so much that a step's peak (model.runner.step_reserve_bytes) would not
fit in the rest. The H100 run of 2026-12-07 (Llama-3.1-70B shape, FP8 weights, FP8 KV; ~11 GB
free after the weights) sized the pool at 0.85 of that and 199 of 200 requests died of CUDA out
of memory in prefill."""
import types

import pytest
import torch

from radixserve.config import ModelConfig, ServerArgs
from radixserve.model.runner import (FIXED_STEP_RESERVE, GPU_MEM_FRACTION, ModelRunner,
                                     step_reserve_bytes)

GB = 10 ** 9


def _config(hidden, inter, heads, kv_heads, layers, vocab=128256) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=128, rms_norm_eps=1e-5,
                       rope_theta=5e5, rope_scaling=None, max_position_embeddings=131072,
                       tie_word_embeddings=False, attention_bias=False)


LLAMA_8B = _config(4096, 14336, 32, 8, 32)
LLAMA_70B = _config(8192, 28672, 64, 8, 80)


def _pool_tokens(monkeypatch, mc: ModelConfig, free: int, kv_dtype=torch.float8_e4m3fn, **flags):
    """ModelRunner._kv_pool_tokens on a stand-in runner whose one CUDA device has `free` bytes."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free, 80 * GB))
    sa = ServerArgs(model_path="unused", **flags)
    r = object.__new__(ModelRunner)
    r.server_args, r.model_config, r.kv_dtype = sa, mc, kv_dtype
    r.model = types.SimpleNamespace()                      # no "shards": one GPU
    r.device = torch.device("cuda", 0)
    r.max_running_requests, r.context_len = 256, 131072
    return r._kv_pool_tokens()


def test_step_reserve_counts_the_prefill_peak_and_the_logits():
    base = step_reserve_bytes(LLAMA_70B, 0, 0)
    assert base == FIXED_STEP_RESERVE
    # per prefill token: 3 x hidden + 3 x intermediate in 16 bits, + their FP8 copies
    per_token = step_reserve_bytes(LLAMA_70B, 1, 0) - base
    assert per_token == 2 * (3 * 8192 + 3 * 28672) + 8192 + 28672
    assert step_reserve_bytes(LLAMA_70B, 0, 10) - base == 10 * 3 * 4 * 128256
    assert step_reserve_bytes(LLAMA_70B, 16384, 256) > step_reserve_bytes(LLAMA_8B, 16384, 256)


def test_small_free_memory_leaves_a_step_its_peak(monkeypatch):
    free = int(11.08 * GB)                  # the 70B's FP8 weights on an 80 GB H100
    tokens = _pool_tokens(monkeypatch, LLAMA_70B, free)
    per_token = 2 * 80 * 8 * 128            # FP8 K + V over 80 layers
    sa = ServerArgs(model_path="unused")
    step_tokens = max(sa.max_prefill_tokens, sa.resolved_chunked_prefill_size() or 0)
    reserve = step_reserve_bytes(LLAMA_70B, step_tokens, 256)
    assert tokens == (free - reserve) // per_token
    assert free - tokens * per_token >= reserve
    assert tokens * per_token < free * GPU_MEM_FRACTION   # less than the fraction alone gave


def test_ample_free_memory_keeps_the_fraction(monkeypatch):
    free = 63 * GB                          # the 8B's bf16 weights on an 80 GB H100
    tokens = _pool_tokens(monkeypatch, LLAMA_8B, free, kv_dtype=torch.bfloat16)
    assert tokens == int(free * GPU_MEM_FRACTION) // (2 * 32 * 8 * 128 * 2)


def test_an_explicit_fraction_is_the_users_call(monkeypatch):
    free = int(11.08 * GB)
    tokens = _pool_tokens(monkeypatch, LLAMA_70B, free, mem_fraction_static=0.9)
    assert tokens == int(free * 0.9) // (2 * 80 * 8 * 128)


def test_no_room_for_a_step_is_a_clear_start_error(monkeypatch):
    with pytest.raises(ValueError, match="not enough memory for the KV pool"):
        _pool_tokens(monkeypatch, LLAMA_70B, 3 * GB)
