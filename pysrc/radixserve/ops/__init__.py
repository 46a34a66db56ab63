"""The op seam: every compute op radixserve runs, each with one signature.

On CUDA tensors, when the extension radixserve._C is built, an op runs our kernel
(torch.ops.radixserve.*); otherwise it runs the plain-torch reference in ops/reference.py,
which is also the test oracle. Kernels and references are interchangeable: same shapes,
same dtypes, same mutation contract. The references keep their intermediates within
reference.TILE_BYTES per tile (attention in tiles of requests, heads and query rows), so a
long prompt fits where the kernels are missing.

Index dtypes: slot indices and indptrs are int32 on the kernel path; references accept
int32 or int64. Naming: *_indptr has length batch + 1; *_indices are KV pool slots.

Sliding windows and soft-capping (model/llama.py's Mistral / Phi-3 / Qwen windows,
model/gemma3.py): paged_decode_attention and paged_extend_attention take window (a query at
position p attends KV positions (p - window, p], the window counting itself; None or 0: the
whole context) and softcap (scores -> softcap * tanh(scores / softcap) before the mask; None or
0: none). The kernels take the window: decode attends each request's last `window` KV tokens,
extend runs its mma.sync kernel (the sm_90a wgmma kernel takes none), skipping the KV tiles
before a query tile's window and masking the band's lower edge. No kernel takes a soft-cap yet:
such a call runs the torch reference on CUDA too (correct, slower, and not capturable in a CUDA
graph: the runner keeps graphs off for such models), logged once per process
(attention_kernel_takes); so does a head_dim the kernels are not built for (64 and 128 are).

FP8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the pool's pages are torch.float8_e4m3fn /
float8_e5m2. store_kv (and rotary_embedding_store_kv) write x / scale, saturated to the format's
largest finite value (reference.quantize_fp8), with the layer's k_scale / v_scale (fp32 scalars,
passed as Python floats: a CUDA graph captures them as launch arguments, no host sync); the
attention ops read the pages back times the same scales (the reference dequantizes, then
attends; the kernels convert FP8 to 16-bit floats as they load K/V and fold k_scale into the
softmax scale and v_scale into the output's normalisation). For other caches the scales are
ignored.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional

import torch

from radixserve import knobs
from radixserve.ops import reference as ref
from radixserve.ops._ext import kernels_available
from radixserve.ops.reference import KV_FP8_DTYPES, is_fp8  # noqa: F401  (re-exported)


logger = logging.getLogger(__name__)

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


# head dims the attention kernels are built for (csrc/ops/attention.cu's dispatch)
ATTENTION_HEAD_DIMS = (64, 128)


def attention_kernel_takes(window: Optional[int] = None, softcap: Optional[float] = None,
                           head_dim: Optional[int] = None) -> bool:
    """Whether the attention kernels (decode and extend) serve a call with this window,
    soft-capping and head_dim (None: not asked): any window, no cap (no kernel takes one yet), a
    head_dim of ATTENTION_HEAD_DIMS (Phi-3's 96 and Gemma's 256 are not built). False: the op
    runs the torch reference, on CUDA too."""
    return not softcap and (head_dim is None or head_dim in ATTENTION_HEAD_DIMS)


_REFERENCE_ROUTES_LOGGED = set()


def _log_reference_route(op: str, softcap: Optional[float], head_dim: int) -> None:
    """Say once per op and reason that a CUDA call ran the reference for want of a kernel."""
    what = "soft-capping" if softcap else f"head_dim {head_dim}"
    if (op, what) in _REFERENCE_ROUTES_LOGGED:
        return
    _REFERENCE_ROUTES_LOGGED.add((op, what))
    logger.warning("%s with %s runs the torch reference on CUDA: the attention kernels take no "
                   "soft-cap and head dims %s only (correct, slower)", op, what,
                   "/".join(map(str, ATTENTION_HEAD_DIMS)))


class SampleOutput(NamedTuple):
    ids: torch.Tensor       # [batch] int64
    logprobs: torch.Tensor  # [batch] float32: log softmax of the raw logits at ids


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_indices: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new K/V rows into the pool, in place.

    k_cache, v_cache: [num_slots, num_kv_heads, head_dim] (bf16/fp16/fp32 or FP8, contiguous)
    k, v:             [num_tokens, num_kv_heads, head_dim], same dtype as the cache (an FP8
                      cache: bf16/fp16/fp32 k and v, stored as quantize_fp8(k, k_scale),
                      quantize_fp8(v, v_scale), bit for bit the reference's bytes)
    k_scale, v_scale: the layer's FP8 scales (> 0); ignored by other caches
    slot_indices:     [num_tokens] int32/int64, each < num_slots, no duplicates except the
                      padding slot 0 (padded rows of a CUDA-graph batch all write there; which
                      row's K/V it ends up holding is unspecified, and nothing reads it)
    Mutates k_cache[slot_indices], v_cache[slot_indices]; nothing else.
    """
    if _use_kernel(k_cache):
        torch.ops.radixserve.store_kv(k_cache, v_cache, k, v, slot_indices, k_scale, v_scale)
    else:
        ref.store_kv(k_cache, v_cache, k, v, slot_indices, k_scale, v_scale)


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
                           sm_scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, kernel: Optional[str] = None,
                           window: Optional[int] = None,
                           softcap: Optional[float] = None) -> torch.Tensor:
    """One query token per request over its paged KV (page size 1).

    q:        [batch, num_q_heads, head_dim]; num_q_heads % num_kv_heads == 0 (GQA)
    k_cache:  [num_slots, num_kv_heads, head_dim], v_cache likewise, same dtype as q, or FP8
              (read as k_cache * k_scale, v_cache * v_scale; scales ignored otherwise)
    kv_indptr:[batch + 1] int32, kv_indices: [nnz] int32 (as build_kv_indices makes them);
              every request has at least one KV token (its own)
    returns   [batch, num_q_heads, head_dim], dtype of q: softmax(q k^T * sm_scale) v
    The kernel takes bf16/fp16; float32 runs the torch reference on any device. Batches that
    fill the GPU without splitting requests, with 4 to 8 q heads per kv head (per subgroup) and
    head_dim a multiple of 64, run on tensor cores (P rounded to q's dtype before P V, as flash
    attention does; with an FP8 cache the tensor-core products run in fp16, K/V converted from
    FP8 exactly, q rounded to fp16, P rounded to fp16); the rest, or everything with kernel
    "simt", on the CUDA-core kernel.
    kernel:   "auto" or "simt"; None: the knob RADIXSERVE_DECODE_KERNEL (knobs.py: the
              --debug-decode-kernel flag, else the environment, else auto), read per call and
              passed to the op with RADIXSERVE_DECODE_NO_SPLIT_TOKENS (requests this short are
              never split; None: the kernel's 256). A CUDA graph replays what it captured.
    window:   None or 0: the whole KV; w > 0: only the request's last w KV positions (its own
              and the w - 1 before it: HF's sliding_window convention, Mistral's and Gemma's);
              neither the kernel nor the reference reads a slot before them
    softcap:  None or 0; c > 0: scores -> c * tanh(scores / c) before the softmax (Gemma 2)
    With a cap, or a head_dim other than 64 or 128, the reference runs, on CUDA too
    (attention_kernel_takes), logged once.
    """
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (0 or None: none), got {window}")
    if not attention_kernel_takes(window, softcap, q.shape[-1]):
        if _use_attention_kernel(q):
            _log_reference_route("paged_decode_attention", softcap, q.shape[-1])
        return ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale,
                                          k_scale, v_scale, window, softcap)
    if _use_attention_kernel(q):
        return torch.ops.radixserve.paged_decode_attention(
            _kernel_q(q), k_cache, v_cache, kv_indptr, kv_indices, sm_scale, k_scale, v_scale,
            kernel or knobs.value("RADIXSERVE_DECODE_KERNEL"),
            knobs.value("RADIXSERVE_DECODE_NO_SPLIT_TOKENS"), int(window or 0))
    return ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale,
                                      k_scale, v_scale, window)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, kernel: Optional[str] = None,
                           window: Optional[int] = None,
                           softcap: Optional[float] = None) -> torch.Tensor:
    """New query tokens over [cached prefix + themselves], causal among the new tokens.

    q:         [num_q_tokens, num_q_heads, head_dim], requests concatenated
    qo_indptr: [batch + 1] int32: request b's queries are q[qo_indptr[b]:qo_indptr[b+1]]
    kv_indptr, kv_indices: request b's KV slots (prefix, then its new tokens, already stored
               with store_kv); extend_len_b = qo_len_b <= kv_len_b
    Query i of request b sits at position kv_len_b - qo_len_b + i and attends KV positions <= it.
    returns    [num_q_tokens, num_q_heads, head_dim], dtype of q
    k_cache, v_cache as for paged_decode_attention (q's dtype, or FP8 read times the scales).
    The kernel takes bf16/fp16; float32 runs the torch reference on any device. With an FP8
    cache the mma.sync kernel runs (also on sm_90a: the wgmma kernel reads 16-bit tiles only),
    its products in fp16 (K/V converted from FP8 exactly, Q and P rounded to fp16).
    kernel:    "auto" (wgmma on sm_90a where the build has it, else mma.sync) or "mma" (mma.sync
               always); None: the knob RADIXSERVE_EXTEND_KERNEL (knobs.py), read per call.
    window:    None or 0: causal over the whole KV; w > 0: the query at position p attends KV
               positions (p - w, p] only (w positions, itself included); the reference slices
               each request's KV from its first query's window start (nothing before it is
               read) and masks the rest of the band; the kernel is then the mma.sync one, which
               loads no KV tile wholly before a query tile's window
    softcap:   as for paged_decode_attention
    With a cap, or a head_dim other than 64 or 128, the reference runs, on CUDA too
    (attention_kernel_takes), logged once.
    """
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 (0 or None: none), got {window}")
    if not attention_kernel_takes(window, softcap, q.shape[-1]):
        if _use_attention_kernel(q):
            _log_reference_route("paged_extend_attention", softcap, q.shape[-1])
        return ref.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                          sm_scale, k_scale, v_scale, window, softcap)
    if _use_attention_kernel(q):
        return torch.ops.radixserve.paged_extend_attention(
            _kernel_q(q), k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, k_scale,
            v_scale, kernel or knobs.value("RADIXSERVE_EXTEND_KERNEL"), int(window or 0))
    return ref.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                      sm_scale, k_scale, v_scale, window)


