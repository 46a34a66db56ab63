"""Decode attention on the CPU in fp32, with the per-step work done once per step.

ops.paged_decode_attention's reference (ops/reference.py) plans its tiles and builds their
padded slot tables and masks in every layer: a dozen small ops per layer, each a few
microseconds to tens of them on the CPU, identical in all layers of a step. CpuDecodeAttention
builds them once per step from the step's kv_indptr / kv_indices (reference.PagedAttention, at
the first layer, which brings the head counts) and then, per layer, runs the reference's own
tiles, so its outputs are the reference's, bit for bit (tests/unit/test_cpu_fast_paths.py
checks it). Layers of another sliding window (Gemma's local and global layers) get a table of
their own, built at the first layer of that window.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.ops import reference as ref


class CpuDecodeAttention:
    """The tiles of one decode step's attention: built once per step, called once per layer."""

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor):
        """kv_indptr [B + 1] int32, kv_indices [nnz] int32 (as build_kv_indices makes them;
        every request has at least one KV token)."""
        self.kv_indptr, self.kv_indices = kv_indptr, kv_indices
        # (num_q_heads, num_kv_heads, head_dim, cache element size, window) -> its table
        self._tables: Dict[tuple, ref.PagedAttention] = {}
        # (key, table) of the last call
        self._attn: Optional[Tuple[tuple, ref.PagedAttention]] = None

    @staticmethod
    def for_batch(fb: ForwardBatch, dtype: torch.dtype) -> Optional["CpuDecodeAttention"]:
        """The step's table for an fp32 decode step on the CPU; None for any other step."""
        if fb.mode is not ForwardMode.DECODE or fb.input_ids.is_cuda or dtype != torch.float32 \
                or fb.batch_size == 0:
            return None
        return CpuDecodeAttention(fb.kv_indptr, fb.kv_indices)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 window: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
        """q [B, num_q_heads, head_dim] fp32, k_cache / v_cache [num_slots, num_kv_heads,
        head_dim] fp32 (or FP8, read times k_scale / v_scale) -> [B, num_q_heads, head_dim]:
        ops.paged_decode_attention's values (window and softcap as there)."""
        key = (q.shape[1], k_cache.shape[1], q.shape[2], k_cache.element_size(),
               int(window or 0))
        if self._attn is None or self._attn[0] != key:
            table = self._tables.get(key)
            if table is None:
                table = self._tables[key] = ref.PagedAttention(
                    self.kv_indptr, self.kv_indices, None, *key)
            self._attn = (key, table)
        return self._attn[1](q, k_cache, v_cache, sm_scale, k_scale, v_scale, softcap)
