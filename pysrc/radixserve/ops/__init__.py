"""The op seam: every compute op radixserve runs, each with one signature.

On CUDA tensors, when the extension radixserve._C is built, an op runs our kernel
(torch.ops.radixserve.*); otherwise it runs the plain-torch reference in ops/reference.py,
which is also the test oracle. Kernels and references are interchangeable: same shapes,
same dtypes, same mutation contract. The references keep their intermediates within
reference.TILE_BYTES per tile (attention in tiles of requests, heads and query rows), so a
long prompt fits where the kernels are missing.

Index dtypes: slot indices and indptrs are int32 on the kernel path; references accept
int32 or int64. Naming: *_indptr has length batch + 1; *_indices are KV pool slots.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from radixserve.ops import reference as ref
from radixserve.ops._ext import kernels_available


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda and kernels_available()


def _use_attention_kernel(q: torch.Tensor) -> bool:
    """The attention kernels are bf16/fp16 (tensor cores); float32 runs the reference."""
    return q.dtype in _HALF_DTYPES and _use_kernel(q)


def _kernel_q(q: torch.Tensor) -> torch.Tensor:
    """q as the attention kernels read it: a strided view (e.g. into a fused qkv buffer) as is
    when its last dim is contiguous and its token / head strides keep 16-byte rows, else a
    contiguous copy."""
    if q.stride(2) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0:
        return q
    return q.contiguous()


class SampleOutput(NamedTuple):
    ids: torch.Tensor       # [batch] int64
    logprobs: torch.Tensor  # [batch] float32: log softmax of the raw logits at ids


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_indices: torch.Tensor) -> None:
    """Write new K/V rows into the pool, in place.

    k_cache, v_cache: [num_slots, num_kv_heads, head_dim] (bf16/fp16/fp32, contiguous)
    k, v:             [num_tokens, num_kv_heads, head_dim], same dtype as the cache
    slot_indices:     [num_tokens] int32/int64, each < num_slots, no duplicates except the
                      padding slot 0 (padded rows of a CUDA-graph batch all write there; which
                      row's K/V it ends up holding is unspecified, and nothing reads it)
    Mutates k_cache[slot_indices], v_cache[slot_indices]; nothing else.
    """
    if _use_kernel(k_cache):
        torch.ops.radixserve.store_kv(k_cache, v_cache, k, v, slot_indices)
    else:
        ref.store_kv(k_cache, v_cache, k, v, slot_indices)


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor) -> None:
    """Radix-aware gather: flatten a batch's token-to-slot rows for attention, on the device.

    req_to_token:     [max_running_reqs, max_context_len] int32 (row r = slots of request r,
                      prefix slots from the radix tree followed by newly allocated slots)
    req_pool_indices: [batch] int32/int64, rows of req_to_token
    seq_lens:         [batch] int32/int64, tokens of each request to expose (prefix + new)
    kv_indptr (out):  [batch + 1] int32; kv_indptr[0] = 0, kv_indptr[b+1] = sum(seq_lens[:b+1])
    kv_indices (out): [>= sum(seq_lens)] int32; kv_indices[kv_indptr[b]:kv_indptr[b+1]]
                      = req_to_token[req_pool_indices[b], :seq_lens[b]]
    No host synchronisation on the kernel path (safe under CUDA graph capture).
    """
    if _use_kernel(req_to_token):
        torch.ops.radixserve.build_kv_indices(req_to_token, req_pool_indices, seq_lens,
                                              kv_indptr, kv_indices)
    else:
        ref.build_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           sm_scale: float) -> torch.Tensor:
    """One query token per request over its paged KV (page size 1).

    q:        [batch, num_q_heads, head_dim]; num_q_heads % num_kv_heads == 0 (GQA)
    k_cache:  [num_slots, num_kv_heads, head_dim], v_cache likewise, same dtype as q
    kv_indptr:[batch + 1] int32, kv_indices: [nnz] int32 (as build_kv_indices makes them);
              every request has at least one KV token (its own)
    returns   [batch, num_q_heads, head_dim], dtype of q: softmax(q k^T * sm_scale) v
    The kernel takes bf16/fp16; float32 runs the torch reference on any device. Batches that
    fill the GPU without splitting requests, with 4 to 8 q heads per kv head (per subgroup) and
    head_dim a multiple of 64, run on tensor cores (P rounded to q's dtype before P V, as flash
    attention does); the rest, or everything under RADIXSERVE_DECODE_KERNEL=simt, on the
    CUDA-core kernel.
    """
    if _use_attention_kernel(q):
        return torch.ops.radixserve.paged_decode_attention(_kernel_q(q), k_cache, v_cache,
                                                           kv_indptr, kv_indices, sm_scale)
    return ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """New query tokens over [cached prefix + themselves], causal among the new tokens.

    q:         [num_q_tokens, num_q_heads, head_dim], requests concatenated
    qo_indptr: [batch + 1] int32: request b's queries are q[qo_indptr[b]:qo_indptr[b+1]]
    kv_indptr, kv_indices: request b's KV slots (prefix, then its new tokens, already stored
               with store_kv); extend_len_b = qo_len_b <= kv_len_b
    Query i of request b sits at position kv_len_b - qo_len_b + i and attends KV positions <= it.
    returns    [num_q_tokens, num_q_heads, head_dim], dtype of q
    The kernel takes bf16/fp16; float32 runs the torch reference on any device.
    """
    if _use_attention_kernel(q):
        return torch.ops.radixserve.paged_extend_attention(_kernel_q(q), k_cache, v_cache,
                                                           qo_indptr, kv_indptr, kv_indices,
                                                           sm_scale)
    return ref.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                      sm_scale)


def bitmask_sample(logits: torch.Tensor, bitmask: Optional[torch.Tensor],
                   temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, seeds: torch.Tensor, offsets: torch.Tensor) -> SampleOutput:
    """Mask, filter and sample one token per row, without a host sync on the kernel path.

    logits:      [batch, vocab] float32 or bfloat16
    bitmask:     None or [batch, ceil(vocab / 32)] int32; bit (t % 32) of word t // 32 set = allowed
    temperature: [batch] float32; 0 means greedy (argmax of the masked logits)
    top_k:       [batch] int32; <= 0 disables
    top_p:       [batch] float32 in (0, 1]; 1 disables
    min_p:       [batch] float32 in [0, 1); 0 disables
    seeds, offsets: [batch] int64; the draw of a row is a pure function of (seed, offset, probs),
                 the engine passes the request's seed and its output length as offset
    Filter order: bitmask -> temperature -> top_k -> top_p -> min_p (reference.filtered_probs).
    Returns SampleOutput(ids [batch] int64, logprobs [batch] float32), where logprobs is the
    model's own log-probability of the id: log_softmax(logits) before mask and temperature.
    A token whose bit is 0 is never returned (unless a row masks every token).
    """
    if _use_kernel(logits):
        ids, logprobs = torch.ops.radixserve.bitmask_sample(logits, bitmask, temperature, top_k,
                                                            top_p, min_p, seeds, offsets)
    else:
        ids, logprobs = ref.bitmask_sample(logits, bitmask, temperature, top_k, top_p, min_p,
                                           seeds, offsets)
    return SampleOutput(ids, logprobs)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row: logits [rows, vocab] float32 -> ids [rows] int64, the first index
    of each row's maximum (torch.argmax's rule, a NaN counting as the maximum). The kernel splits
    a row over many CTAs (batch-1 greedy decode reads one 128k-entry row); no host sync."""
    if _use_kernel(logits) and logits.dtype == torch.float32 and logits.dim() == 2:
        return torch.ops.radixserve.argmax_rows(logits)
    return ref.argmax_rows(logits)