def extend_attention_kernel(q: torch.Tensor, kernel: Optional[str] = None) -> str:
    """Which kernel paged_extend_attention runs for q (a bf16/fp16 CUDA tensor, head_dim 64 or
    128) over a 16-bit pool: "wgmma_sm90" or "mma_sm80"; kernel as for paged_extend_attention.
    Needs radixserve._C."""
    return torch.ops.radixserve.extend_attention_kernel(
        q, kernel or knobs.value("RADIXSERVE_EXTEND_KERNEL"))


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
    """x: [num_tokens, hidden], weight: [hidden] -> [num_tokens, hidden] (new tensor):
    x * rsqrt(mean(x^2) + eps) * weight in fp32, rounded once to x's dtype. weight: x's dtype,
    or float32 beside a bf16/fp16 x (Gemma's 1 + w, model/gemma3.py), which the reference
    computes (on CUDA too: the kernel reads weights of x's dtype only)."""
    if _use_kernel(x) and weight.dtype == x.dtype:
        return torch.ops.radixserve.rms_norm(x, weight, eps)
    return ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: residual <- residual + x, then x <- rms_norm(residual) * weight.

    x:        [num_tokens, hidden] bf16/fp16/fp32, contiguous
    residual: [num_tokens, hidden] contiguous, dtype of x or float32 (half-precision models keep
              their residual stream in fp32: model/llama.py)
    weight:   [hidden], dtype of x, or float32 (then the reference runs, as for rms_norm)
    The sum is formed in fp32 and rounded once into residual's dtype; the norm is taken of the
    fp32 sum (not of the rounded residual) and rounded once into x's dtype.
    Raises (ValueError on the reference, RuntimeError on the kernel) for any other residual dtype.
    """
    if _use_kernel(x) and weight.dtype == x.dtype:
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
                              slot_indices: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> None:
    """rotary_embedding(positions, q, k, cos_sin_cache) then store_kv(k_cache, v_cache, k, v,
    slot_indices, k_scale, v_scale), in one kernel launch: the rotated k (and v) rows land in
    the pool (an FP8 pool: quantized as store_kv does; k itself stays rotated in q's dtype).
    Arguments and mutation as for those two ops; k and v must have each token's
    [num_kv_heads, head_dim] row contiguous (views into a fused qkv buffer do)."""
    if _use_kernel(q):
        torch.ops.radixserve.rotary_embedding_store_kv(positions, q, k, v, cos_sin_cache,
                                                       k_cache, v_cache, slot_indices,
                                                       k_scale, v_scale)
    else:
        ref.rotary_embedding(positions, q, k, cos_sin_cache)
        ref.store_kv(k_cache, v_cache, k, v, slot_indices, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] = [gate | up] -> silu(gate) * up: [num_tokens, inter]."""
    if _use_kernel(x):
        return torch.ops.radixserve.silu_and_mul(x)
    return ref.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * inter] = [gate | up] -> gelu_tanh(gate) * up: [num_tokens, inter]
    (Gemma's MLP: HF's gelu_pytorch_tanh), computed in fp32 and rounded once to x's dtype.
    The reference only (torch ops, on CUDA too: no kernel yet)."""
    return ref.gelu_tanh_and_mul(x)


# ----------------------------------------------------------------------------- FP8 linear layers
# FP8 (float8_e4m3fn) weights with fp32 scales, one per output channel ([N]) or one in all ([1]);
# activations per token (dynamic: one scale per row, amax / 448) or per tensor (static: the
# checkpoint's input_scale). Quantization of a value v with scale s: clamp(v / s, -448, 448)
# rounded to e4m3. The references (ops/reference.py) dequantize and compute in fp32: the oracle
# of every kernel below, and what the CPU runs.

FP8_ACT_QUANT = ("none", "dynamic", "static")


@functools.lru_cache(maxsize=None)
def _extension_has(op: str) -> bool:
    return hasattr(torch.ops.radixserve, op)


def _use_kernel_op(op: str, t: torch.Tensor) -> bool:
    """t is on a GPU, radixserve._C is in use and registers op."""
    return _use_kernel(t) and _extension_has(op)


@functools.lru_cache(maxsize=None)
def _rowwise_scaled_mm_device(index: int) -> bool:
    """torch._scaled_mm's rowwise scaling (CUTLASS, fp32 scales per row of A and column of B)
    runs on sm_90+."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(index) >= (9, 0)


