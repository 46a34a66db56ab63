"""Plain-torch references of every op behind the seam (radixserve.ops).

These run on any device and are the test oracle for the CUDA kernels in csrc/. They
compute in float32 internally and return the dtype the CUDA op returns. Signatures and
contracts are documented once, in radixserve/ops/__init__.py. They work in bounded memory:
attention in tiles, the row-wise ops in slices of rows, each tile's intermediates within
TILE_BYTES, so long prompts run where the CUDA extension is absent (a GPU without _C, the CPU).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------- KV cache


# The FP8 formats a KV cache may be stored in (--kv-cache-dtype fp8_e4m3 / fp8_e5m2).
KV_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in KV_FP8_DTYPES


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x / scale in `dtype` (an FP8 format), saturating: fp32(x) * fp32(1 / scale), clamped to
    the format's largest finite value (a NaN stays NaN), rounded to nearest even. The kernels
    compute exactly this (the same fp32 product and rounding), so their bytes are equal."""
    fmax = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp_(-fmax, fmax).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (FP8) as fp32 times scale: the values attention reads from an FP8 cache."""
    return x.float().mul_(scale)          # one fp32 copy (x is FP8, so .float() is new)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_indices: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    # k_cache, v_cache: [num_slots, num_kv_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    # an FP8 cache stores quantize_fp8(k, k_scale), quantize_fp8(v, v_scale); other caches ignore
    # the scales
    idx = slot_indices.long()
    if is_fp8(k_cache):
        # written through uint8 views: torch has no index_copy_ for FP8 on the CPU
        k_cache.view(torch.uint8).index_copy_(
            0, idx, quantize_fp8(k, k_cache.dtype, k_scale).view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(
            0, idx, quantize_fp8(v, v_cache.dtype, v_scale).view(torch.uint8))
        return
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
    offset = 0
    for start, end in _row_tiles(batch, max_len):     # groups of requests (bounded tables)
        part = lens[start:end]
        n, width = (total, max_len) if end - start == batch else (int(part.sum()), int(part.max()))
        if n == 0:
            continue
        rows = req_to_token[req_pool_indices[start:end].long(), :width]     # [reqs, width]
        mask = torch.arange(width, device=rows.device)[None, :] < part[:, None]
        kv_indices[offset:offset + n] = rows[mask].to(kv_indices.dtype)
        offset += n


# ----------------------------------------------------------------------------- attention


# Bytes that the intermediates of one tile of a reference op take at most. Attention runs a
# batch in tiles (attention_plan: a few requests padded together, or one long request's KV heads
# and query rows in slices; attention_tile_bytes counts a tile) and the row-wise ops run long
# prompts in slices of rows (_row_tiles), so no op's memory grows with a prompt's length squared
# nor holds fp32 copies of a whole long prompt. Untiled, the extend reference made the
# [heads, q, kv] fp32 scores whole: 8 GiB for one 8k prompt of Llama-3.1-8B's shape.
TILE_BYTES = 256 << 20


class AttentionTile(NamedTuple):
    """One tile of a batch's paged attention (attention_plan).

    Requests [req_start, req_end), padded together; query rows [q_start, q_end) of each (a tile
    of several requests holds all their rows, padded to the longest); KV heads
    [head_start, head_end), each with its query heads; KV positions [kv_start, kv_len) of each
    request (all that a row of the tile can see). kv_start is 0 but in the row ranges of one
    request under a sliding window (attention_plan's window), where the tile's first row sees
    no position before it."""
    req_start: int
    req_end: int
    q_start: int
    q_end: int
    head_start: int
    head_end: int
    kv_len: int
    kv_start: int = 0


def attention_tile_bytes(num_reqs: int, rows: int, kv_len: int, kv_heads: int, group: int,
                         head_dim: int, kv_elem_size: int) -> int:
    """An upper bound of the bytes that one tile's intermediates take at once: num_reqs requests
    padded to `rows` query rows and kv_len KV positions, kv_heads KV heads with `group` query
    heads each, a KV cache of kv_elem_size bytes per element. It counts what SDPA's math backend
    makes (its fused CPU and CUDA backends make less):
      K and V         [reqs, kv_len, kv_heads, head_dim] each, gathered in the cache dtype,
                      then fp32, and a contiguous fp32 copy [reqs, kv_heads, kv_len, head_dim]
                      (the math backend's, to batch its matmuls)
      scores, probs   [reqs, kv_heads, group * rows, kv_len] fp32
      masks           [reqs, rows, kv_len] bool, [reqs, 1, group * rows, kv_len] bool and the
                      math backend's fp32 copy of it
      q and out       [reqs * rows, kv_heads * group, head_dim], 4 fp32 copies each
      slot tables     [reqs, kv_len] int64, 3
    """
    heads = kv_heads * group
    kv = 2 * num_reqs * kv_len * kv_heads * head_dim * (kv_elem_size + 4 + 4)
    scores = 2 * 4 * num_reqs * heads * rows * kv_len
    masks = num_reqs * rows * kv_len * (1 + 5 * group)
    q_out = 2 * 4 * 4 * num_reqs * rows * heads * head_dim
    tables = 3 * 8 * num_reqs * kv_len
    return kv + scores + masks + q_out + tables


def attention_plan(q_lens: Sequence[int], kv_lens: Sequence[int], num_q_heads: int,
                   num_kv_heads: int, head_dim: int, kv_elem_size: int,
                   tile_bytes: Optional[int] = None, window: int = 0) -> List[AttentionTile]:
    """Tiles that cover every (request, query row, query head) of a batch once, in request
    order, each within tile_bytes (default TILE_BYTES) by attention_tile_bytes.

    window > 0 (a sliding window, see paged_extend_attention): the row ranges of a request cut
    into several tiles start their KV at kv_start = the first position their first row sees
    (row i at position p sees (p - window, p]). kv_lens are then the positions the request's
    queries read: PagedAttention drops the ones before its first query's window first.

    q_lens[b] <= kv_lens[b]: request b's query row i sits at KV position
    kv_lens[b] - q_lens[b] + i and sees the positions up to it. Consecutive requests share a
    tile while all of them, padded to the longest, fit. A request too large to fit alone is cut
    into ranges of its KV heads (each with its query heads) and, within each, ranges of its
    query rows, taking the head count that makes the fewest tiles; a tile of rows
    [q_start, q_end) reads kv_len = kv_lens[b] - q_lens[b] + q_end positions. Only a tile of one
    row and one KV head can exceed the budget, by its K/V (linear in the context, no longer
    cut): past budget / (2 * head_dim * (kv_elem_size + 8) + 13 * group + 25) KV positions,
    about 100k for Llama-3.1-8B's shape with a bf16 cache at TILE_BYTES.
    """
    budget = TILE_BYTES if tile_bytes is None else tile_bytes
    group = num_q_heads // num_kv_heads

    def cost(reqs: int, rows: int, kv_len: int, heads: int) -> int:
        return attention_tile_bytes(reqs, rows, kv_len, heads, group, head_dim, kv_elem_size)

    tiles: List[AttentionTile] = []
    batch, b = len(q_lens), 0
    while b < batch:
        max_q, max_kv = q_lens[b], kv_lens[b]
        if cost(1, max_q, max_kv, num_kv_heads) > budget:
            tiles += _split_request(b, q_lens[b], kv_lens[b], num_kv_heads, budget, cost, window)
            b += 1
            continue
        end = b + 1
        while end < batch:
            more_q, more_kv = max(max_q, q_lens[end]), max(max_kv, kv_lens[end])
            if cost(end + 1 - b, more_q, more_kv, num_kv_heads) > budget:
                break
            max_q, max_kv, end = more_q, more_kv, end + 1
        tiles.append(AttentionTile(b, end, 0, max_q, 0, num_kv_heads, max_kv))
        b = end
    return tiles


def _split_request(b: int, q_len: int, kv_len: int, num_kv_heads: int, budget: int,
                   cost, window: int = 0) -> List[AttentionTile]:
    """attention_plan's tiles of one request that does not fit one: ranges of `heads` KV heads,
    each over ranges of `rows` query rows, with the (heads, rows) that fit and make the fewest
    tiles (1 and 1 when nothing fits). The cost counts the request's whole KV (its tiles share
    one gather of it); with a window, a row range reads from its first row's window start."""
    best = (None, 1, 1)                                   # (tiles, heads, rows)
    for heads in range(1, num_kv_heads + 1):
        fixed = cost(1, 0, kv_len, heads)
        per_row = cost(1, 1, kv_len, heads) - fixed
        if fixed + per_row > budget:
            break
        rows = min(q_len, (budget - fixed) // per_row)
        count = -(-num_kv_heads // heads) * -(-q_len // max(rows, 1))
        if best[0] is None or count <= best[0]:
            best = (count, heads, max(rows, 1))
    _, heads, rows = best
    prefix = kv_len - q_len
    return [AttentionTile(b, b + 1, q0, min(q0 + rows, q_len), h0,
                          min(h0 + heads, num_kv_heads), prefix + min(q0 + rows, q_len),
                          max(0, prefix + q0 - window + 1) if window > 0 else 0)
            for h0 in range(0, num_kv_heads, heads) for q0 in range(0, q_len, rows)]


class _TileIndex(NamedTuple):
    """Where a tile's rows come from and go (PagedAttention): device tensors."""
    rows: torch.Tensor             # [reqs * rows] int64: the token of each padded row (clamped)
    keep: Optional[torch.Tensor]   # [kept] int64: the padded rows that are real; None: all
    dest: torch.Tensor             # [kept] int64: the token each kept row is
    query_pos: torch.Tensor        # [reqs, rows] int64: each row's KV position


# PagedAttention keeps the tiles' masks, for every layer, while they take at most this many bytes
# in all (a decode step's always do); larger ones are made per call.
_MASK_CACHE_BYTES = 16 << 20


class PagedAttention:
    """paged_extend_attention / paged_decode_attention of one batch, in tiles (attention_plan).

    The plan and each tile's index tables depend only on the batch's indptrs (and the window),
    so a caller may build this once per step and call it for every layer of one window
    (model/cpu_attention.py does, for decode on the CPU). Each tile gathers its requests' K/V
    heads padded to its longest request (the padding repeats a request's last KV row, so no
    other slot's values are read), then runs one fused softmax(q k^T * sm_scale) v (SDPA) with
    the causal mask, a KV head's query heads folded into its query rows: the same math per
    (row, head) as one untiled call. Consecutive tiles of one request and one head range reuse
    its gathered K/V. Beside a tile's intermediates it holds O(tokens) index tables and, when
    they total at most _MASK_CACHE_BYTES, every tile's mask.

    Sliding window (window > 0): query row at position p sees KV positions (p - window, p].
    Each request's KV is sliced, not masked, before anything is gathered: its slots start at
    the first position its first query sees (kv_skip), so a decode row reads at most `window`
    positions and no slot before a request's window is ever read; within that slice, rows of a
    long request cut into row ranges start theirs at their own first row's window
    (AttentionTile.kv_start), and the mask hides what lies before each row's window.
    Soft-capping (softcap > 0, Gemma 2): scores become softcap * tanh(scores / softcap) before
    the mask and the softmax (then the scores are made explicitly, not by SDPA).
    """

    def __init__(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 qo_indptr: Optional[torch.Tensor], num_q_heads: int, num_kv_heads: int,
                 head_dim: int, kv_elem_size: int, window: Optional[int] = None):
        """kv_indptr [batch + 1], kv_indices [nnz]: each request's KV slots (int32 or int64);
        qo_indptr [batch + 1]: its query tokens (paged_extend_attention's contract), or None for
        decode (one query per request, at its last KV position). kv_elem_size: bytes per element
        of the KV cache. window: the sliding window (None or 0: the whole context)."""
        self.window = int(window or 0)
        kv_starts = kv_indptr.tolist()
        q_starts = list(range(len(kv_starts))) if qo_indptr is None else qo_indptr.tolist()
        self.q_lens = [e - s for s, e in zip(q_starts, q_starts[1:])]
        full_lens = [e - s for s, e in zip(kv_starts, kv_starts[1:])]
        # a window no request is longer than hides nothing: the plain causal plan
        if self.window > 0 and max(full_lens, default=0) <= self.window:
            self.window = 0
        # KV positions of each request before its first query's window: never read
        w = self.window
        self.kv_skip = [max(0, kv - q - w + 1) if w > 0 else 0
                        for q, kv in zip(self.q_lens, full_lens)]
        # from here on a request's KV positions count from its first one read
        self.kv_lens = [kv - skip for kv, skip in zip(full_lens, self.kv_skip)]
        kv_starts = [s + skip for s, skip in zip(kv_starts, self.kv_skip)]
        self.num_tokens = q_starts[-1] - q_starts[0] if q_starts else 0
        self.group = num_q_heads // num_kv_heads
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.tiles = attention_plan(self.q_lens, self.kv_lens, num_q_heads, num_kv_heads,
                                    head_dim, kv_elem_size, window=w)
        dev = kv_indices.device
        kv_idx = kv_indices.long()
        # (req_start, req_end) -> [reqs * max_kv] int64 slots: each request's KV padded with
        # its own last slot
        self._slots = {}
        for t in self.tiles:
            if (t.req_start, t.req_end) in self._slots:
                continue
            lens = self.kv_lens[t.req_start:t.req_end]
            starts = torch.tensor(kv_starts[t.req_start:t.req_end], dtype=torch.int64)
            last = starts + torch.tensor(lens, dtype=torch.int64).clamp(min=1) - 1
            pos = starts[:, None] + torch.arange(max(lens), dtype=torch.int64)  # [reqs, max_kv]
            flat = torch.minimum(pos, last[:, None]).clamp(min=0).flatten().to(dev)
            self._slots[(t.req_start, t.req_end)] = kv_idx[flat] if kv_idx.numel() else flat
        self._index = [self._tile_index(t, q_starts, dev) for t in self.tiles]
        mask_bytes = sum((t.req_end - t.req_start) * (t.q_end - t.q_start) *
                         (t.kv_len - t.kv_start) * 4 * self.group for t in self.tiles)
        self._masks = ([self._mask(t, i) for t, i in zip(self.tiles, self._index)]
                       if mask_bytes <= _MASK_CACHE_BYTES else None)
        # one tile whose rows are every token, in order: its output is the result as it is
        t = self.tiles[0] if len(self.tiles) == 1 else None
        self._whole = (t is not None and self._index[0].keep is None and t.head_start == 0
                       and t.head_end == num_kv_heads and
                       (t.req_end - t.req_start) * (t.q_end - t.q_start) == self.num_tokens)

    def _tile_index(self, t: AttentionTile, q_starts: List[int], dev) -> _TileIndex:
        qpos = torch.arange(t.q_start, t.q_end, dtype=torch.int64)               # [rows]
        starts = torch.tensor(q_starts[t.req_start:t.req_end], dtype=torch.int64)[:, None]
        q_lens = torch.tensor(self.q_lens[t.req_start:t.req_end], dtype=torch.int64)[:, None]
        kv_lens = torch.tensor(self.kv_lens[t.req_start:t.req_end], dtype=torch.int64)[:, None]
        tokens = (starts + qpos).flatten()                                       # [reqs * rows]
        real = (qpos < q_lens).flatten()
        keep = None if bool(real.all()) else real.nonzero()[:, 0]
        dest = tokens if keep is None else tokens[keep]
        rows = tokens.clamp(max=max(q_starts[-1] - 1, 0))
        return _TileIndex(rows.to(dev), None if keep is None else keep.to(dev), dest.to(dev),
                          (kv_lens - q_lens + qpos).to(dev))

    def _mask(self, t: AttentionTile, index: _TileIndex) -> torch.Tensor:
        """[reqs, 1, group * rows, kv_len - kv_start] fp32, added to the scores: 0 where a row
        may look (KV positions up to its own, and with a window after its own minus the window;
        which leaves out every padded position of a real row), -inf elsewhere. An additive mask,
        as SDPA's CPU and math backends would make of a bool one (at a cost per element several
        times that of the memset here)."""
        reqs, rows, group = t.req_end - t.req_start, t.q_end - t.q_start, self.group
        width = t.kv_len - t.kv_start
        dev = index.query_pos.device
        if reqs > 1 or self.window > 0:
            kpos = torch.arange(t.kv_start, t.kv_len, device=dev)
            qpos = index.query_pos[:, :, None]                               # [reqs, rows, 1]
            hidden = kpos > qpos                                             # [reqs, rows, width]
            if self.window > 0:
                hidden |= kpos <= qpos - self.window
            mask = torch.zeros(reqs, group, rows, width, device=dev)
            return mask.masked_fill_(hidden[:, None], float("-inf")) \
                .view(reqs, 1, group * rows, width)
        # one request: row r sees positions < first + r, so only a triangle right of `first`
        # (rows x (rows - 1) at most) is hidden
        first = self.kv_lens[t.req_start] - self.q_lens[t.req_start] + t.q_start + 1
        mask = torch.zeros(group, rows, t.kv_len, device=dev)
        if first < t.kv_len:
            mask[:, :, first:] = torch.full((rows, t.kv_len - first), float("-inf"),
                                            device=dev).triu_()
        return mask.view(1, 1, group * rows, t.kv_len)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                 softcap: Optional[float] = None) -> torch.Tensor:
        """q [num_tokens, num_q_heads, head_dim]; k_cache, v_cache [num_slots, num_kv_heads,
        head_dim] -> [num_tokens, num_q_heads, head_dim] in q's dtype (computed in fp32).
        An FP8 cache is dequantized as it is gathered (dequantize_fp8: times k_scale, v_scale);
        other caches ignore the scales. softcap: None or 0, or the soft-capping of the scores."""
        whole = self._whole and q.shape[0] == self.num_tokens
        out = None if whole else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group, d = self.group, self.head_dim
        kv = None           # ((requests, heads), K, V) of the last tile: [reqs, heads, max_kv, d]
        for n, (t, index) in enumerate(zip(self.tiles, self._index)):
            reqs, rows, heads = t.req_end - t.req_start, t.q_end - t.q_start, t.head_end - t.head_start
            key = (t.req_start, t.req_end, t.head_start, t.head_end)
            if kv is None or kv[0] != key:
                kv = None                                 # free the last tile's K/V first
                slots = self._slots[(t.req_start, t.req_end)]
                kv = (key, _gather_heads(k_cache, slots, reqs, t.head_start, t.head_end, k_scale),
                      _gather_heads(v_cache, slots, reqs, t.head_start, t.head_end, v_scale))
            k, v = kv[1], kv[2]
            if k.shape[2] > t.kv_len or t.kv_start:
                k, v = k[:, :, t.kv_start:t.kv_len], v[:, :, t.kv_start:t.kv_len]
            qh = q if heads * group == q.shape[1] else q[:, t.head_start * group:t.head_end * group]
            qt = (qh if whole else qh.index_select(0, index.rows)).float()
            qt = qt.reshape(reqs, rows, heads, group, d)
            qt = qt.permute(0, 2, 3, 1, 4).reshape(reqs, heads, group * rows, d)
            mask = self._masks[n] if self._masks is not None else self._mask(t, index)
            if softcap:
                o = _softcapped_attention(qt, k, v, mask, sm_scale, float(softcap))
            else:
                o = F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=sm_scale)
            o = o.reshape(reqs, heads, group, rows, d).permute(0, 3, 1, 2, 4) \
                .reshape(reqs * rows, heads * group, d)                  # [reqs * rows, hq_tile, d]
            if out is None:                               # one tile, every token in order
                return o.contiguous().to(q.dtype)
            if index.keep is not None:
                o = o.index_select(0, index.keep)
            out[:, t.head_start * group:t.head_end * group].index_copy_(0, index.dest,
                                                                       o.to(q.dtype))
        return out


def _softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          sm_scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * sm_scale / softcap) + mask) v, in fp32: q [..., n, d],
    k, v [..., len, d], mask broadcast to [..., n, len] -> [..., n, d] (HF's Gemma 2 order:
    scale, cap, then the mask)."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(sm_scale)
    scores = scores.div_(softcap).tanh_().mul_(softcap).add_(mask)
    return torch.matmul(scores.softmax(-1), v)


