"""Sliding-window attention on the CPU (issue 40, point 1: the reference half): the op contract.

The window convention is HF transformers' (masking_utils.sliding_window_causal_mask_function):
a query at position p attends KV positions (p - window, p], `window` positions, itself included.

The reference ops with a window (and Gemma 2's soft-cap) against a dense float64 oracle whose mask
is HF's own mask function: decode and extend, slots scattered through the pool (page size 1),
lengths on both sides of the window edge, windows of 1 and of exactly a request's length, tiled
(rows of one long request cut, requests padded together); slots before every query's window hold
NaN, so reading one would show; the ops' CUDA routing (windowed calls take the reference, logged
once) with the kernel path faked; CPU decode tables per window.
"""
from __future__ import annotations

import logging
from typing import List

import pytest
import torch

from radixserve import ops
from radixserve.ops import reference as ref

WINDOW = 8


# ----------------------------------------------------------------------------- (a) the ops


def _hf_window_mask(window: int, q_pos: List[int], kv_len: int) -> torch.Tensor:
    """[len(q_pos), kv_len] bool, True where HF's sliding-window causal mask lets the query at
    q_pos[i] see KV position j (transformers.masking_utils' mask function, broadcast)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window)
    zero = torch.tensor(0)
    mask = fn(zero, zero, torch.tensor(q_pos)[:, None], torch.arange(kv_len)[None, :])
    return mask.expand(len(q_pos), kv_len).bool()


def _oracle(q, k_cache, v_cache, q_lens, kv_lens, kv_indptr, kv_indices, sm_scale, window,
            softcap=None):
    """Dense float64 attention per request over all its KV, masked by HF's mask function."""
    out, start = [], 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        slots = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        k, v = k_cache[slots].double(), v_cache[slots].double()
        hq, hk = q.shape[1], k.shape[1]
        k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
        scores = torch.einsum("nhd,lhd->hnl", q[start:start + n].double(), k) * sm_scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        pos = [kv - n + i for i in range(n)]
        visible = _hf_window_mask(window, pos, kv) if window else \
            torch.arange(kv)[None, :] <= torch.tensor(pos)[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v))
        start += n
    return torch.cat(out)


def _paged(kv_lens, hk, d, seed):
    """K/V caches with each request's slots scattered through the pool (slot 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(kv_lens) + 11
    k_cache = torch.randn(num_slots, hk, d, generator=g)
    v_cache = torch.randn(num_slots, hk, d, generator=g)
    kv_indices = (torch.randperm(num_slots - 1, generator=g)[:sum(kv_lens)] + 1).to(torch.int32)
    return k_cache, v_cache, _indptr(kv_lens), kv_indices, g


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


def _poison_outside(k_cache, v_cache, q_lens, kv_lens, kv_indptr, kv_indices, window):
    """NaN into every slot that no query of its request may see: before the window of the
    request's first query. Returns how many slots were poisoned."""
    count = 0
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        first_seen = max(0, kv - n - window + 1)
        slots = kv_indices[kv_indptr[b]:kv_indptr[b] + first_seen].long()
        k_cache[slots] = float("nan")
        v_cache[slots] = float("nan")
        count += slots.numel()
    return count


def test_window_edge_is_hfs():
    """HF's convention, which the ops follow: the query at p sees p - window + 1 .. p."""
    visible = _hf_window_mask(WINDOW, [20], 21)[0]
    assert visible.nonzero().flatten().tolist() == list(range(20 - WINDOW + 1, 21))


@pytest.mark.parametrize("window", [1, 3, WINDOW])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 1)])
def test_decode_with_window_matches_the_masked_oracle(window, hq, hk):
    d = 16
    # shorter than, equal to, one past, and far past the window
    lens = [1, window, window + 1, 2 * window + 3, 37]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, hk, d, window * 10 + hq)
    q = torch.randn(len(lens), hq, d, generator=g)
    want = _oracle(q, k_cache, v_cache, [1] * len(lens), lens, kv_indptr, kv_indices, 0.3,
                   window)
    assert _poison_outside(k_cache, v_cache, [1] * len(lens), lens, kv_indptr, kv_indices,
                           window) > 0
    got = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.3,
                                     window=window)
    assert torch.isfinite(got).all(), "a slot outside the window was read"
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    # and the window matters: the full-context answer differs where a request is longer
    full = _oracle(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), [1] * len(lens), lens,
                   kv_indptr, kv_indices, 0.3, 0)
    assert (full[-1] - want[-1]).abs().max() > 1e-3


# requests with and without a cached prefix, prefixes crossing the window, one prompt longer
# than several windows, one exactly a window long
Q_LENS, KV_LENS = [3, 1, 30, 5, 8, 17], [7, 1, 30, 19, 8, 40]