def fp8_scaled_mm_fits(x_fp8: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether fp8_scaled_mm runs torch._scaled_mm for x_fp8 [M, K] and weight [N, K]: CUDA e4m3
    tensors on an sm_90+ GPU, M >= 1, K and N multiples of 16, both contiguous (weight.t() is
    then the column-major second operand cuBLASLt wants). RADIXSERVE_DISABLE_KERNELS=1 does not
    turn it off: it is torch's GEMM, not one of ours."""
    return (x_fp8.is_cuda and weight.is_cuda and x_fp8.dtype == torch.float8_e4m3fn
            and weight.dtype == torch.float8_e4m3fn and x_fp8.dim() == 2 and weight.dim() == 2
            and x_fp8.shape[0] >= 1 and x_fp8.shape[1] == weight.shape[1]
            and x_fp8.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0
            and x_fp8.is_contiguous() and weight.is_contiguous()
            and _rowwise_scaled_mm_device(x_fp8.device.index if x_fp8.device.index is not None
                                          else torch.cuda.current_device()))


# rmsnorm_quant_fp8's kernel keeps a row in registers: rows of up to this many elements
# (csrc/include/radixserve/fp8_quant.cuh); longer rows run the reference.
FP8_NORM_KERNEL_MAX = 8192


def _rows16(t: torch.Tensor) -> bool:
    """t [rows, cols]: each row contiguous and starting at a 16-byte boundary."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
            and t.data_ptr() % 16 == 0)


def _fp8_quant_kernel_fits(x: torch.Tensor, input_scale: Optional[torch.Tensor]) -> bool:
    """Whether the FP8 quantization kernels take x: bf16/fp16 [rows, hidden], hidden a multiple
    of 8, 16-byte rows, and a static scale (if any) of one fp32 value on x's device."""
    return (x.dtype in _HALF_DTYPES and x.dim() == 2 and x.shape[1] % 8 == 0 and _rows16(x)
            and (input_scale is None or (input_scale.dtype == torch.float32
                                         and input_scale.numel() == 1
                                         and input_scale.device == x.device)))


def fp8_quantize(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None):
    """Quantize activations to e4m3 for a W8A8 GEMM.

    x:           [M, K] bf16/fp16/fp32
    input_scale: None: dynamic, one scale per row (token): amax(|x[m]|) / 448 (floored at
                 1e-12 / 448); else [1] (or a 0-dim) fp32 static per-tensor scale used for
                 every row
    returns      (x_fp8 [M, K] float8_e4m3fn contiguous, x_scale [M, 1] fp32 contiguous) with
                 x[m] ~= x_fp8[m].float() * x_scale[m]; no host synchronisation (the scales stay
                 on the device)
    A kernel when radixserve._C registers fp8_quantize, else the reference (torch ops, also on a
    GPU).
    """
    if _fp8_quant_kernel_fits(x, input_scale) and _use_kernel_op("fp8_quantize", x):
        return torch.ops.radixserve.fp8_quantize(x, input_scale)
    return ref.fp8_quantize(x, input_scale)


def fp8_scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The W8A8 GEMM: out[m, n] = (sum_k x_fp8[m, k] * weight[n, k]) * x_scale[m] *
    weight_scale[n] (+ bias[n]), accumulated in fp32.

    x_fp8:        [M, K] float8_e4m3fn (rows from fp8_quantize or rmsnorm_quant_fp8)
    x_scale:      [M, 1] fp32
    weight:       [N, K] float8_e4m3fn, contiguous (nn.Linear layout)
    weight_scale: [N] fp32 per output channel, or [1] per tensor
    bias:         None or [N] in out_dtype
    returns       [M, N] out_dtype
    CUDA (sm_90+, fp8_scaled_mm_fits): torch._scaled_mm with rowwise scales, called as the
    knob RADIXSERVE_FP8_SCALED_MM says (scaled_mm_rowwise), bf16 output; an fp16/fp32 out_dtype
    is converted from it, and the bias is added after the GEMM in out_dtype, so it is rounded
    twice where the reference rounds once. Elsewhere the reference: fp32 math, rounded once into
    out_dtype.
    """
    if x_fp8.shape[0] and fp8_scaled_mm_fits(x_fp8, weight):
        out = scaled_mm_rowwise(x_fp8, x_scale, weight, weight_scale,
                                knobs.value("RADIXSERVE_FP8_SCALED_MM"))
        if out_dtype != torch.bfloat16:
            out = out.to(out_dtype)
        return out if bias is None else out.add_(bias.to(out_dtype))
    return ref.fp8_scaled_mm(x_fp8, x_scale, weight, weight_scale, bias, out_dtype)


def scaled_mm_rowwise(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale: torch.Tensor, variant: str = "plain") -> torch.Tensor:
    """torch._scaled_mm of x_fp8 [M, K] e4m3 (scales x_scale [M, 1] fp32) and weight [N, K] e4m3
    (weight_scale [N] or [1] fp32) -> [M, N] bf16 contiguous, as variant (the knob
    RADIXSERVE_FP8_SCALED_MM) calls it:
      plain      _scaled_mm(x_fp8, weight.t()), scale_a x_scale [M, 1], scale_b [1, N]
      fast       the same with use_fast_accum=True
      swap       _scaled_mm(weight, x_fp8.t()) -> [N, M] (scale_a [N, 1], scale_b [1, M]),
                 transposed back by a copy; plain where M % 16 != 0 (the second operand's
                 columns must be a multiple of 16)
      swap-fast  swap with use_fast_accum=True
    The same sums in every variant; fast accumulation may round them differently."""
    m, n = x_fp8.shape[0], weight.shape[0]
    fast = variant in ("fast", "swap-fast")
    ws = weight_scale.float().reshape(-1)
    if ws.numel() != n:
        ws = ws.expand(n)
    xs = x_scale.float()
    if variant in ("swap", "swap-fast") and m % 16 == 0:
        out_t = torch._scaled_mm(weight, x_fp8.t(), scale_a=ws.reshape(n, 1).contiguous(),
                                 scale_b=xs.reshape(1, m).contiguous(), out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)                            # [N, M]
        return out_t.t().contiguous()
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=xs.reshape(m, 1),
                            scale_b=ws.reshape(1, n).contiguous(), out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


# fp8_skinny_linear (csrc/include/radixserve/fp8_gemv.cuh) serves up to this many rows.
FP8_SKINNY_MAX_ROWS = 16
# Up to how many rows fp8_skinny_linear runs its CUDA-core kernel (fp8_gemv_cc.cuh) instead of
# the tensor-core one: -1 = where that kernel serves by default (fp8_gemv_cc::serves_by_default,
# measured per shape: the fused gate|up at 1-2 rows, rows of >= 8192 bytes at 1), 0 = never,
# 1..4. Read at every call (so at CUDA-graph capture): bench/fp8_speed.py's A/B sets it before a
# model is built; the server leaves it at -1.
FP8_CUDA_CORE_ROWS = -1


def fp8_skinny_linear_fits(x: torch.Tensor, weight: torch.Tensor,
                           weight_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether fp8_linear(act_quant="none") runs the fp8_skinny_linear kernel: CUDA, the
    extension in use, x bf16 [m, k] with 1 <= m <= FP8_SKINNY_MAX_ROWS, rows contiguous and
    16-byte aligned, k a multiple of 16, weight e4m3 [n, k] contiguous and 16-byte aligned,
    weight_scale contiguous fp32 [n] or [1], bias None or contiguous bf16 [n]."""
    return (x.dtype == torch.bfloat16 and x.dim() == 2 and weight.dim() == 2
            and weight.dtype == torch.float8_e4m3fn and 1 <= x.shape[0] <= FP8_SKINNY_MAX_ROWS
            and x.shape[1] == weight.shape[1] and x.shape[1] % 16 == 0 and x.shape[1] > 0
            and x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
            and weight_scale.numel() in (1, weight.shape[0])
            and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()))
            and weight.is_cuda and _use_kernel_op("fp8_skinny_linear", x))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: Optional[torch.Tensor] = None, *, act_quant: str,
               input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x W^T (+ bias) for an FP8 weight W = weight.float() * weight_scale[:, None].

    x:            [M, K] bf16/fp16/fp32
    weight:       [N, K] float8_e4m3fn, contiguous
    weight_scale: [N] fp32 (per output channel) or [1] (per tensor)
    bias:         None or [N] in x's dtype
    act_quant:    how the activations enter the GEMM (the caller's choice: model/llama.py's
                  fp8_act_quant):
                  "none"    weight-only (W8A16): the weight dequantized, math in x's dtype. CUDA:
                            fp8_skinny_linear where fp8_skinny_linear_fits (dequantization in
                            registers, bf16 x bf16 -> fp32 on the tensor cores, or fp32 FMAs
                            on the CUDA cores up to FP8_CUDA_CORE_ROWS rows); elsewhere the
                            reference: (weight.float() * scale).to(x.dtype), then F.linear in
                            x's dtype (on a GPU that dequantizes the whole weight per call)
                  "dynamic" W8A8: x quantized per token (fp8_quantize(x)), then fp8_scaled_mm
                  "static"  W8A8: x quantized with input_scale ([1] fp32), then fp8_scaled_mm
    input_scale:  [1] fp32, required for "static", ignored otherwise
    returns       [M, N] in x's dtype
    """
    if act_quant not in FP8_ACT_QUANT:
        raise ValueError(f"act_quant must be one of {FP8_ACT_QUANT}, not {act_quant!r}")
    if act_quant == "none":
        if fp8_skinny_linear_fits(x, weight, weight_scale, bias):
            return torch.ops.radixserve.fp8_skinny_linear(x, weight, weight_scale, bias, False,
                                                          FP8_CUDA_CORE_ROWS)
        return ref.fp8_linear(x, weight, weight_scale, bias, "none", None)
    if act_quant == "static" and input_scale is None:
        raise ValueError("fp8_linear: act_quant 'static' needs input_scale")
    x_fp8, x_scale = fp8_quantize(x, input_scale if act_quant == "static" else None)
    return fp8_scaled_mm(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_skinny_gated_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The MLP's FP8 gate|up projection and activation in one, weight-only (W8A16):
    silu_and_mul(fp8_linear(x, weight, weight_scale, bias, act_quant="none")).

    x:            [m, k] bf16
    weight:       [2 * inter, k] float8_e4m3fn = [gate rows | up rows]
    weight_scale: [2 * inter] fp32 (per weight row) or [1]
    bias:         None or [2 * inter] bf16
    returns       [m, inter] in x's dtype
    CUDA: the fp8_skinny_linear kernel's gated form where fp8_skinny_linear_fits and the row
    count is even; it rounds each projection to bf16 before the activation, as the two separate
    ops do, so both paths give the same bits, and never writes the [m, 2 * inter] projection.
    Elsewhere the two ops (the reference on a CPU).
    """
    if fp8_skinny_linear_fits(x, weight, weight_scale, bias) and weight.shape[0] % 2 == 0:
        return torch.ops.radixserve.fp8_skinny_linear(x, weight, weight_scale, bias, True,
                                                      FP8_CUDA_CORE_ROWS)
    return silu_and_mul(fp8_linear(x, weight, weight_scale, bias, act_quant="none"))


