"""Llama-family decoder over the paged KV pool: Llama 2/3/3.1, SmolLM2, Mistral, Qwen2, Qwen3,
Phi-3 / Phi-4.

One file in the gpt-fast spirit: the tensor-parallel linear layers, the attention/MLP blocks,
the decoder and the architecture registry. Every compute op goes through radixserve.ops, so the
same code runs the CUDA kernels on a GPU and the torch references on a CPU.

Contract of a model built here (see LlamaForCausalLM):
  * forward(fb: ForwardBatch) -> hidden [num_tokens, hidden_size] with the final norm applied.
    It writes the new tokens' K/V into fb.kv_pool at fb.out_cache_loc (every layer) and
    mutates nothing else.
  * compute_logits(hidden [n, hidden_size]) -> [n, vocab_size] float32 (LM head, tied to the
    embedding when the config says so); None on tensor-parallel ranks other than 0.
  * load_weights(named tensors in HF naming) fills the parameters; q/k/v and gate/up are fused
    here (qkv_proj, gate_up_proj) and loaded by slicing (a tensor-parallel shard copies only its
    rank's slice). weight_loader() is the same, fed one tensor at a time (several shards from
    one read of each tensor: model/loader.load_model_shards). A backbone saved without the LM
    wrapper (HF's Qwen3Model ..., embedding models) loads too: its names lack "model."; without
    an LM head in the checkpoint, lm_head_loaded is False and compute_logits must not be used.

Tensor parallelism: the layers take (tp_rank, tp_size) and hold only their rank's slice (heads
for attention, intermediate columns for the MLP, vocabulary rows for embedding and LM head);
row-parallel outputs and the vocab-parallel embedding are summed across ranks, LM-head shards
are gathered on rank 0. The collectives are parallel/group.py's, run by the rank threads of
model/tensor_parallel.TensorParallelModel (N shards in one process); with tp_size 1 no
collective runs.

Sliding windows, per layer as HF transformers applies them (layer_windows): Mistral and Phi-3
on every layer when config.sliding_window is set (4096 in Mistral-7B-v0.1, 2047 in
Phi-3-mini-4k); Qwen2 / Qwen3 only with use_sliding_window, on the layers config.layer_types
marks "sliding_attention" (else those from max_window_layers on); Llama never (HF's Llama
ignores the field). A windowed layer's query at position p attends KV positions
(p - window, p] (ops.paged_extend_attention); the KV before that stays in the pool (the radix
cache shares it with full-context layers and other requests) but is not read. On CUDA the
attention kernels take the window (the extend kernel then is the mma.sync one; ops), and
decode steps stay in CUDA graphs.

Qwen3 (dense): Llama-shaped without biases, plus an RMSNorm over head_dim applied to every query
and key head before rope (q_norm / k_norm, one weight [head_dim] each, shared by the heads).

The first block that is not the Llama block, Gemma 2 / 3's, lives in model/gemma3.py, built
from this file's linears, attention and CausalLM base by import.
"""
from __future__ import annotations

import functools
import logging
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from radixserve import ops
from radixserve.config import ModelConfig
from radixserve.model.cpu_attention import CpuDecodeAttention
from radixserve.model.forward_batch import ForwardBatch, ForwardMode
from radixserve.model.rope import build_cos_sin_cache
from radixserve.parallel import group as tp_group
from radixserve.quant.fp8 import (FP8_DTYPE, Fp8Activation, Fp8Scheme, QuantConfig,
                                  checkpoint_quant_config, init_fp8_params, load_fp8_tensor)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- collectives


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum x over the tensor-parallel group; identity for tp_size 1. The sum may be a new tensor
    (parallel/group.py never writes x in place): use the return value."""
    if tp_size == 1:
        return x
    return tp_group.all_reduce(x, tp_size)


def tp_gather_last_dim(x: torch.Tensor, tp_size: int) -> Optional[torch.Tensor]:
    """Every rank's x concatenated along the last dimension on rank 0 (the sampler's), None on
    the other ranks; x itself for tp_size 1."""
    if tp_size == 1:
        return x
    return tp_group.gather_last_dim(x, tp_size, dst=0)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _check_shape(what: str, got: torch.Size, expected: Sequence[int]) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"checkpoint tensor {what} has shape {tuple(got)}, expected {tuple(expected)}")


# ----------------------------------------------------------------------------- CPU GEMMs

# On the CPU, MKL's sgemm runs a decode-sized F.linear(x, W) (x [M, K], M = batch rows) faster in
# the other orientation, (W x^T)^T: the default model's layer GEMMs at M = 16 took 0.76x the time
# (0.84-0.94x at M = 24..64, but 1.13-1.17x at M = 12 and 14), its LM head 0.72x (2 cores, torch
# 2.14 / MKL 2024.2). Both orientations give bit-identical outputs for M >= 12 (not for M in
# 2..11, where F.linear takes another MKL kernel); tests/unit/test_cpu_fast_paths.py checks it.
CPU_GEMM_T_ROWS = range(16, 65, 8)


def cpu_transposed_gemm_ok(x: torch.Tensor) -> bool:
    """Whether linear() computes x [M, K] times a weight as (W x^T)^T: fp32 on the CPU, M in
    CPU_GEMM_T_ROWS."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] in CPU_GEMM_T_ROWS)


# GPU decode GEMMs of up to this many rows run ops.skinny_linear, a weight stream launched with
# programmatic dependent launch. Same-run sweep on the H200 (bench/variants/gemv_sweep.cu, the
# 8B projections): at 1 row 13.4 / 9.9 / 53.9 / 30.9 us for q|k|v, o, gate|up (+ activation)
# and down against cuBLAS's 15.8 / 12.4 / 56.1 (+ silu) / 31.0; at 2 and 4 rows cuBLAS was as
# fast or faster on most of them.
SKINNY_GEMM_ROWS = 1