def _gather_heads(cache: torch.Tensor, slots: torch.Tensor, reqs: int, h0: int,
                  h1: int, scale: float = 1.0) -> torch.Tensor:
    # cache [num_slots, num_kv_heads, head_dim], slots [reqs * len]
    # -> [reqs, h1 - h0, len, head_dim] fp32 (a transposed view); an FP8 cache dequantized
    # (times scale), gathered through a uint8 view
    if is_fp8(cache):
        x = cache.view(torch.uint8)[:, h0:h1].index_select(0, slots).view(cache.dtype)
        x = dequantize_fp8(x, scale)
    else:
        x = cache[:, h0:h1].index_select(0, slots)                     # [reqs * len, heads, d]
    return x.view(reqs, -1, h1 - h0, cache.shape[-1]).float().transpose(1, 2)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                           sm_scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
                           window: Optional[int] = None,
                           softcap: Optional[float] = None) -> torch.Tensor:
    # q: [batch, num_q_heads, head_dim] -> out: [batch, num_q_heads, head_dim]
    # an FP8 cache: dequantized (times k_scale, v_scale), then attended; window: each row
    # reads only its last `window` KV positions (PagedAttention slices them); softcap: the
    # scores soft-capped
    if q.shape[0] == 0:
        return torch.empty_like(q)
    attn = PagedAttention(kv_indptr, kv_indices, None, q.shape[1], k_cache.shape[1], q.shape[2],
                          k_cache.element_size(), window)
    return attn(q, k_cache, v_cache, sm_scale, k_scale, v_scale, softcap)


