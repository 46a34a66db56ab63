"""ops.bitmask_sample on the CPU without sorting the vocabulary: the filtered distribution of
reference.filtered_probs, drawn with one counter-based uniform per row.

The reference (ops/reference.py) is the oracle: it sorts every sampled row over the whole
vocabulary (16 rows of 49,152 tokens: ~21 ms on 2 cores), then draws with a torch.Generator
per row (~0.9 ms a row for multinomial's own pass). At batch 16 on the default model that was
~75 ms of a ~105 ms greedy decode step. Here:

  * plain rows (temperature only: top_k off, top_p >= 1, min_p == 0) keep every token, so they
    need no order at all: softmax, then an inverse-CDF draw in token-id order;
  * filtered rows (top_k / top_p / min_p) keep a prefix of the descending order. torch.topk
    gives the C best tokens (C = 64, then 1024); when the prefix ends inside them (its first
    rejected rank r < C, and the probability at r differs from the last kept one's, so ties
    cannot move the cut), the kept set and its values are the reference's exactly: the keep
    rule reads only ranks <= r, and the cumulative sums of the same values in the same order are
    the same floats. Rows that need more (or tie at the cut) take a stable full sort, which is
    the reference itself;
  * the uniform of a row is the CUDA kernel's uniform_from(seed, offset) (Philox4x32-10 keyed by
    the seed, counter (offset, 0, 0), 53 bits), computed for the whole batch at once with numpy:
    no generator objects, the same u on both devices.

The draw: id = the smallest token id i with sum_{j <= i} q_j > u * sum_j q_j, over the kept
weights q in token-id order (float64 running sums, in two levels: _draw). It is a pure function
of (seed, offset, the filtered distribution), whatever the batch holds and however ties are
ordered. The distribution and the determinism are tested against the reference in
tests/unit/test_cpu_fast_paths.py; bench/cpu_sampling.py measures the cost in a decode step.

Scratch tensors of the batch's size live in `workspace` (per thread), and nothing here uses
index_select on a whole batch when the rows are all of it: on the CPU both a fresh multi-MB
tensor (page faults) and a needless copy cost as much as the softmax itself.
"""
from __future__ import annotations

import threading
from typing import List, Optional, Tuple

import numpy as np
import torch

from radixserve.ops import reference as ref

# candidate counts tried with torch.topk before a row falls back to the full stable sort
CANDIDATE_ROUNDS = (64, 1024)
# tokens per block of the two-level inverse-CDF draw (_draw)
DRAW_BLOCK = 256

_M32 = np.uint64(0xFFFFFFFF)


class _Workspace(threading.local):
    """Reused [rows, vocab]-sized scratch tensors, one set per thread. On the CPU a fresh
    multi-megabyte tensor each step costs its page faults (a softmax of [16, 49152] into new
    memory took ~0.9 ms inside a decode step, ~0.5 ms into a reused buffer). A buffer is flat,
    grows to the largest size asked and is viewed to the shape asked; its contents are only
    valid until the next call that asks for the same name on the same thread."""

    def __init__(self):
        self.flat = {}

    def get(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        buf = self.flat.get((name, dtype))
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):     # a normal tensor: writable in and out of it
                buf = torch.empty(numel, dtype=dtype)
            self.flat[(name, dtype)] = buf
        return buf[:numel].view(shape)


workspace = _Workspace()