def skinny_gemm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() (and the MLP's gate|up) take the skinny GEMM for x [M, K]."""
    return x.shape[0] <= SKINNY_GEMM_ROWS and ops.skinny_linear_fits(x, weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           contiguous: bool = True) -> torch.Tensor:
    """F.linear(x, weight, bias): x [M, in], weight [out, in] -> [M, out], with the same values;
    computed as (weight x^T)^T where cpu_transposed_gemm_ok(x) (see above). contiguous=False
    may return that as the transposed view of an [out, M] buffer (no copy; elementwise ops keep
    the layout, and a following linear() reads it without one). On the GPU a batch-1 decode
    step takes our skinny GEMM instead of cuBLAS (skinny_gemm_ok)."""
    if skinny_gemm_ok(x, weight):
        return ops.skinny_linear(x, weight, bias)
    if not cpu_transposed_gemm_ok(x):
        return F.linear(x, weight, bias)
    if bias is None:
        out_t = torch.mm(weight, x.t())                    # [out, M]
    else:
        out_t = torch.addmm(bias[:, None], weight, x.t())  # [out, M]; bias added as F.linear does
    return out_t.t().contiguous() if contiguous else out_t.t()


# FP8 linear layers (quant/fp8.py). A GEMM of up to this many rows (a decode step's) keeps its
# activations in the model dtype against the FP8 weights (W8A16: ops.fp8_linear act_quant "none",
# on the GPU the fp8_skinny_linear kernel where it fits, else the dequantize-then-matmul
# reference); a larger one quantizes them too (W8A8: per-token or static scales, then
# torch._scaled_mm with rowwise scales on sm_90+). The same rule runs on the CPU, so its
# reference forward computes the GPU's math. 16 is fp8_skinny_linear's largest batch; the
# crossover against _scaled_mm is not measured yet (bench/gemm_decode.py --fp8).
FP8_SKINNY_ROWS = 16


def fp8_act_quant(scheme: Fp8Scheme, rows: int) -> str:
    """ops.fp8_linear's act_quant for a GEMM of `rows` rows of an FP8 layer: "none" (weight-only)
    for a weight-only scheme or rows <= FP8_SKINNY_ROWS, else the scheme's activations
    ("dynamic" per token, or "static")."""
    if scheme.activation == "none" or rows <= FP8_SKINNY_ROWS:
        return "none"
    return scheme.activation


def fp8_layer_forward(layer: nn.Module, x, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x W^T (+ bias) of an FP8 layer (layer.quant set): x [M, in] in the model dtype, or an
    Fp8Activation (rmsnorm_quant_fp8's output, for a W8A8 GEMM) -> [M, out] in the model dtype."""
    if isinstance(x, Fp8Activation):
        return ops.fp8_scaled_mm(x.data, x.scale, layer.weight, layer.weight_scale, bias, x.dtype)
    return ops.fp8_linear(x, layer.weight, layer.weight_scale, bias,
                          act_quant=fp8_act_quant(layer.quant, x.shape[0]),
                          input_scale=layer.input_scale)


def reads_fp8_input(layer: nn.Module, rows: int) -> bool:
    """Whether layer's GEMM for `rows` rows quantizes its input to FP8 (the norm before it then
    fuses that quantization: LlamaDecoderLayer)."""
    scheme = getattr(layer, "quant", None)
    return scheme is not None and fp8_act_quant(scheme, rows) != "none"


# ----------------------------------------------------------------------------- parallel layers


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with the output features split across ranks (no communication).

    A fused layer lists several logical outputs (q|k|v, gate|up); each is split on its own, so
    rank r holds rows [r * s / tp, (r + 1) * s / tp) of every logical output s, laid out one
    after another. load_weight(name, tensor, shard_id) copies logical output shard_id's slice.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool,
                 params_dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 shard_rows: Optional[Sequence[Tuple[int, int]]] = None,
                 quant: Optional[Fp8Scheme] = None):
        """shard_rows: (start in the full checkpoint tensor, rows) per logical output, for layers
        that split unevenly (replicated KV heads); default: an even split by tp_rank.
        quant: an FP8 layer (quant/fp8.py: weight e4m3, weight_scale [rows] sharded with the
        rows, input_scale for static schemes), None for the model dtype."""
        super().__init__()
        if shard_rows is None:
            for size in output_sizes:
                if size % tp_size:
                    raise ValueError(f"output size {size} is not divisible by tp_size {tp_size}")
            shard_rows = [(tp_rank * (size // tp_size), size // tp_size) for size in output_sizes]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        # (offset in our weight, start in the full checkpoint tensor, rows) per logical output
        self.shards: List[Tuple[int, int, int]] = []
        offset = 0
        for src_start, rows in shard_rows:
            self.shards.append((offset, src_start, rows))
            offset += rows
        # [sum of local rows, input_size]
        self.quant = quant
        if quant is None:
            self.weight = _frozen(torch.empty(offset, input_size, dtype=params_dtype))
        else:
            init_fp8_params(self, offset, input_size, quant)
        self.bias = _frozen(torch.empty(offset, dtype=params_dtype)) if bias else None

    def is_fused(self, name: str, loaded: torch.Tensor) -> bool:
        """Whether loaded is the whole fused tensor (all logical outputs stacked, as Phi-3's
        checkpoints store q|k|v and gate|up) rather than one logical output; a single FP8
        scale of a fused layer counts as fused (it is every part's)."""
        if len(self.output_sizes) > 1 and name in ("weight_scale", "input_scale") and \
                loaded.numel() == 1:
            return True
        return len(self.output_sizes) > 1 and loaded.shape[0] == sum(self.output_sizes) and \
            (name != "weight" or loaded.dim() == 2)

    def load_fused(self, name: str, loaded: torch.Tensor) -> None:
        """Load a fused checkpoint tensor: each logical output's rows as its shard."""
        if name in ("weight_scale", "input_scale") and loaded.numel() == 1:
            for shard_id in range(len(self.output_sizes)):
                self.load_weight(name, loaded, shard_id)
            return
        for shard_id, part in enumerate(loaded.split(self.output_sizes, dim=0)):
            self.load_weight(name, part, shard_id)

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        dst_offset, src_start, rows = self.shards[shard_id]
        full = self.output_sizes[shard_id]
        if self.quant is not None and name != "bias":
            if name == "weight":
                _check_shape(f"{name}[{shard_id}]", loaded.shape, (full, self.input_size))
            load_fp8_tensor(self, name, loaded, f"{name}[{shard_id}]", full, src_start, rows,
                            dst_offset)
            return
        expected = (full, self.input_size) if name == "weight" else (full,)
        _check_shape(f"{name}[{shard_id}]", loaded.shape, expected)
        param = self.weight if name == "weight" else self.bias
        param.data.narrow(0, dst_offset, rows).copy_(loaded.narrow(0, src_start, rows))

    def forward(self, x: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
        """x [num_tokens, input_size] (or an Fp8Activation for an FP8 layer) -> [num_tokens,
        local outputs]; contiguous: see linear()."""
        if self.quant is not None:
            return fp8_layer_forward(self, x, self.bias)
        return linear(x, self.weight, self.bias, contiguous)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q|k|v projection. Shard ids: 0 = q, 1 = k, 2 = v.

    Query heads are split across ranks; KV heads too when there are at least tp_size of them,
    otherwise each KV head is replicated on tp_size / num_kv_heads ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, params_dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1,
                 quant: Optional[Fp8Scheme] = None):
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads are not divisible by tp_size {tp_size}")
        if num_kv_heads >= tp_size and num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads are not divisible by tp_size {tp_size}")
        if num_kv_heads < tp_size and tp_size % num_kv_heads:
            raise ValueError(f"tp_size {tp_size} is not a multiple of {num_kv_heads} KV heads")
        local_heads = num_heads // tp_size
        local_kv_heads = max(1, num_kv_heads // tp_size)
        replicas = max(1, tp_size // num_kv_heads)
        q_local = local_heads * head_dim
        kv_local = local_kv_heads * head_dim
        kv_start = (tp_rank // replicas) * kv_local
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias, params_dtype, tp_rank,
                         tp_size, shard_rows=[(tp_rank * q_local, q_local), (kv_start, kv_local),
                                              (kv_start, kv_local)], quant=quant)
        self.local_heads, self.local_kv_heads = local_heads, local_kv_heads


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input features split across ranks; partial sums are all-reduced,
    then the (unsplit) bias is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool, params_dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1, quant: Optional[Fp8Scheme] = None):
        """quant: an FP8 layer (quant/fp8.py: weight e4m3 split by input columns, weight_scale
        [output_size] whole on every rank), None for the model dtype."""
        super().__init__()
        if input_size % tp_size:
            raise ValueError(f"input size {input_size} is not divisible by tp_size {tp_size}")
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size, self.output_size = input_size, output_size
        self.local_input = input_size // tp_size
        # [output_size, input_size / tp]
        self.quant = quant
        if quant is None:
            self.weight = _frozen(torch.empty(output_size, self.local_input, dtype=params_dtype))
        else:
            init_fp8_params(self, output_size, self.local_input, quant)
        self.bias = _frozen(torch.empty(output_size, dtype=params_dtype)) if bias else None

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if self.quant is not None and name != "bias":
            if name == "weight":
                _check_shape(name, loaded.shape, (self.output_size, self.input_size))
            load_fp8_tensor(self, name, loaded, name, self.output_size, 0, self.output_size, 0,
                            cols=(self.tp_rank * self.local_input, self.local_input))
            return
        if name == "weight":
            _check_shape(name, loaded.shape, (self.output_size, self.input_size))
            self.weight.data.copy_(loaded.narrow(1, self.tp_rank * self.local_input, self.local_input))
        else:
            _check_shape(name, loaded.shape, (self.output_size,))
            self.bias.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = linear(x, self.weight) if self.quant is None else fp8_layer_forward(self, x, None)
        out = tp_all_reduce(local, self.tp_size)                      # [num_tokens, output_size]
        return out + self.bias if self.bias is not None else out


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split across ranks (padded to a multiple of tp_size).

    Rank r holds rows [r * rows_per_rank, (r + 1) * rows_per_rank); ids outside the slice embed
    to zero locally and the all-reduce fills them in from the owning rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, params_dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.rows_per_rank = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        # [rows_per_rank, embedding_dim]; rows past the real vocabulary stay zero
        self.weight = _frozen(torch.zeros(self.rows_per_rank, embedding_dim, dtype=params_dtype))

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _check_shape(name, loaded.shape, (self.num_embeddings, self.embedding_dim))
        rows = self.vocab_end - self.vocab_start
        self.weight.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)          # [num_tokens, embedding_dim]
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        out = F.embedding((input_ids - self.vocab_start) * local, self.weight)
        out.masked_fill_(~local[:, None], 0)
        return tp_all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, vocab-parallel like the embedding; logits() gathers the shards."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_head_logits(self, hidden)


@functools.lru_cache(maxsize=None)
def _mm_fp32_out_ok() -> bool:
    """Whether this torch has mm(..., out_dtype=float32) for half inputs on CUDA (2.8+)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


# On the CPU the LM head runs in slices of this many vocabulary rows: MKL's sgemm at
# [16, 576] x [576, 49152] (the default model's decode batch of 16) ran at 24 GFLOP/s whole and
# 1.7x faster in 2,048-row slices, with bit-identical logits (2 cores, torch 2.14 / MKL 2024.2).
CPU_LM_HEAD_ROWS = 2048


def _linear_in_row_slices(hidden: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """F.linear(hidden, weight) [n, vocab], computed over slices of weight's rows: each logit
    is the same dot product over the hidden dimension as in one call."""
    if cpu_transposed_gemm_ok(hidden):          # the slices written as rows of logits^T
        out_t = hidden.new_empty(weight.shape[0], hidden.shape[0])    # [rows_per_rank, n]
        for start in range(0, weight.shape[0], rows):
            torch.mm(weight[start:start + rows], hidden.t(), out=out_t[start:start + rows])
        return out_t.t().contiguous()
    out = hidden.new_empty(hidden.shape[0], weight.shape[0])      # [n, rows_per_rank]
    for start in range(0, weight.shape[0], rows):
        out[:, start:start + rows].copy_(F.linear(hidden, weight[start:start + rows]))
    return out


def lm_head_logits(head: VocabParallelEmbedding, hidden: torch.Tensor) -> Optional[torch.Tensor]:
    """hidden [n, hidden] -> logits [n, vocab] float32 from a (possibly tied) vocab-parallel head;
    with tp_size > 1 the shards are gathered on rank 0 and the other ranks get None."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and _mm_fp32_out_ok():
        # fp32 output straight from the GEMM's fp32 accumulators: rounding logits to bf16
        # (a step of 0.125 at |logit| >= 16) would flip near-tied greedy choices
        local = torch.mm(hidden, head.weight.t(), out_dtype=torch.float32)   # [n, rows_per_rank]
    elif hidden.device.type == "cpu" and head.weight.shape[0] > 2 * CPU_LM_HEAD_ROWS:
        local = _linear_in_row_slices(hidden, head.weight, CPU_LM_HEAD_ROWS)
    else:
        local = F.linear(hidden, head.weight)                      # [n, rows_per_rank]
    full = tp_gather_last_dim(local, head.tp_size)                 # [n, rows_per_rank * tp]
    if full is None:                                               # a rank other than 0
        return None
    return full[:, :head.num_embeddings].float()


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _frozen(torch.ones(hidden_size, dtype=params_dtype))   # [hidden_size]

    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: int = 0) -> None:
        _check_shape(name, loaded.shape, self.weight.shape)
        self.weight.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: residual += x; x = norm(residual). residual is float32 (see LlamaDecoderLayer)."""
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


# ----------------------------------------------------------------------------- blocks


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, o_bias: bool,
                 params_dtype: torch.dtype, tp_rank: int, tp_size: int, qk_norm: bool = False,
                 quant_config: Optional[QuantConfig] = None, window: int = 0):
        """qk_norm: Qwen3's per-head RMSNorm of q and k before rope (q_norm, k_norm).
        quant_config: which of q|k|v and o are FP8 (quant/fp8.py), None: none.
        window: this layer's sliding window (0: the whole context; see layer_windows)."""
        super().__init__()
        self.layer_id = layer_id
        self.window = int(window or 0)
        self.softcap = 0.0              # attention logit soft-capping (Gemma 2: gemma3.py)
        self.head_dim = config.head_dim
        prefix = f"model.layers.{layer_id}.self_attn."
        qkv_quant = o_quant = None
        if quant_config is not None:
            qkv_quant = quant_config.scheme_for([prefix + p for p in ("q_proj", "k_proj", "v_proj")],
                                                prefix + "qkv_proj")
            o_quant = quant_config.scheme_for([prefix + "o_proj"])
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim,
                                          config.num_attention_heads, config.num_key_value_heads,
                                          qkv_bias, params_dtype, tp_rank, tp_size, qkv_quant)
        self.num_heads = self.qkv_proj.local_heads
        self.num_kv_heads = self.qkv_proj.local_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = self.head_dim ** -0.5
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim,
                                        config.hidden_size, o_bias, params_dtype, tp_rank, tp_size,
                                        o_quant)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, params_dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, params_dtype)
        # an FP8 KV cache's scales (stored = k / k_scale; read = stored * k_scale): Python floats,
        # so CUDA graphs capture them as launch arguments; the checkpoint's where it has them
        # (set_kv_cache_scales), else 1.0; ignored by a 16/32-bit cache
        self.k_scale = self.v_scale = 1.0

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, cos_sin_cache: torch.Tensor,
                cpu_attn: Optional[CpuDecodeAttention] = None) -> torch.Tensor:
        """cpu_attn: the step's CPU decode table (fp32 decode on the CPU), else None. hidden may
        be an Fp8Activation (the normed input already quantized for an FP8 q|k|v)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)                        # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)       # strided views into qkv
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self._norm_heads(q, k)
        k_cache = fb.kv_pool.k_buffers[self.layer_id]     # [num_slots + 1, num_kv_heads, head_dim]
        v_cache = fb.kv_pool.v_buffers[self.layer_id]
        # k, v, q stay strided views into qkv: the rope + store kernel and attention read each
        # token's [heads, head_dim] rows through their strides (no copy kernels on the step path)
        ks, vs = self.k_scale, self.v_scale
        ops.rotary_embedding_store_kv(fb.positions, q, k, v, cos_sin_cache, k_cache, v_cache,
                                      fb.out_cache_loc, ks, vs)
        out = self.attend(fb, q, k_cache, v_cache, cpu_attn)
        return self.o_proj(out.view(num_tokens, self.q_size))     # [num_tokens, hidden_size]

    def attention_options(self) -> Tuple[int, float]:
        """(window, softcap) of this layer's attention, 0 for none (runner.reference_attention
        reads them: the kernels take neither yet)."""
        return self.window, self.softcap

    def step_window(self, fb: ForwardBatch) -> Optional[int]:
        """The window to attend with in this step: None when the layer has none, or when no
        request of fb is longer than it (fb.max_seq_len), where it hides nothing."""
        if not self.window or (fb.max_seq_len is not None and fb.max_seq_len <= self.window):
            return None
        return self.window

    def attend(self, fb: ForwardBatch, q: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, cpu_attn: Optional[CpuDecodeAttention]) -> torch.Tensor:
        """The paged attention of q over the step's KV (K/V already stored), with this layer's
        scale, FP8 scales, window and soft-cap -> [num_tokens, heads, head_dim]."""
        ks, vs = self.k_scale, self.v_scale
        window, softcap = self.step_window(fb), self.softcap or None
        if cpu_attn is not None:
            return cpu_attn(q, k_cache, v_cache, self.scaling, ks, vs, window, softcap)
        if fb.mode is ForwardMode.DECODE:
            return ops.paged_decode_attention(q, k_cache, v_cache, fb.kv_indptr, fb.kv_indices,
                                              self.scaling, ks, vs, window=window,
                                              softcap=softcap)
        return ops.paged_extend_attention(q, k_cache, v_cache, fb.qo_indptr, fb.kv_indptr,
                                          fb.kv_indices, self.scaling, ks, vs, window=window,
                                          softcap=softcap)

    def _norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Qwen3: q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim] (views
        into qkv) -> each head's row RMS-normed over head_dim, as new contiguous tensors of the
        same shapes (v stays a view into qkv)."""
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return q, k


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, bias: bool, params_dtype: torch.dtype,
                 tp_rank: int, tp_size: int, quant_config: Optional[QuantConfig] = None,
                 prefix: str = "model.layers.0.mlp."):
        """quant_config: which of gate|up and down are FP8 (quant/fp8.py); prefix: the
        checkpoint name of this MLP, with its trailing dot."""
        super().__init__()
        act = config.hf_config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        inter = config.intermediate_size
        gate_up_quant = down_quant = None
        if quant_config is not None:
            gate_up_quant = quant_config.scheme_for([prefix + "gate_proj", prefix + "up_proj"],
                                                    prefix + "gate_up_proj")
            down_quant = quant_config.scheme_for([prefix + "down_proj"])
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [inter, inter], bias,
                                                 params_dtype, tp_rank, tp_size,
                                                 quant=gate_up_quant)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, params_dtype,
                                           tp_rank, tp_size, down_quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size], or an Fp8Activation for an FP8 gate|up."""
        weight, bias = self.gate_up_proj.weight, self.gate_up_proj.bias
        quant = self.gate_up_proj.quant
        if quant is None and skinny_gemm_ok(x, weight):   # batch-1 decode, GPU
            act = ops.skinny_gated_linear(x, weight, bias)  # [num_tokens, inter / tp]
        elif (quant is not None and not isinstance(x, Fp8Activation)
              and fp8_act_quant(quant, x.shape[0]) == "none"):   # FP8 weights, decode batch
            act = ops.fp8_skinny_gated_linear(x, weight, self.gate_up_proj.weight_scale, bias)
        else:
            gate_up = self.gate_up_proj(x, contiguous=False)   # [num_tokens, 2 * inter / tp]
            act = ops.silu_and_mul(gate_up)                    # [num_tokens, inter / tp]
        return self.down_proj(act)                         # [num_tokens, hidden_size]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, qkv_bias: bool, o_bias: bool,
                 mlp_bias: bool, params_dtype: torch.dtype, tp_rank: int, tp_size: int,
                 qk_norm: bool = False, quant_config: Optional[QuantConfig] = None,
                 window: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, params_dtype,
                                        tp_rank, tp_size, qk_norm, quant_config, window)
        self.mlp = LlamaMLP(config, mlp_bias, params_dtype, tp_rank, tp_size, quant_config,
                            f"model.layers.{layer_id}.mlp.")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)

    def forward(self, fb: ForwardBatch, hidden: torch.Tensor, residual: Optional[torch.Tensor],
                cos_sin_cache: torch.Tensor,
                cpu_attn: Optional[CpuDecodeAttention] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block. residual carries the un-normalised stream between layers (None before
        the first layer); returns (block output not yet added to residual, residual).

        residual is always float32, also in bf16/fp16 models, while hidden (a GEMM input or
        output) stays in the model dtype: the residual sums the outputs of every block, and
        rounding that sum to bf16 after each of the 2 * num_layers additions was the largest
        avoidable error of the bf16 model against fp32. On the default model (bf16 vs fp32,
        teacher forced) it takes the mean |logit diff| from 0.13 to 0.08 and the 99.9th
        percentile from 0.94 to 0.43. It costs 4 bytes per hidden element of the batch.

        Before an FP8 q|k|v or gate|up whose GEMM quantizes its input (W8A8), the norm and that
        quantization run as one op (ops.rmsnorm_quant_fp8)."""
        first = residual is None
        if first:
            residual = hidden.float()          # [num_tokens, hidden_size] f32 (hidden if f32)
        hidden = self._norm(self.input_layernorm, hidden, None if first else residual,
                            self.self_attn.qkv_proj)
        hidden = self.self_attn(fb, hidden, cos_sin_cache, cpu_attn)
        hidden = self._norm(self.post_attention_layernorm, hidden, residual, self.mlp.gate_up_proj)
        return self.mlp(hidden), residual

    @staticmethod
    def _norm(norm: "RMSNorm", hidden: torch.Tensor, residual: Optional[torch.Tensor],
              consumer: nn.Module):
        """The norm before consumer (q|k|v or gate|up): norm(hidden) when residual is None, else
        in place residual += hidden, hidden = norm(residual). Where consumer's GEMM reads FP8
        activations for these rows, the quantization is fused in and an Fp8Activation returns
        (the residual update is the same)."""
        if reads_fp8_input(consumer, hidden.shape[0]):
            data, scale = ops.rmsnorm_quant_fp8(hidden, residual, norm.weight, norm.eps,
                                                consumer.input_scale)
            return Fp8Activation(data, scale, hidden.dtype)
        if residual is None:
            return norm(hidden)
        norm.forward_add(hidden, residual)
        return hidden


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                 params_dtype: torch.dtype, tp_rank: int, tp_size: int, qk_norm: bool = False,
                 quant_config: Optional[QuantConfig] = None,
                 windows: Optional[Sequence[int]] = None):
        """windows: each layer's sliding window (0: none); None: no layer has one."""
        super().__init__()
        windows = list(windows) if windows is not None else [0] * config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   params_dtype, tp_rank, tp_size)
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(config, i, qkv_bias, o_bias, mlp_bias, params_dtype, tp_rank, tp_size,
                              qk_norm, quant_config, windows[i])
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype)
        # [max_context, head_dim] float32 = [cos | sin]
        cache = build_cos_sin_cache(config.head_dim, config.max_context,
                                    config.rope_theta, config.rope_scaling,
                                    device=self.norm.weight.device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)           # [num_tokens, hidden_size]
        residual = None
        cpu_attn = CpuDecodeAttention.for_batch(fb, hidden.dtype)   # built once for all layers
        for layer in self.layers:
            hidden, residual = layer(fb, hidden, residual, self.cos_sin_cache, cpu_attn)
        self.norm.forward_add(hidden, residual)
        return hidden