@pytest.mark.parametrize("window", [1, 5, WINDOW])
@pytest.mark.parametrize("tiled", [False, True])
def test_extend_with_window_matches_the_masked_oracle(window, tiled, monkeypatch):
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, window + 100 * tiled)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    qo_indptr = _indptr(Q_LENS)
    want = _oracle(q, k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, 0.25, window)
    _poison_outside(k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, window)
    if tiled:       # short requests padded together, long ones cut into row ranges
        monkeypatch.setattr(ref, "TILE_BYTES", ref.attention_tile_bytes(2, 5, 12, hk, hq // hk,
                                                                         d, 4))
    attn = ref.PagedAttention(kv_indptr, kv_indices, qo_indptr, hq, hk, d, 4, window)
    if tiled:
        assert any(t.req_end - t.req_start > 1 for t in attn.tiles), "no requests padded together"
        assert any(t.kv_start > 0 for t in attn.tiles), "no row range starts past its request's KV"
    # no request reads more than its first query's window back
    assert all(kv == min(full, q + window - 1)
               for kv, full, q in zip(attn.kv_lens, KV_LENS, Q_LENS))
    got = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, 0.25,
                                     window=window)
    assert torch.isfinite(got).all(), "a slot outside the window was read"
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_window_no_request_exceeds_is_the_plain_causal_attention():
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 7)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    args = (q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices, 0.25)
    assert torch.equal(ops.paged_extend_attention(*args, window=max(KV_LENS)),
                       ops.paged_extend_attention(*args))


@pytest.mark.parametrize("window", [0, 5])
def test_softcap_matches_the_oracle(window):
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 9)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g) * 3       # scores well past the cap
    want = _oracle(q, k_cache, v_cache, Q_LENS, KV_LENS, kv_indptr, kv_indices, 0.5, window,
                   softcap=2.0)
    got = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr, kv_indices,
                                     0.5, window=window or None, softcap=2.0)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
    uncapped = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr,
                                          kv_indices, 0.5, window=window or None)
    assert (uncapped.double() - want).abs().max() > 1e-2


def test_windowed_calls_take_the_reference_where_kernels_would_run(monkeypatch, caplog):
    """With the kernel path on (faked: no GPU here), a call with a window or a soft-cap runs the
    reference, never torch.ops.radixserve, and says so once per op."""
    assert ops.attention_kernel_takes(None, None) and ops.attention_kernel_takes(0, 0.0)
    assert not ops.attention_kernel_takes(WINDOW, None)
    assert not ops.attention_kernel_takes(None, 50.0)
    monkeypatch.setattr(ops, "_use_attention_kernel", lambda q: True)
    monkeypatch.setattr(ops, "_REFERENCE_ROUTES_LOGGED", set())

    class NoKernels:
        def __getattr__(self, name):
            raise AssertionError(f"kernel {name} called for a windowed layer")

    monkeypatch.setattr(torch.ops, "radixserve", NoKernels(), raising=False)
    hq, hk, d = 4, 2, 16
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(KV_LENS, hk, d, 3)
    q = torch.randn(sum(Q_LENS), hq, d, generator=g)
    with caplog.at_level(logging.WARNING, logger="radixserve.ops"):
        for _ in range(2):
            got = ops.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS), kv_indptr,
                                             kv_indices, 0.25, window=WINDOW)
            ops.paged_decode_attention(q[:len(KV_LENS)], k_cache, v_cache, kv_indptr, kv_indices,
                                       0.25, window=WINDOW)
    assert torch.equal(got, ref.paged_extend_attention(q, k_cache, v_cache, _indptr(Q_LENS),
                                                       kv_indptr, kv_indices, 0.25,
                                                       window=WINDOW))
    routes = [r.getMessage() for r in caplog.records if "torch reference on CUDA" in r.getMessage()]
    assert len(routes) == 2, routes                  # once per op
    with pytest.raises(AssertionError, match="kernel"):      # the fake is live
        ops.paged_decode_attention(q[:len(KV_LENS)], k_cache, v_cache, kv_indptr, kv_indices, 0.25)


def test_cpu_decode_tables_per_window_are_the_reference():
    from radixserve.model.cpu_attention import CpuDecodeAttention

    lens = [1, 7, 8, 9, 30]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged(lens, 2, 16, 5)
    attn = CpuDecodeAttention(kv_indptr, kv_indices)
    for window in (None, 4, None, 4):              # alternating layers, as Gemma's
        q = torch.randn(len(lens), 4, 16, generator=g)
        want = ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.25,
                                          window=window)
        assert torch.equal(attn(q, k_cache, v_cache, 0.25, window=window), want)
    assert len(attn._tables) == 2