def rmsnorm_quant_fp8(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float, input_scale: Optional[torch.Tensor] = None):
    """RMSNorm (with the residual add, when residual is given) fused with the FP8 quantization
    of its output: the input of a W8A8 GEMM (q|k|v, gate|up) straight from the norm.

    x:           [num_tokens, hidden] bf16/fp16/fp32 (not modified)
    residual:    None, or [num_tokens, hidden] contiguous, dtype of x or float32: then, in place,
                 residual <- residual + x (the sum in fp32, rounded once into residual's dtype)
    weight:      [hidden], dtype of x
    input_scale: None: per-token scales (dynamic); [1] fp32: that static scale for every row
    returns      (x_fp8 [num_tokens, hidden] float8_e4m3fn, x_scale [num_tokens, 1] fp32) =
                 fp8_quantize(y, input_scale) where y = rms_norm(sum or x) * weight rounded to
                 x's dtype: exactly fused_add_rms_norm (or rms_norm) then fp8_quantize, so the
                 fused and unfused paths agree bit for bit on the reference.
    A kernel when radixserve._C registers rmsnorm_quant_fp8, else the reference.
    """
    if (_fp8_quant_kernel_fits(x, input_scale) and x.shape[1] <= FP8_NORM_KERNEL_MAX
            and (residual is None or _rows16(residual))
            and _use_kernel_op("rmsnorm_quant_fp8", x)):
        return torch.ops.radixserve.rmsnorm_quant_fp8(x, residual, weight, eps, input_scale)
    return ref.rmsnorm_quant_fp8(x, residual, weight, eps, input_scale)