# ----------------------------------------------------------------------------- causal LMs

# (fused parameter, HF name, shard id)
_STACKED_PARAMS = (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
                   ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))
# a backbone saved without its causal-LM wrapper (HF's Qwen3Model / LlamaModel ..., e.g.
# Qwen3-Embedding's checkpoints) names these without the "model." prefix
_BARE_PREFIXES = ("embed_tokens.", "layers.", "norm.")
# checkpoint entries that carry no parameter of ours (recomputed buffers)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' KV-cache scales: ModelOpt writes self_attn.k_proj.k_scale, compressed-tensors
# self_attn.k_scale (and some exports self_attn.attn.k_scale); all are read as self_attn.k_scale
_KV_SCALE_NAME = re.compile(r"\.(?:k_proj|v_proj|attn)\.([kv]_scale)$")
# older FP8 exports name them after the k / v projections' outputs: self_attn.k_proj.output_scale
_KV_OUTPUT_SCALE_NAME = re.compile(r"\.([kv])_proj\.output_scale$")


def set_kv_cache_scales(model: nn.Module) -> int:
    """Give each attention layer the FP8 KV-cache scales of its checkpoint
    (model.checkpoint_kv_scales, which load_weights fills: "model.layers.N.self_attn.k_scale" /
    ".v_scale" -> value), 1.0 where the checkpoint has none or one that is not finite and > 0
    (logged). Returns the number of layers that got a scale from the checkpoint. The runner calls
    it before the KV pool is made; an FP8 pool's store and attention ops then use the scales."""
    import math

    found = getattr(model, "checkpoint_kv_scales", None) or {}
    count = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        prefix = f"model.layers.{attn.layer_id}.self_attn."
        got = False
        for which in ("k", "v"):
            value = found.get(f"{prefix}{which}_scale")
            if value is not None and not (math.isfinite(value) and value > 0):
                logger.warning("checkpoint %s%s_scale = %r is not a finite positive scale; the "
                               "FP8 KV cache uses 1.0", prefix, which, value)
                value = None
            got = got or value is not None
            setattr(attn, f"{which}_scale", 1.0 if value is None else float(value))
        count += got
    return count


