"""Tensor parallelism in one process (issue 37): N model shards that act as one model.

TensorParallelModel holds one shard of the model per rank (LlamaForCausalLM built with tp_rank
r, tp_size N: model/llama.py's column-parallel q|k|v and gate|up, row-parallel o_proj and
down_proj followed by an all-reduce, vocab-parallel embedding and LM head) and gives ModelRunner
the one-model contract, so the runner, the scheduler, the radix cache, the overlap pipeline,
grammars and jump-forward are those of tp_size 1:
  * forward(fb) launches every rank's forward at once (parallel/group.RankWorkers: rank 0 on
    the calling thread, the engine's forward worker; ranks 1..N-1 on their own threads), rank r
    over fb with its inputs on its device and fb.kv_pool replaced by its KV shard
    (cache/kv_pool.ShardedKVPool.shards[r]: its KV heads of every slot; slot indices are
    global). The all-reduces give every rank the same hidden states; rank 0's are returned.
  * compute_logits(hidden) runs each rank's LM-head shard on hidden and gathers the shards on
    rank 0: the sampler (on rank 0's device, with the runner's one req_to_token, next_ids and
    penalty state) sees the full logits; the other ranks never hold more than their shard.
  * make_kv_pool(num_slots, dtype): the ShardedKVPool of its ranks' KV heads.

KV heads: split across ranks when there are at least N of them (N must divide them), else each
is replicated on N / num_kv_heads ranks (N must be a multiple of them), as SGLang does.

Devices: every rank on the CPU (the collectives are threads: parallel/group.ThreadGroup), or
rank r on GPU base + r (parallel/group.NcclGroup: NCCL communicators made in this process by
ncclCommInitAll). On CUDA the step's inputs and the hidden states for the LM head are copied
from rank 0's stream to each rank's stream on the calling thread (torch orders a cross-device
copy after the source stream's work and the destination stream after the copy), then every
rank launches its forward on its own thread and stream; rank 0's output stays on the caller's
stream. Decode runs as one CUDA graph per GPU with the all-reduces inside
(model/cuda_graph_runner.TPCudaGraphRunner); on the CPU it runs eager.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Sequence

import torch
from torch import nn

from radixserve.cache.kv_pool import ShardedKVPool
from radixserve.config import ModelConfig
from radixserve.model.forward_batch import ForwardBatch
from radixserve.parallel.group import RankWorkers, make_group

logger = logging.getLogger(__name__)


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """Raise ValueError naming --tp-size when the model cannot be split tp_size ways."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, not {tp_size}")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp_size:
        problems.append(f"its {heads} attention heads are not divisible by {tp_size}")
    if kv >= tp_size and kv % tp_size:
        problems.append(f"its {kv} KV heads are not divisible by {tp_size}")
    if kv < tp_size and tp_size % kv:
        problems.append(f"{tp_size} is not a multiple of its {kv} KV heads (to replicate them)")
    if config.intermediate_size % tp_size:
        problems.append(f"its intermediate size {config.intermediate_size} is not divisible by "
                        f"{tp_size}")
    if problems:
        raise ValueError(f"--tp-size {tp_size} does not fit {config.architecture}: "
                         f"{'; '.join(problems)}")


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds (QKVParallelLinear's split; 1 when they are replicated)."""
    return max(1, num_kv_heads // tp_size)


def describe_layout(config: ModelConfig, tp_size: int) -> str:
    """One line: how the model splits over tp_size ranks."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    per_kv = local_kv_heads(kv, tp_size)
    kv_text = f"KV heads {kv} -> {per_kv} per rank"
    if kv < tp_size:
        kv_text += f" (each replicated on {tp_size // kv} ranks)"
    rows = -(-config.vocab_size // tp_size)
    return (f"{tp_size} ranks: attention heads {heads} -> {heads // tp_size} per rank, {kv_text}, "
            f"MLP columns {config.intermediate_size} -> {config.intermediate_size // tp_size} "
            f"per rank, vocabulary {config.vocab_size} -> {rows} rows per rank "
            f"(embedding{' = LM head' if config.tie_word_embeddings else ' and LM head'})")


class TensorParallelModel(nn.Module):
    """N shards of one model run as one (see the module docstring)."""

    def __init__(self, shards: Sequence[nn.Module], single_ok: bool = False):
        """single_ok: accept one shard (the TP machinery over one rank: tests on one GPU)."""
        super().__init__()
        if len(shards) < (1 if single_ok else 2):
            raise ValueError("TensorParallelModel needs at least 2 shards (tp_size 1 is the "
                             "plain model)")
        for rank, shard in enumerate(shards):
            if (shard.tp_rank, shard.tp_size) != (rank, len(shards)):
                raise ValueError(f"shard {rank} was built as rank {shard.tp_rank} of "
                                 f"{shard.tp_size}, not rank {rank} of {len(shards)}")
        self.shards = nn.ModuleList(shards)
        self.config: ModelConfig = shards[0].config
        self.tp_size = len(shards)
        self.quant_config = getattr(shards[0], "quant_config", None)
        self.devices: List[torch.device] = [next(s.parameters()).device for s in shards]
        self.group = make_group(self.devices)
        self.workers = RankWorkers(self.group)
        self.layout = describe_layout(self.config, self.tp_size)
        logger.info("tensor parallel: %s; devices %s; all-reduce: %s", self.layout,
                    ", ".join(str(d) for d in self.devices), self.group.describe())

    # ------------------------------------------------------------------ the one-model contract
    def make_kv_pool(self, num_slots: int, dtype: torch.dtype) -> ShardedKVPool:
        """The KV pool of num_slots tokens: one allocator, each rank's KV heads on its device."""
        mc = self.config
        return ShardedKVPool(num_slots, mc.num_hidden_layers,
                             local_kv_heads(mc.num_key_value_heads, self.tp_size), mc.head_dim,
                             dtype, self.devices)

    def kv_heads_per_token(self, one_memory: bool) -> int:
        """KV heads a token costs in one memory budget: every rank's (one_memory: all ranks
        share it, as on the CPU), else one rank's."""
        per_rank = local_kv_heads(self.config.num_key_value_heads, self.tp_size)
        return per_rank * self.tp_size if one_memory else per_rank

    def _rank_batch(self, fb: ForwardBatch, rank: int) -> ForwardBatch:
        """fb for rank: its KV shard, its inputs on its device (copied where that differs)."""
        pool = fb.kv_pool
        if not isinstance(pool, ShardedKVPool) or len(pool.shards) != self.tp_size:
            raise ValueError("a tensor-parallel forward needs the ShardedKVPool of its ranks "
                             "(TensorParallelModel.make_kv_pool)")
        device = self.devices[rank]
        # device tensors move to the rank's device; host-side tensors (CPU metadata of a CUDA
        # batch) stay where they are
        moved = {f.name: getattr(fb, f.name).to(device, non_blocking=True)
                 for f in dataclasses.fields(fb)
                 if isinstance(getattr(fb, f.name), torch.Tensor)
                 and getattr(fb, f.name).device != device
                 and (device.type == "cpu" or getattr(fb, f.name).device.type == "cuda")}
        return dataclasses.replace(fb, kv_pool=pool.shard(rank), **moved)

    def _per_rank(self, make):
        """[make(r) for each rank], built on the calling thread: on CUDA under rank r's stream
        (NcclGroup.rank_context), so copies from rank 0's stream land in order on rank r's."""
        out = []
        for r in range(self.tp_size):
            with self.group.rank_context(r):
                out.append(make(r))
        return out

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb -> rank 0's hidden [num_tokens, hidden_size] (every rank's are the same); every
        rank writes its KV heads of the new tokens into its shard."""
        batches = self._per_rank(lambda r: self._rank_batch(fb, r))
        return self.workers.run(lambda r: self.shards[r](batches[r]))[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] (rank 0's) -> logits [n, vocab_size] float32 on rank 0."""
        inputs = self._per_rank(lambda r: hidden.to(self.devices[r], non_blocking=True))
        return self.workers.run(lambda r: self.shards[r].compute_logits(inputs[r]))[0]

    def close(self) -> None:
        """Stop the rank worker threads."""
        self.workers.close()


def rank_devices(device: torch.device, tp_size: int) -> List[torch.device]:
    """Where each rank runs: every rank on the CPU, or GPUs device.index .. + tp_size - 1
    (ValueError naming --tp-size when this host has fewer)."""
    device = torch.device(device)
    if device.type == "cpu":
        return [device] * tp_size
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    base = device.index if device.index is not None else (torch.cuda.current_device() if have else 0)
    if base + tp_size > have:
        raise ValueError(f"--tp-size {tp_size} needs GPUs {base}..{base + tp_size - 1}, but "
                         f"this host has {have}")
    return [torch.device("cuda", base + r) for r in range(tp_size)]


def load_tp_model(model_path: str, model_config: ModelConfig, load_format: str,
                  dtype: torch.dtype, device: torch.device, tp_size: int,
                  quantization: Optional[str] = None,
                  lm_head_optional: bool = False) -> TensorParallelModel:
    """The model of model_path as tp_size shards (model/loader.load_model_shards: each rank
    holds and copies only its slices) on rank_devices(device, tp_size); lm_head_optional: as
    load_model_shards'."""
    from radixserve.model.loader import load_model_shards

    check_tp_size(model_config, tp_size)
    shards = load_model_shards(model_path, model_config, load_format, dtype,
                               rank_devices(device, tp_size), quantization,
                               lm_head_optional=lm_head_optional)
    return TensorParallelModel(shards)