def paged_extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, sm_scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0, window: Optional[int] = None,
                           softcap: Optional[float] = None) -> torch.Tensor:
    # q: [num_q_tokens, num_q_heads, head_dim] -> out: same shape; window, softcap as for decode
    if qo_indptr.shape[0] <= 1 or q.shape[0] == 0:
        return torch.empty_like(q)
    attn = PagedAttention(kv_indptr, kv_indices, qo_indptr, q.shape[1], k_cache.shape[1],
                          q.shape[2], k_cache.element_size(), window)
    return attn(q, k_cache, v_cache, sm_scale, k_scale, v_scale, softcap)


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
    top_k <= 0 or >= vocab disables top-k; top_p >= 1 disables top-p; min_p == 0 disables min-p.
    The kept set is a prefix of the tokens in decreasing probability, ties by lower token id
    (a stable sort): the longest prefix whose every token passes all three rules (the first
    token always stays). Rounding of the running sum cannot drop a token under top_p = 1.
    """
    x = logits.float()
    if bitmask is not None:
        x = apply_bitmask(x, bitmask)
    vocab = x.shape[-1]
    t = temperature.float().clamp(min=1e-6)[:, None]
    probs = torch.softmax(x / t, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)       # [batch, vocab]
    rank = torch.arange(vocab, device=x.device)[None, :]
    k = top_k.long()
    k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)[:, None]
    keep = rank < k
    # top-p keeps the smallest prefix whose mass reaches top_p (the first token always stays)
    cum_before = sorted_p.cumsum(-1) - sorted_p
    top_p = top_p.float()[:, None]
    keep &= (cum_before < top_p) | (top_p >= 1.0)
    keep &= sorted_p >= (min_p.float()[:, None] * sorted_p[:, :1])
    keep[:, 0] = True
    keep = (~keep).cumsum(-1) == 0                     # the prefix before the first rejection
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


def _row_tiles(num_rows: int, row_elems: int) -> List[Tuple[int, int]]:
    """Ranges [start, end) of rows, at least one row each, such that 8 fp32 copies of a range
    of rows of row_elems elements fit TILE_BYTES: the row-wise ops below make fewer."""
    per_tile = max(1, TILE_BYTES // max(1, 8 * 4 * row_elems))
    return [(s, min(s + per_tile, num_rows)) for s in range(0, num_rows, per_tile)]


def _rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, hidden]; weight: [hidden]; in tiles of rows (_row_tiles)
    tiles = _row_tiles(x.shape[0], x[0].numel()) if x.dim() and x.shape[0] else []
    if len(tiles) <= 1:
        return _rms_norm_rows(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for start, end in tiles:
        out[start:end] = _rms_norm_rows(x[start:end], weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    # in place: residual <- residual + x; x <- rms_norm(residual) * weight. residual: dtype of x
    # or float32; the norm is of the fp32 sum, each output is rounded once to its own dtype
    if residual.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"residual dtype must equal x dtype ({x.dtype}) or be float32, got "
                         f"{residual.dtype}")
    # in tiles of rows (_row_tiles): each a view of x and residual, written in place
    tiles = _row_tiles(x.shape[0], x[0].numel()) if x.dim() and x.shape[0] else []
    if len(tiles) > 1:
        for start, end in tiles:
            fused_add_rms_norm(x[start:end], residual[start:end], weight, eps)
        return
    summed = x.float() + residual.float()
    residual.copy_(summed.to(residual.dtype))
    x.copy_(_rms_norm_rows(summed, weight, eps).to(x.dtype))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    # in place, neox style (rotate halves). q: [num_tokens, num_q_heads, head_dim];
    # k: [num_tokens, num_kv_heads, head_dim]; cos_sin_cache: [max_pos, head_dim] f32 = [cos | sin]
    # in tiles of rows (_row_tiles)
    row_elems = q[0].numel() + k[0].numel() if q.shape[0] else 0
    tiles = _row_tiles(q.shape[0], row_elems) if q.shape[0] else []
    if len(tiles) > 1:
        for start, end in tiles:
            rotary_embedding(positions[start:end], q[start:end], k[start:end], cos_sin_cache)
        return
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        x1, x2 = t[..., :half].float(), t[..., half:2 * half].float()
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        t[..., :half] = r1.to(t.dtype)
        t[..., half:2 * half] = r2.to(t.dtype)


def _silu_and_mul_rows(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * inter] -> [num_tokens, inter]; in tiles of rows (_row_tiles)
    tiles = _row_tiles(x.shape[0], x[0].numel()) if x.dim() > 1 and x.shape[0] else []
    if len(tiles) <= 1:
        return _silu_and_mul_rows(x)
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    for start, end in tiles:
        out[start:end] = _silu_and_mul_rows(x[start:end])
    return out


def _gelu_tanh_and_mul_rows(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return (F.gelu(x[..., :d].float(), approximate="tanh") * x[..., d:].float()).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, 2 * inter] -> [num_tokens, inter]; in tiles of rows (_row_tiles)
    tiles = _row_tiles(x.shape[0], x[0].numel()) if x.dim() > 1 and x.shape[0] else []
    if len(tiles) <= 1:
        return _gelu_tanh_and_mul_rows(x)
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    for start, end in tiles:
        out[start:end] = _gelu_tanh_and_mul_rows(x[start:end])
    return out


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


# ----------------------------------------------------------------------------- FP8 (e4m3) linear
# Contracts: radixserve/ops/__init__.py (fp8_quantize, fp8_scaled_mm, fp8_linear,
# rmsnorm_quant_fp8). The math is the kernels' in fp32: an e4m3 value times an e4m3 value is exact
# in fp32, sums are fp32, scales multiply the fp32 sum, one rounding into the output dtype.

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0           # the largest finite float8_e4m3fn value
FP8_MIN_AMAX = 1e-12      # floor of a row's (or tensor's) amax: an all-zero row gets a tiny scale
#                           and quantizes to zeros instead of dividing by zero


def fp8_scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of values whose largest magnitude is amax: max(amax, FP8_MIN_AMAX) / 448
    (fp32), so that value / scale spans [-448, 448]. An IEEE division by a tensor of 448s:
    torch divides a CUDA tensor by a Python scalar as a multiplication by its reciprocal, which
    is not the correctly rounded quotient the kernels (and the CPU) compute."""
    amax = amax.float().clamp(min=FP8_MIN_AMAX)
    return amax / torch.full_like(amax, FP8_MAX)