def hf_layer_types(config: ModelConfig, default: Sequence[str]) -> List[str]:
    """config.json's layer_types ("sliding_attention" / "full_attention" per layer), else
    default; ValueError when its length is not the layer count."""
    types = config.hf_config.get("layer_types") or list(default)
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {config.num_hidden_layers} "
                         f"layers")
    return list(types)


def windows_of_types(types: Sequence[str], window: Optional[int]) -> List[int]:
    """Per layer: window for a "sliding_attention" layer, 0 for any other (or without a window)."""
    return [int(window or 0) if t == "sliding_attention" else 0 for t in types]


def log_windows(config: ModelConfig, windows: Sequence[int]) -> None:
    if any(windows):
        sizes = sorted({w for w in windows if w})
        logger.info("%s: sliding window of %s positions on %d of %d layers",
                    config.architecture, "/".join(map(str, sizes)), sum(1 for w in windows if w),
                    len(windows))


class CausalLM(nn.Module):
    """What every decoder here shares (LlamaForCausalLM, model/gemma3.py's Gemma3ForCausalLM):
    the forward / compute_logits contract of the module docstring over self.model and
    self.lm_head, and HF-named weight loading into the fused, sliced parameters. A subclass
    builds self.config, tp_rank / tp_size, quant_config, checkpoint_kv_scales, self.model (with
    .layers[i].self_attn) and self.lm_head."""

    # the final logits' soft-capping (Gemma 2): logits -> c * tanh(logits / c); 0: none
    final_logit_softcap = 0.0
    # False when the checkpoint had no LM head (model/loader.py: lm_head_optional, an
    # embedding model's backbone): compute_logits must not be used then
    lm_head_loaded = True

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """fb -> hidden [num_tokens, hidden_size] (final norm applied); writes K/V into fb.kv_pool."""
        with torch.inference_mode():
            return self.model(fb)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """hidden [n, hidden_size] -> logits [n, vocab_size] float32 (None on a tensor-parallel
        rank other than 0, which only sends its LM-head shard to rank 0)."""
        with torch.inference_mode():
            logits = lm_head_logits(self.lm_head, hidden)
            cap = self.final_logit_softcap
            if cap and logits is not None:
                logits = torch.tanh(logits / cap) * cap
            return logits

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[Tuple[str, int]]:
        """Copy HF-named tensors into our (fused, sliced) parameters.

        Returns the set of (parameter name, shard id) filled. Raises ValueError on a name that
        maps to no parameter or a tensor of the wrong shape. FP8 checkpoints: weight_scale and
        input_scale load into the FP8 layers (quant/fp8.py); an FP8 weight of a layer kept in
        the model dtype (an LM head the checkpoint quantized) is dequantized with its
        weight_scale; an input_scale such a layer does not use is skipped; KV-cache scales
        (k_scale, v_scale) go to a parameter of that name if the model has one, else into
        checkpoint_kv_scales.
        """
        loader = self.weight_loader()
        for name, tensor in weights:
            loader.feed(name, tensor)
        return loader.finish()

    def weight_loader(self) -> "WeightLoader":
        """load_weights one tensor at a time: feed(name, tensor) each, then finish()."""
        return WeightLoader(self)

    def expected_weights(self) -> Set[Tuple[str, int]]:
        """Every (parameter name, shard id) a complete checkpoint fills."""
        expected = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rsplit(".", 1)[0])
            scheme = getattr(module, "quant", None)
            if scheme is not None and not scheme.expects(name.rsplit(".", 1)[1]):
                continue                        # weight_scale of weights quantized at load
            shards = len(module.shards) if isinstance(module, ColumnParallelLinear) else 1
            expected.update((name, sid) for sid in range(shards))
        return expected