# The skinny GEMM serves decode batches of up to this many rows (csrc/include/radixserve/gemv.cuh).
SKINNY_MAX_ROWS = 4


def skinny_linear_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear / skinny_gated_linear run the kernel for x [m, k] and weight [n, k]:
    CUDA bf16/fp16 tensors of one dtype with the extension built, 1 <= m <= SKINNY_MAX_ROWS,
    k a multiple of 8, weight contiguous, x's rows contiguous and 16-byte aligned. Whether it
    is also the faster choice is the caller's policy (model/llama.py: skinny_gemm_ok)."""
    return (x.dtype in _HALF_DTYPES and weight.dtype == x.dtype and x.dim() == 2
            and weight.dim() == 2 and 1 <= x.shape[0] <= SKINNY_MAX_ROWS
            and x.shape[1] == weight.shape[1] and x.shape[1] % 8 == 0 and x.shape[1] > 0
            and weight.is_contiguous() and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and _use_kernel(x) and weight.is_cuda)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a few rows: x [m, k], weight [n, k], bias None or [n]
    -> [m, n] in x's dtype, fp32-accumulated (kernel: see skinny_linear_fits; values agree with
    F.linear to fp32 rounding of the sum, not bit for bit)."""
    if skinny_linear_fits(x, weight):
        return torch.ops.radixserve.skinny_linear(x, weight, bias, False)
    return ref.skinny_linear(x, weight, bias)


def skinny_gated_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MLP's gate|up projection and activation in one: silu_and_mul(F.linear(x, weight, bias)).
    x [m, k]; weight [2 * inter, k] = [gate rows | up rows]; bias None or [2 * inter]
    -> [m, inter]. The kernel rounds each projection to x's dtype before the activation, as
    the two separate ops do, and never writes the [m, 2 * inter] projection."""
    if skinny_linear_fits(x, weight) and weight.shape[0] % 2 == 0:
        return torch.ops.radixserve.skinny_linear(x, weight, bias, True)
    return ref.skinny_gated_linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [num_tokens, hidden], weight: [hidden] -> [num_tokens, hidden] (new tensor)."""
    if _use_kernel(x):
        return torch.ops.radixserve.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual <- residual + x, then x <- rms_norm(residual) * weight.

    x:        [num_tokens, hidden] bf16/fp16/fp32, contiguous
    residual: [num_tokens, hidden] contiguous, dtype of x or float32 (half-precision models keep
              their residual stream in fp32: model/llama.py)
    weight:   [hidden], dtype of x
    The sum is formed in fp32 and rounded once into residual's dtype; the norm is taken of the
    fp32 sum (not of the rounded residual) and rounded once into x's dtype.
    Raises (ValueError on the reference, RuntimeError on the kernel) for any other residual dtype.
    """
    if _use_kernel(x):
        torch.ops.radixserve.fused_add_rms_norm(x, residual, weight, eps)
    else:
        ref.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Neox-style rotary embedding, in place on q and k.

    positions:     [num_tokens] int64
    q:             [num_tokens, num_q_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]
                   (may be strided views into a fused qkv buffer: last dim contiguous)
    cos_sin_cache: [max_position, rotary_dim] float32, row p = [cos(p*f) | sin(p*f)], with any
                   rope scaling (llama3) already folded into the frequencies f
    """
    if _use_kernel(q):
        torch.ops.radixserve.rotary_embedding(positions, q, k, cos_sin_cache)
    else:
        ref.rotary_embedding(positions, q, k, cos_sin_cache)


def rotary_embedding_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, cos_sin_cache: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_indices: torch.Tensor) -> None:
    """rotary_embedding(positions, q, k, cos_sin_cache) then store_kv(k_cache, v_cache, k, v,
    slot_indices), in one kernel launch: the rotated k (and v) rows land in the pool.
    Arguments and mutation as for those two ops; k and v must have each token's
    [num_kv_heads, head_dim] row contiguous (views into a fused qkv buffer do)."""
    if _use_kernel(q):
        torch.ops.radixserve.rotary_embedding_store_kv(positions, q, k, v, cos_sin_cache,
                                                       k_cache, v_cache, slot_indices)
    else:
        ref.rotary_embedding(positions, q, k, cos_sin_cache)
        ref.store_kv(k_cache, v_cache, k, v, slot_indices)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] = [gate | up] -> silu(gate) * up: [num_tokens, inter]."""
    if _use_kernel(x):
        return torch.ops.radixserve.silu_and_mul(x)
    return ref.silu_and_mul(x)