def fp8_cast(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (fp32) clamped to +-448 and rounded to float8_e4m3fn (nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_per_row(scale: torch.Tensor, rows: int) -> torch.Tensor:
    # [rows] or [1] (or a scalar) -> [rows] fp32 (a broadcast view for [1])
    flat = scale.float().reshape(-1)
    return flat.expand(rows) if flat.numel() == 1 else flat


def fp8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] e4m3, weight_scale [N] or [1] fp32 -> weight.float() * scale per row,
    rounded once to dtype: [N, K]."""
    return (weight.float() * _scale_per_row(weight_scale, weight.shape[0])[:, None]).to(dtype)


def fp8_quantize(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None):
    # x: [M, K] -> (x_fp8 [M, K] e4m3, x_scale [M, 1] fp32); per-token amax / 448 when
    # input_scale is None, else input_scale ([1] or a scalar) on every row; in tiles of rows
    rows, cols = x.shape[0], x.shape[1]
    out = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    static = None if input_scale is None else input_scale.float().reshape(1, 1)
    for start, end in _row_tiles(rows, cols):
        xf = x[start:end].float()
        s = fp8_scale_of(xf.abs().amax(-1, keepdim=True)) if static is None \
            else static.expand(end - start, 1)
        scale[start:end] = s
        out[start:end] = fp8_cast(xf, s)
    return out, scale


def fp8_scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                  out_dtype: torch.dtype) -> torch.Tensor:
    # [M, K] e4m3 x [N, K] e4m3 -> [M, N] out_dtype: (x w^T) * x_scale[m] * w_scale[n] (+ bias)
    # in fp32, rounded once; in tiles of weight rows and of x rows (bounded fp32 copies)
    rows, n, k = x_fp8.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty((rows, n), dtype=out_dtype, device=x_fp8.device)
    ws = _scale_per_row(weight_scale, n)
    xs = x_scale.float().reshape(-1, 1)
    for n0, n1 in _row_tiles(n, k):
        wf = weight[n0:n1].float()                                      # [n1 - n0, K]
        for m0, m1 in _row_tiles(rows, k):
            acc = torch.mm(x_fp8[m0:m1].float(), wf.t())                # [m, n] fp32, exact products
            acc.mul_(xs[m0:m1]).mul_(ws[n0:n1])
            if bias is not None:
                acc.add_(bias[n0:n1].float())
            out[m0:m1, n0:n1] = acc                                     # rounded to out_dtype
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: Optional[torch.Tensor], act_quant: str,
               input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    # x: [M, K] -> [M, N] in x's dtype; act_quant "none": dequantize the weight to x's dtype and
    # F.linear in x's dtype (weight-only); "dynamic" / "static": fp8_quantize x (per token / with
    # input_scale), then fp8_scaled_mm
    if act_quant == "none":
        n, k = weight.shape
        tiles = _row_tiles(n, k)
        if len(tiles) <= 1:
            return F.linear(x, fp8_dequantize(weight, weight_scale, x.dtype), bias)
        ws = _scale_per_row(weight_scale, n)
        out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
        for n0, n1 in tiles:
            out[:, n0:n1] = F.linear(x, fp8_dequantize(weight[n0:n1], ws[n0:n1], x.dtype),
                                     None if bias is None else bias[n0:n1])
        return out
    if act_quant == "dynamic":
        x_fp8, x_scale = fp8_quantize(x)
    elif act_quant == "static":
        if input_scale is None:
            raise ValueError("fp8_linear: act_quant 'static' needs input_scale")
        x_fp8, x_scale = fp8_quantize(x, input_scale)
    else:
        raise ValueError(f"fp8_linear: act_quant must be none, dynamic or static, not {act_quant!r}")
    return fp8_scaled_mm(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)


def rmsnorm_quant_fp8(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                      eps: float, input_scale: Optional[torch.Tensor] = None):
    # residual None: y = rms_norm(x) * weight; else, in place, residual <- residual + x and
    # y = rms_norm(residual + x) * weight (fused_add_rms_norm's math, x itself unchanged);
    # y rounded to x's dtype, then fp8_quantize(y, input_scale)
    if residual is None:
        y = rms_norm(x, weight, eps)
    else:
        y = x.clone()
        fused_add_rms_norm(y, residual, weight, eps)
    return fp8_quantize(y, input_scale)