class LlamaForCausalLM(CausalLM):
    """Llama 2/3/3.1 and SmolLM2 (also the base of Mistral and Qwen2). See the module docstring."""

    qkv_bias_default = False   # q/k/v bias when config.json says nothing (Llama: attention_bias)
    o_proj_follows_attention_bias = True
    qk_norm = False            # per-head RMSNorm of q and k before rope (Qwen3)

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, quant_config: Optional[QuantConfig] = None):
        """quant_config: the FP8 linear layers (quant/fp8.py; model/loader.py resolves it from
        --quantization and the checkpoint); None: what config.json's quantization_config says
        (none without one). The LM head and the embeddings stay in params_dtype."""
        super().__init__()
        self.config = config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        if quant_config is None:
            quant_config = checkpoint_quant_config(config.hf_config)
        self.quant_config = quant_config
        # KV-cache scales an FP8 checkpoint carries that no parameter of ours takes
        # ({self_attn name + ".k_scale" / ".v_scale": value}), for the KV cache's use
        self.checkpoint_kv_scales: Dict[str, float] = {}
        qkv_bias = self._qkv_bias(config)
        o_bias = config.attention_bias and self.o_proj_follows_attention_bias
        mlp_bias = bool(config.hf_config.get("mlp_bias", False))
        windows = self.layer_windows(config)
        log_windows(config, windows)
        self.model = LlamaModel(config, qkv_bias, o_bias, mlp_bias, params_dtype, tp_rank, tp_size,
                                self.qk_norm, quant_config, windows)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype,
                                          tp_rank, tp_size)

    def _qkv_bias(self, config: ModelConfig) -> bool:
        return config.attention_bias

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> List[int]:
        """Each layer's sliding window (0: none), as HF transformers applies config.json's for
        this architecture. Llama: none (HF's Llama ignores sliding_window)."""
        if config.hf_config.get("sliding_window"):
            logger.info("%s: sliding_window=%s is ignored, as HF transformers ignores it for "
                        "this architecture", config.architecture,
                        config.hf_config["sliding_window"])
        return [0] * config.num_hidden_layers


