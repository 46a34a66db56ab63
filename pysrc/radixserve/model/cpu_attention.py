"""Decode attention on the CPU in fp32, with the per-step work done once per step.

ops.paged_decode_attention's reference (ops/reference.py) builds the padded slot table of the
batch in every layer: a dozen small ops per layer, each a few microseconds to tens of them on
the CPU, identical in all layers of a step. CpuDecodeAttention builds that table once from the
step's kv_indptr / kv_indices (reference.padded_slots) and then, per layer, runs the reference's
own attention over it (reference.padded_decode_attention), so its outputs are the reference's,
bit for bit (tests/unit/test_cpu_fast_paths.py checks it).
"""
from __future__ import annotations

from typing import Optional

import torch

from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.ops import reference as ref


class CpuDecodeAttention:
    """The padded view of one decode step's KV: built once per step, called once per layer."""

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor):
        """kv_indptr [B + 1] int32, kv_indices [nnz] int32 (as build_kv_indices makes them;
        every request has at least one KV token)."""
        # slots [B * max_len] (slot 0 past a request's length), valid [B, max_len]
        self.slots, self.valid, _ = ref.padded_slots(kv_indptr, kv_indices)

    @staticmethod
    def for_batch(fb: ForwardBatch, dtype: torch.dtype) -> Optional["CpuDecodeAttention"]:
        """The step's table for an fp32 decode step on the CPU; None for any other step."""
        if fb.mode is not ForwardMode.DECODE or fb.input_ids.is_cuda or dtype != torch.float32 \
                or fb.batch_size == 0:
            return None
        return CpuDecodeAttention(fb.kv_indptr, fb.kv_indices)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sm_scale: float) -> torch.Tensor:
        """q [B, num_q_heads, head_dim] fp32, k_cache / v_cache [num_slots, num_kv_heads,
        head_dim] fp32 -> [B, num_q_heads, head_dim]: ops.paged_decode_attention's values."""
        return ref.padded_decode_attention(q, k_cache, v_cache, self.slots, self.valid, sm_scale)
