"""Plain-torch references of every op behind the seam (radixserve.ops).

These run on any device and are the test oracle for the CUDA kernels in csrc/. They
compute in float32 internally and return the dtype the CUDA op returns. Signatures and
contracts are documented once, in radixserve/ops/__init__.py.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- KV cache


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_indices: torch.Tensor) -> None:
    # k_cache, v_cache: [num_slots, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    idx = slot_indices.long()
    k_cache.index_copy_(0, idx, k.to(k_cache.dtype))
    v_cache.index_copy_(0, idx, v.to(v_cache.dtype))


def build_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, kv_indptr: torch.Tensor,
                     kv_indices: torch.Tensor) -> None:
    # req_to_token: [max_reqs, max_context_len] int32; req_pool_indices, seq_lens: [batch]
    # kv_indptr: [batch + 1] int32 (out); kv_indices: [>= sum(seq_lens)] int32 (out)
    batch = req_pool_indices.shape[0]
    lens = seq_lens.to(torch.int64)
    kv_indptr[0] = 0
    if batch == 0:
        return
    kv_indptr[1:batch + 1] = torch.cumsum(lens, 0).to(kv_indptr.dtype)
    total = int(lens.sum())
    if total == 0:
        return
    max_len = int(lens.max())
    rows = req_to_token[req_pool_indices.long(), :max_len]                   # [batch, max_len]
    mask = torch.arange(max_len, device=rows.device)[None, :] < lens[:, None]
    kv_indices[:total] = rows[mask].to(kv_indices.dtype)


# ----------------------------------------------------------------------------- attention


def padded_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor):
    """Each request's KV slots as a padded batch: (slots [batch * max_len] int64, slot 0 past a
    request's length; valid [batch, max_len] bool; lens [batch] int64)."""
    lens = (kv_indptr[1:] - kv_indptr[:-1]).long()
    batch = lens.shape[0]
    max_len = int(lens.max()) if batch else 0
    pos = torch.arange(max_len, device=kv_indptr.device)
    valid = pos[None, :] < lens[:, None]                                       # [batch, max_len]
    flat = (kv_indptr[:-1].long()[:, None] + pos[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
    slots = torch.where(valid, kv_indices.long()[flat], torch.zeros_like(flat)).flatten()
    return slots, valid, lens


def _gather_padded(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # [num_slots, num_kv_heads, head_dim] -> [batch, max_len, num_kv_heads, head_dim] float
    return cache.index_select(0, slots).view(tuple(valid.shape) + tuple(cache.shape[1:])).float()


def _padded_kv(k_cache, v_cache, kv_indptr, kv_indices):
    """Gather each request's K/V into a padded batch: [batch, max_len, num_kv_heads, head_dim]."""
    slots, valid, lens = padded_slots(kv_indptr, kv_indices)
    return _gather_padded(k_cache, slots, valid), _gather_padded(v_cache, slots, valid), valid, lens


def _gqa_expand(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    # [batch, len, num_kv_heads, head_dim] -> [batch, num_q_heads, len, head_dim]
    group = num_q_heads // x.shape[2]
    return x.repeat_interleave(group, dim=2).transpose(1, 2)


def padded_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slots: torch.Tensor, valid: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """paged_decode_attention over a table from padded_slots (which a caller may build once and
    reuse for every layer of a step): q [batch, num_q_heads, head_dim] -> the same shape."""
    k, v = _gather_padded(k_cache, slots, valid), _gather_padded(v_cache, slots, valid)
    # one fused softmax(q k^T) v over the padded batch; GQA without expanding K/V
    out = F.scaled_dot_product_attention(
        q.float()[:, :, None, :],                                              # [b, hq, 1, d]
        k.transpose(1, 2), v.transpose(1, 2),                                  # [b, hkv, len, d]
        attn_mask=valid[:, None, None, :], scale=sm_scale, enable_gqa=True)    # [b, hq, 1, d]
    return out[:, :, 0, :].to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           sm_scale: float) -> torch.Tensor:
    # q: [batch, num_q_heads, head_dim] -> out: [batch, num_q_heads, head_dim]
    if q.shape[0] == 0:
        return torch.empty_like(q)
    slots, valid, _ = padded_slots(kv_indptr, kv_indices)
    return padded_decode_attention(q, k_cache, v_cache, slots, valid, sm_scale)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, sm_scale: float) -> torch.Tensor:
    # q: [num_q_tokens, num_q_heads, head_dim] -> out: same shape
    num_q_heads = q.shape[1]
    batch = qo_indptr.shape[0] - 1
    if batch == 0 or q.shape[0] == 0:
        return torch.empty_like(q)
    k, v, valid, kv_lens = _padded_kv(k_cache, v_cache, kv_indptr, kv_indices)
    k, v = _gqa_expand(k, num_q_heads), _gqa_expand(v, num_q_heads)         # [b, hq, lk, d]
    q_lens = (qo_indptr[1:] - qo_indptr[:-1]).long()
    max_q = int(q_lens.max())
    qpos = torch.arange(max_q, device=q.device)
    q_valid = qpos[None, :] < q_lens[:, None]                                  # [b, max_q]
    flat = (qo_indptr[:-1].long()[:, None] + qpos[None, :]).clamp(max=q.shape[0] - 1)
    qp = q.float()[flat]                                                       # [b, max_q, hq, d]
    qp = qp.transpose(1, 2)                                                    # [b, hq, max_q, d]
    # query i of request b sits at kv position prefix_len + i and sees kv positions <= it
    prefix = (kv_lens - q_lens)[:, None]                                       # [b, 1]
    kpos = torch.arange(k.shape[2], device=q.device)
    allowed = (kpos[None, None, :] <= (prefix + qpos[None, :])[:, :, None]) & valid[:, None, :]
    scores = torch.matmul(qp, k.transpose(-1, -2)) * sm_scale                 # [b, hq, max_q, lk]
    scores = scores.masked_fill(~allowed[:, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, v).transpose(1, 2)                               # [b, max_q, hq, d]
    return out[q_valid].to(q.dtype)


# ----------------------------------------------------------------------------- sampling


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits of tokens whose bit is 0 to -inf. bitmask: [batch, ceil(vocab/32)] int32."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(torch.int32)[:, :, None] >> bits) & 1).bool()     # [batch, words, 32]
    allowed = allowed.reshape(bitmask.shape[0], -1)[:, :vocab]
    return logits.masked_fill(~allowed, float("-inf"))


def filtered_probs(logits: torch.Tensor, bitmask: Optional[torch.Tensor], temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The distribution bitmask_sample draws from, for rows with temperature > 0: [batch, vocab] f32.

    Order: bitmask -> temperature -> top_k -> top_p -> min_p, then renormalise.
    top_k <= 0 or >= vocab disables top-k; top_p == 1 disables top-p; min_p == 0 disables min-p.
    """
    x = logits.float()
    if bitmask is not None:
        x = apply_bitmask(x, bitmask)
    vocab = x.shape[-1]
    t = temperature.float().clamp(min=1e-6)[:, None]
    probs = torch.softmax(x / t, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)[:, None]
    keep = rank < k
    # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays)
    cum_before = sorted_p.cumsum(-1) - sorted_p
    keep &= cum_before < top_p.float()[:, None]
    keep &= sorted_p >= (min_p.float()[:, None] * sorted_p[:, :1])
    keep[:, 0] = True
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    out = torch.zeros_like(probs).scatter_(-1, order, kept)
    return out / out.sum(-1, keepdim=True)


def _row_generator(seed: int, offset: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + int(offset)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def bitmask_sample(logits: torch.Tensor, bitmask: Optional[torch.Tensor], temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   seeds: torch.Tensor, offsets: torch.Tensor):
    # logits: [batch, vocab]; returns (ids [batch] int64, logprobs [batch] float32)
    batch = logits.shape[0]
    x = logits.float()
    raw_logprobs = torch.log_softmax(x, dim=-1)
    masked = apply_bitmask(x, bitmask) if bitmask is not None else x
    ids = masked.argmax(dim=-1)
    sample_rows = (temperature > 0).nonzero().flatten().tolist()
    if sample_rows:
        probs = filtered_probs(logits[sample_rows], None if bitmask is None else bitmask[sample_rows],
                               temperature[sample_rows], top_k[sample_rows], top_p[sample_rows],
                               min_p[sample_rows])
        for j, row in enumerate(sample_rows):
            if not bool(torch.isfinite(probs[j]).all()) or not float(probs[j].sum()) > 0:
                continue   # non-finite logits: keep the argmax; the NaN logprob flags the row
            g = _row_generator(int(seeds[row]), int(offsets[row]), probs.device)
            ids[row] = torch.multinomial(probs[j], 1, generator=g)[0]
    logprobs = raw_logprobs.gather(-1, ids[:, None])[:, 0] if batch else raw_logprobs[:, 0]
    return ids.long(), logprobs


# ----------------------------------------------------------------------------- elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; weight: [hidden]
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    # in place: residual <- residual + x; x <- rms_norm(residual) * weight. residual: dtype of x
    # or float32; the norm is of the fp32 sum, each output is rounded once to its own dtype
    if residual.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"residual dtype must equal x dtype ({x.dtype}) or be float32, got "
                         f"{residual.dtype}")
    summed = x.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    x.copy_(rms_norm(summed, weight, eps).to(x.dtype))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    # in place, neox style (rotate halves). q: [num_tokens, num_q_heads, head_dim];
    # k: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_pos, head_dim] f32 = [cos | sin]
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half].float(), t[..., half:2 * half].float()
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        t[..., :half] = r1.to(t.dtype)
        t[..., half:2 * half] = r2.to(t.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * inter] -> [num_tokens, inter]
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    # logits: [rows, vocab] -> [rows] int64
    return logits.argmax(dim=-1)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    # x: [m, k], weight: [n, k] -> [m, n]
    return F.linear(x, weight, bias)


def skinny_gated_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    # x: [m, k], weight: [2 * inter, k] -> [m, inter]
    return silu_and_mul(F.linear(x, weight, bias))