class WeightLoader:
    """CausalLM.load_weights, fed one checkpoint tensor at a time (feed), so several
    tensor-parallel shards can load from one read of each tensor (model/loader.py); finish()
    loads what waited for a later tensor (an FP8 weight of a layer kept in the model dtype and
    its weight_scale) and returns the (parameter name, shard id) pairs filled."""

    def __init__(self, model: "CausalLM"):
        self.model = model
        self.params: Dict[str, nn.Parameter] = dict(model.named_parameters())
        self.loaded: Set[Tuple[str, int]] = set()
        self.pending: Dict[str, Dict[str, Any]] = {}   # HF module -> FP8 weight, weight_scale, dtype

    def feed(self, name: str, tensor: torch.Tensor) -> None:
        model, params, loaded, pending = self.model, self.params, self.loaded, self.pending
        if name.endswith(_IGNORED_SUFFIXES):
            return
        if name.startswith(_BARE_PREFIXES):
            name = "model." + name
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            return
        name = _KV_OUTPUT_SCALE_NAME.sub(r".\1_scale", name)   # older: k_proj.output_scale
        if name.endswith((".k_scale", ".v_scale")):
            kv_name = _KV_SCALE_NAME.sub(r".\1", name)
            if kv_name in params:
                params[kv_name].data.copy_(tensor.reshape(params[kv_name].shape))
                loaded.add((kv_name, 0))
            else:
                model.checkpoint_kv_scales[kv_name] = float(tensor.float().reshape(-1)[0])
            return
        target, shard_id = name, 0
        for fused, hf_name, sid in _STACKED_PARAMS:
            if f".{hf_name}." in name:
                target, shard_id = name.replace(f".{hf_name}.", f".{fused}."), sid
                break
        hf_module, leaf = name.rsplit(".", 1)
        if leaf in ("weight_scale", "input_scale") and target not in params:
            if leaf == "weight_scale":      # of an FP8 weight kept in the model dtype
                pending.setdefault(hf_module, {})["weight_scale"] = tensor
            return
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of "
                             f"{type(model).__name__}")
        if tensor.dtype == FP8_DTYPE and params[target].dtype != FP8_DTYPE:
            pending.setdefault(hf_module, {}).update(weight=tensor, dtype=params[target].dtype)
            return
        module_name, param_name = target.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if target == name and isinstance(module, ColumnParallelLinear) and \
                module.is_fused(param_name, tensor):
            module.load_fused(param_name, tensor)
            loaded.update((target, sid) for sid in range(len(module.shards)))
            return
        module.load_weight(param_name, tensor, shard_id)
        loaded.add((target, shard_id))

    def finish(self) -> Set[Tuple[str, int]]:
        for hf_module, parts in self.pending.items():
            if "weight" not in parts:
                continue                        # a scale beside a weight stored unquantized
            if "weight_scale" not in parts:
                raise ValueError(f"checkpoint tensor {hf_module}.weight is FP8 but the "
                                 f"checkpoint has no {hf_module}.weight_scale")
            scale = parts["weight_scale"].float().reshape(-1)
            dequantized = parts["weight"].float() * (scale if scale.numel() == 1 else scale[:, None])
            self.loaded |= self.model.load_weights([(hf_module + ".weight",
                                                     dequantized.to(parts["dtype"]))])
        self.pending = {}
        return self.loaded


