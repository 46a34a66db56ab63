"""ForwardBatch: everything one forward pass needs, as tensors on the model's device.

Built by the engine (engine/schedule_batch.py) from a ScheduleBatch; consumed by the model
(model/llama.py) and the runner (model/runner.py). The model never looks at requests.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

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