def philox4x32_10(key0: np.ndarray, key1: np.ndarray,
                  ctr: Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 (Salmon et al., SC'11) on arrays: key0, key1 and the four counter words are
    uint64 arrays of 32-bit values, one lane per element; returns the four output words (uint64
    arrays of 32-bit values). csrc/include/radixserve/sampling.cuh: philox4x32_10."""
    k0, k1 = key0.copy(), key1.copy()
    c0, c1, c2, c3 = (c.copy() for c in ctr)
    for _ in range(10):
        p0 = c0 * np.uint64(0xD2511F53)          # < 2^64: exact in uint64
        p1 = c2 * np.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return c0, c1, c2, c3


def uniforms(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The uniform in [0, 1) of each row, as the CUDA kernel's uniform_from(seed, offset) makes it:
    seeds, offsets [n] int64 (CPU) -> [n] float64, 53 random bits of Philox(seed; offset)."""
    s = seeds.numpy().astype(np.int64).view(np.uint64)
    o = offsets.numpy().astype(np.int64).view(np.uint64)
    zero = np.zeros_like(s)
    c0, c1, _, _ = philox4x32_10(s & _M32, s >> np.uint64(32),
                                 (o & _M32, o >> np.uint64(32), zero, zero))
    bits = ((c0 >> np.uint64(5)) << np.uint64(26)) | (c1 >> np.uint64(6))
    return torch.from_numpy(bits.astype(np.float64) * (1.0 / 9007199254740992.0))


def _keep_prefix(vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """reference.filtered_probs' keep rule on the first C ranks of each row's descending order.
    vals [g, C] float32 (descending), k [g] int64 (already clamped to vocab), top_p, min_p [g]
    float32 -> [g] int64: the kept prefix's length, counted within the C ranks."""
    rank = torch.arange(vals.shape[1])[None, :]
    keep = rank < k[:, None]
    cum_before = vals.cumsum(-1) - vals
    keep &= (cum_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= vals >= (min_p[:, None] * vals[:, :1])
    keep[:, 0] = True
    return ((~keep).cumsum(-1) == 0).sum(-1)


def kept_sets(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
              min_p: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The kept tokens of filtered rows, in groups.

    probs [n, vocab] float32: softmax(masked logits / temperature), finite rows; top_k [n] (<= 0
    or > vocab: off), top_p, min_p [n] float32.
    Returns [(rows [g] int64 into n, vals [g, C] float32 descending, idx [g, C] int64,
    lengths [g] int64)]: row rows[j] keeps the tokens idx[j, :lengths[j]] with probabilities
    vals[j, :lengths[j]]: the set, and the values, reference.filtered_probs keeps (before its
    renormalisation).
    """
    n, vocab = probs.shape
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
    tp, mp = top_p.float(), min_p.float()
    groups = []
    pending = torch.arange(n)
    for c in CANDIDATE_ROUNDS:
        if pending.numel() == 0 or c >= vocab:
            break
        vals, idx = torch.topk(_take(probs, pending, n), c, dim=-1)          # [g, c] descending
        lengths = _keep_prefix(vals, k[pending], tp[pending], mp[pending])  # [g]
        # decided inside the c ranks: the first rejected rank r = length is among them, and
        # the probability at r differs from the last kept one (a tie at the cut is ordered by
        # token id in the reference; topk's order among ties is its own)
        inside = lengths < c
        at_cut = lengths.clamp(max=c - 1)
        last = vals.gather(1, (at_cut - 1).clamp(min=0)[:, None])[:, 0]
        nxt = vals.gather(1, at_cut[:, None])[:, 0]
        done = inside & ((last != nxt) | (last == 0))
        if bool(done.any()):
            groups.append((pending[done], vals[done], idx[done], lengths[done]))
        pending = pending[~done]
    if pending.numel():
        # the reference's own order: the stable sort of the whole row (ties by token id)
        vals, idx = _take(probs, pending, n).sort(dim=-1, descending=True, stable=True)
        lengths = _keep_prefix(vals, k[pending], tp[pending], mp[pending])
        groups.append((pending, vals, idx, lengths))
    return groups


def _is_plain(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
              vocab: int) -> torch.Tensor:
    """[n] bool: rows that keep every token (top_k off or >= vocab, top_p >= 1, min_p <= 0)."""
    k = top_k.long()
    return ((k <= 0) | (k >= vocab)) & (top_p >= 1.0) & (min_p <= 0.0)


def _probs(logits: torch.Tensor, bitmask: Optional[torch.Tensor],
           temperature: torch.Tensor) -> torch.Tensor:
    """softmax(masked logits / temperature) as reference.filtered_probs computes it:
    logits [n, vocab] -> [n, vocab] float32, in the workspace (valid until the next call)."""
    x = logits.float()
    if bitmask is not None:
        x = ref.apply_bitmask(x, bitmask)
    scaled = torch.div(x, temperature.float().clamp(min=1e-6)[:, None],
                       out=workspace.get("scaled", tuple(x.shape), torch.float32))
    return torch.softmax(scaled, dim=-1, out=workspace.get("probs", tuple(x.shape), torch.float32))


def filtered_probs(logits: torch.Tensor, bitmask: Optional[torch.Tensor], temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """reference.filtered_probs through this module's kept sets: [n, vocab] float32, equal to
    the reference's output bit for bit on rows with finite logits (the test of the kept sets)."""
    probs = _probs(logits, bitmask, temperature)
    out = torch.zeros_like(probs)
    plain = _is_plain(top_k, top_p, min_p, probs.shape[1])
    out[plain] = probs[plain]
    rows = (~plain).nonzero().flatten()
    for grp, vals, idx, lengths in kept_sets(probs[rows], top_k[rows], top_p[rows], min_p[rows]):
        kept = torch.arange(vals.shape[1])[None, :] < lengths[:, None]
        out[rows[grp]] = torch.zeros(grp.numel(), probs.shape[1]).scatter_(
            -1, idx, torch.where(kept, vals, torch.zeros_like(vals)))
    return out / out.sum(-1, keepdim=True)


def _draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: weights [g, m] float32 >= 0 in token-id order (each row with a
    positive one), u [g] float64 -> [g] int64 column: the first j whose running sum of weights
    exceeds u * (the row's sum), never a column of weight 0.

    In two levels, so that no float64 pass runs over the whole row (a float64 cumsum of a
    49k-token row costs ~0.18 ms, the float32 block sums ~0.003 ms): the float64 running sum of
    the rows' DRAW_BLOCK-token block sums picks the block, the float64 running sum inside that
    block (offset by the blocks before it) picks the token.
    """
    weights = weights.contiguous()
    g, m = weights.shape
    blk = DRAW_BLOCK
    nfull = m // blk
    sums = []
    if nfull:                                       # the whole blocks, viewed [g, nfull, blk]
        sums.append(weights.as_strided((g, nfull, blk), (weights.stride(0), blk, 1)).sum(-1))
    if m % blk:                                     # a last, shorter block
        sums.append(weights[:, nfull * blk:].sum(-1, keepdim=True))
    bsum = sums[0] if len(sums) == 1 else torch.cat(sums, dim=-1)           # [g, nb]
    nb = bsum.shape[1]
    bcdf = bsum.double().cumsum(-1)                                          # [g, nb]
    target = (u * bcdf[:, -1])[:, None]                                      # [g, 1]
    b = torch.searchsorted(bcdf, target, right=True)[:, 0].clamp(max=nb - 1)  # [g]
    before = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0],
                         torch.zeros_like(target[:, 0]))
    cols = b[:, None] * blk + torch.arange(blk)[None, :]                     # [g, blk]
    inner = weights.gather(1, cols.clamp(max=m - 1))
    inner = torch.where(cols < m, inner, torch.zeros_like(inner))            # [g, blk]
    icdf = inner.double().cumsum(-1) + before[:, None]                       # [g, blk]
    j = torch.searchsorted(icdf, target, right=True)[:, 0].clamp(max=blk - 1)
    col = (b * blk + j).clamp(max=m - 1)
    # the block's float32 sum and its float64 running sum differ by rounding: a target past the
    # block's last token (or u * sum rounded up to the sum) takes the last positive weight
    # at or before the end of the chosen block
    bad = weights.gather(1, col[:, None])[:, 0] <= 0
    if bool(bad.any()):
        end = (b[bad] + 1) * blk
        every = torch.arange(m)[None, :]
        last = torch.where((weights[bad] > 0) & (every < end[:, None]), every, -1)
        col[bad] = last.max(-1).values
    return col


def _take(t: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """t[rows] for rows [n] increasing indices into t's count rows; t itself when rows are all of
    them (no copy: a copy of a [16, 49k] batch costs as much as the softmax)."""
    return t if rows.numel() == count else t.index_select(0, rows)


def bitmask_sample(logits: torch.Tensor, bitmask: Optional[torch.Tensor], temperature: torch.Tensor,
                   top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                   seeds: torch.Tensor, offsets: torch.Tensor, want_logprobs: bool = True
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """ops.bitmask_sample's contract, for CPU tensors (shapes and dtypes there).

    logits [B, vocab] float32 / bfloat16 -> (ids [B] int64, logprobs [B] float32, or None when
    not want_logprobs: the full log_softmax is then skipped).
    Greedy rows (temperature 0) and rows with non-finite probabilities: the first argmax of the
    masked logits, as the reference. Other rows: a draw from reference.filtered_probs' distribution
    (see the module docstring for the rule), a pure function of (seed, offset, that distribution).
    logprobs: log_softmax(raw logits) at the id, computed as the reference does.
    """
    batch, vocab = logits.shape
    x = logits.float()
    ids = torch.zeros(batch, dtype=torch.int64)
    sampled = temperature > 0
    s_rows = sampled.nonzero().flatten()                                     # [n]
    fallback = (~sampled).nonzero().flatten()
    if s_rows.numel():
        probs = _probs(_take(x, s_rows, batch),
                       None if bitmask is None else _take(bitmask, s_rows, batch),
                       _take(temperature, s_rows, batch))                    # [n, vocab]
        # a non-finite logit (or a row with every token masked) makes its whole softmax row NaN
        total = probs.sum(-1)
        finite = torch.isfinite(total) & (total > 0)
        if not bool(finite.all()):
            fallback = torch.cat([fallback, s_rows[~finite]])
            s_rows, probs = s_rows[finite], probs[finite]
        n = s_rows.numel()
        u = uniforms(_take(seeds, s_rows, batch), _take(offsets, s_rows, batch))        # [n]
        tk, tp, mp = (_take(t, s_rows, batch) for t in (top_k, top_p, min_p))
        plain = _is_plain(tk, tp, mp, vocab)
        p_rows = plain.nonzero().flatten()
        if p_rows.numel():
            ids[s_rows[p_rows]] = _draw(_take(probs, p_rows, n), u[p_rows])
        rest = (~plain).nonzero().flatten()
        if rest.numel():
            for grp, vals, idx, lengths in kept_sets(_take(probs, rest, n), tk[rest], tp[rest],
                                                     mp[rest]):
                # the kept tokens in token-id order (the rest pushed past them with weight 0)
                kept = torch.arange(vals.shape[1])[None, :] < lengths[:, None]
                key = torch.where(kept, idx, torch.full_like(idx, vocab))
                key, order = key.sort(dim=-1)
                w = torch.where(key < vocab, vals.gather(1, order), torch.zeros_like(vals))
                col = _draw(w, u[rest[grp]])
                ids[s_rows[rest[grp]]] = key.gather(1, col[:, None])[:, 0]
    if fallback.numel():
        xm = x.index_select(0, fallback)
        if bitmask is not None:
            xm = ref.apply_bitmask(xm, bitmask.index_select(0, fallback))
        ids[fallback] = xm.argmax(dim=-1)
    if not want_logprobs:
        return ids, None
    logprobs_all = torch.log_softmax(x, dim=-1, out=workspace.get(
        "logprobs", tuple(x.shape), torch.float32))                          # [B, vocab]
    return ids, logprobs_all.gather(-1, ids[:, None])[:, 0] if batch else logprobs_all[:, 0]