def _every_layer_window(config: ModelConfig) -> List[int]:
    """config.sliding_window on every layer (HF's Mistral and Phi-3), none when it is unset."""
    return [int(config.hf_config.get("sliding_window") or 0)] * config.num_hidden_layers


def _qwen_layer_windows(config: ModelConfig) -> List[int]:
    """HF's Qwen2 / Qwen3: a window only with use_sliding_window, on the layers layer_types
    marks sliding, else on those from max_window_layers (default 28) on."""
    cfg = config.hf_config
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if not window:
        return [0] * config.num_hidden_layers
    first = cfg.get("max_window_layers", 28)
    default = ["sliding_attention" if i >= first else "full_attention"
               for i in range(config.num_hidden_layers)]
    return windows_of_types(hf_layer_types(config, default), window)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama-shaped (no biases); config.sliding_window on every layer, as HF applies it
    (it reads no use_sliding_window)."""

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> List[int]:
        return _every_layer_window(config)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: bias on q/k/v (always), none on o_proj; usually tied embeddings. A sliding window
    only with use_sliding_window (false in released checkpoints): _qwen_layer_windows."""

    o_proj_follows_attention_bias = False

    def _qkv_bias(self, config: ModelConfig) -> bool:
        return True

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> List[int]:
        return _qwen_layer_windows(config)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 / Phi-4: Llama-shaped; the checkpoint stores q|k|v and gate|up fused (loaded by
    splitting, ColumnParallelLinear.load_fused). Rope over part of the head
    (partial_rotary_factor, Phi-4-mini) and longrope scaling (the 128k variants) are refused;
    config.sliding_window applies to every layer, as in HF (2047 in Phi-3-mini-4k)."""

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> List[int]:
        return _every_layer_window(config)

    def __init__(self, config: ModelConfig, params_dtype: torch.dtype = torch.float32,
                 tp_rank: int = 0, tp_size: int = 1, quant_config: Optional[QuantConfig] = None):
        rope = config.rope_scaling or {}
        partial = config.hf_config.get("partial_rotary_factor",
                                       rope.get("partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor {partial} is not supported (rope over the "
                             f"whole head only)")
        super().__init__(config, params_dtype, tp_rank, tp_size, quant_config)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense): q_norm / k_norm on every head before rope; biases as attention_bias says
    (false in released checkpoints), on q/k/v and o alike. Windows as Qwen2's."""

    qk_norm = True

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> List[int]:
        return _qwen_layer_windows(config)


MODEL_REGISTRY: Dict[str, Type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # backbones saved without the LM wrapper (HF's AutoModel; embedding models): the same
    # decoder, its weights named without "model." (WeightLoader), the LM head usually absent
    # (model/loader.py: lm_head_optional, --is-embedding)
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": MistralForCausalLM,
    "Qwen2Model": Qwen2ForCausalLM,
    "Qwen3Model": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> Type[LlamaForCausalLM]:
    """The Llama-family class for a config.json architecture name; ValueError naming the
    supported ones. The loader asks model/architectures.get_model_class, which adds Gemma."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None
