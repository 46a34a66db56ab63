"""ForwardBatch: everything one forward pass needs, as tensors on the model's device.

Built by the runner from the uploaded StepInput (ModelRunner._decode_logits / _extend_logits,
and the CUDA graphs of model/cuda_graph_runner.py); consumed by the model (model/llama.py). The model never looks at requests.
decode_prologue is the device half of building a decode batch, shared by the runner's eager
decode and the CUDA graphs that capture it (model/cuda_graph_runner.py).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from radixserve import ops
from radixserve.cache.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = 1   # prefill / chunked prefill: several new tokens per request
    DECODE = 2   # exactly one new token per request


@dataclass
class ForwardBatch:
    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor       # [num_tokens] int64, requests concatenated
    positions: torch.Tensor       # [num_tokens] int64, position of each token in its sequence
    out_cache_loc: torch.Tensor   # [num_tokens] int64, KV slot each new token writes
    qo_indptr: torch.Tensor       # [batch + 1] int32, new tokens of request b: [qo_indptr[b], qo_indptr[b+1])
    kv_indptr: torch.Tensor       # [batch + 1] int32
    kv_indices: torch.Tensor      # [>= nnz] int32, slots of [prefix + new] tokens per request
    seq_lens: torch.Tensor        # [batch] int32, prefix + new tokens per request
    logits_indices: torch.Tensor  # [num_logit_rows] int64, rows of the hidden states that get logits
    kv_pool: KVPool
    # an upper bound of seq_lens known on the host, None when unknown: a sliding-window layer
    # whose window holds max_seq_len positions attends as a full one (the window hides
    # nothing: the kernels skip its mask, and extend keeps the sm_90a kernel)
    max_seq_len: Optional[int] = None


def decode_prologue(req_to_token: torch.Tensor, next_ids: torch.Tensor, rows: torch.Tensor,
                    seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor):
    """The device half of building a decode batch (graph-safe: no host reads).
    rows [B] int64, seq_lens [B] int32 (KV length after this step), out_cache_loc [B] int64.
    Writes each row's new slot at position seq_len - 1 and flattens the rows into kv_indptr /
    kv_indices; returns (input_ids [B] int64 = next_ids[rows], positions [B] int64)."""
    positions = seq_lens.long() - 1
    req_to_token.index_put_((rows, positions), out_cache_loc.to(torch.int32))
    ops.build_kv_indices(req_to_token, rows, seq_lens, kv_indptr, kv_indices)
    return next_ids.index_select(0, rows), positions
