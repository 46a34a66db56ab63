"""Qwen3 (per-head q/k RMSNorm before rope) on CUDA with our kernels, against HF transformers.

A tiny random Qwen3 (2 layers, GQA 2, head_dim 64 != hidden / heads) is written by transformers,
loaded by our loader onto the GPU in fp32 and run through ForwardBatch: one batched prefill of
two prompts (extend kernel, every position's logits), then decode steps of both requests
(decode kernel). Every logit must be within 1e-3 of HF's fp32 forward on the CPU (logits are
O(1..10); the kernels accumulate in fp32 in another order than torch's CPU GEMMs). The bf16
graph path with q/k norms is covered by test_cuda_graph.py's qwen3 runner.
"""
from __future__ import annotations

from typing import List, Sequence

import pytest
import torch

from _gpu import requires_kernels
from radixserve import ops
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.model.loader import load_model

pytestmark = requires_kernels
ATOL = 1e-3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=211, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      rope_theta=1000000.0)
    hf = Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    path = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(path, safe_serialization=True)
    config = ModelConfig.from_path(str(path))
    ours = load_model(str(path), config, "safetensors", torch.float32, "cuda")
    return hf, ours, config


class _Steps:
    """Requests over a CUDA KV pool: each step appends tokens to some requests and returns the
    logits of every new token [num_tokens, vocab]."""

    def __init__(self, model, config: ModelConfig):
        self.model = model
        self.pool = KVPool(4096, config.num_hidden_layers, config.num_key_value_heads,
                           config.head_dim, torch.float32, "cuda")
        self.table = torch.zeros(8, 512, dtype=torch.int32, device="cuda")    # row -> slots
        self.lens: List[int] = []

    def new_request(self) -> int:
        self.lens.append(0)
        return len(self.lens) - 1

    def step(self, rows: Sequence[int], new_ids: Sequence[Sequence[int]],
             mode: ForwardMode) -> torch.Tensor:
        counts = [len(ids) for ids in new_ids]
        slots = self.pool.alloc(sum(counts)).cuda()
        positions, offset = [], 0
        for row, n in zip(rows, counts):
            start = self.lens[row]
            self.table[row, start:start + n] = slots[offset:offset + n].to(torch.int32)
            positions.append(torch.arange(start, start + n))
            self.lens[row] = start + n
            offset += n
        seq_lens = torch.tensor([self.lens[r] for r in rows], dtype=torch.int32, device="cuda")
        kv_indptr = torch.zeros(len(rows) + 1, dtype=torch.int32, device="cuda")
        kv_indices = torch.zeros(int(seq_lens.sum()), dtype=torch.int32, device="cuda")
        ops.build_kv_indices(self.table, torch.tensor(rows, device="cuda"), seq_lens, kv_indptr,
                             kv_indices)
        qo_indptr = torch.tensor([0] + counts).cumsum(0).to(torch.int32).cuda()
        fb = ForwardBatch(mode=mode, batch_size=len(rows),
                          input_ids=torch.tensor([t for ids in new_ids for t in ids]).cuda(),
                          positions=torch.cat(positions).cuda(), out_cache_loc=slots,
                          qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                          seq_lens=seq_lens, logits_indices=torch.arange(sum(counts)).cuda(),
                          kv_pool=self.pool)
        return self.model.compute_logits(self.model(fb)).cpu()


def _hf_logits(hf, ids: List[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()         # [len, vocab]


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ref.abs().max() > 0.5, "logits too small for the comparison to mean anything"
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs logit difference {diff}"


def test_qwen3_prefill_and_decode_match_hf(pair):
    hf, ours, config = pair
    assert type(ours).__name__ == "Qwen3ForCausalLM"
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, config.vocab_size, (40,), generator=gen).tolist()
    b = torch.randint(0, config.vocab_size, (9,), generator=gen).tolist()
    steps = _Steps(ours, config)
    ra, rb = steps.new_request(), steps.new_request()
    logits = steps.step([ra, rb], [a[:36], b[:5]], ForwardMode.EXTEND)
    _close(logits[:36], _hf_logits(hf, a[:36]))
    _close(logits[36:], _hf_logits(hf, b[:5]))
    for i in range(4):               # decode: one token each, different lengths in one batch
        logits = steps.step([ra, rb], [[a[36 + i]], [b[5 + i]]], ForwardMode.DECODE)
        _close(logits[:1], _hf_logits(hf, a[:37 + i])[-1:])
        _close(logits[1:], _hf_logits(hf, b[:6 + i])[-1:])
