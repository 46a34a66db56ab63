"""paged_decode_attention / paged_extend_attention kernels against the torch reference.

Random inputs, KV slots scattered through a pool larger than needed, outputs poisoned with NaN
through the caching allocator, odd sizes; bf16/fp16 against the fp32 reference on upcast inputs.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from radixserve.ops import _ext

if not (torch.cuda.is_available() and _ext.kernels_available()):
    pytest.skip("needs CUDA and radixserve._C", allow_module_level=True)

from _gpu import capture_graph  # noqa: E402
from radixserve import ops  # noqa: E402
from radixserve.ops import reference as ref  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]
GQA = [(8, 8), (9, 3), (32, 8), (16, 2)]  # ratios 1, 3, 4, 8
# relative Frobenius error, max-abs tolerance (scaled by the reference's largest value)
TOL = {torch.bfloat16: (1e-2, 3e-2), torch.float16: (2e-3, 5e-3)}


def _check(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == expect.shape and out.dtype == dtype
    out = out.float()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    rel_tol, abs_tol = TOL[dtype]
    rel = ((out - expect).norm() / expect.norm()).item()
    max_abs = (out - expect).abs().max().item()
    scale = max(1.0, expect.abs().max().item())
    assert rel < rel_tol, f"relative error {rel:.3e}"
    assert max_abs < abs_tol * scale, f"max abs error {max_abs:.3e}"


def _poison(shape, dtype) -> None:
    # the kernels allocate their outputs: leave a NaN block of that size in the caching allocator,
    # so an element the kernel fails to write shows up as NaN
    torch.empty(shape, dtype=dtype, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


def _pool(kv_lens, num_kv_heads, head_dim, dtype, gen, extra=97):
    """KV pool with each request's slots a random scatter over a larger pool."""
    nnz = int(sum(kv_lens))
    num_slots = nnz + nnz // 3 + extra
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(num_slots, generator=gen, device="cuda")[:nnz]
    kv_indices = perm.to(torch.int32)
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = torch.tensor(kv_lens, device="cuda").cumsum(0)
    return k_cache, v_cache, kv_indptr, kv_indices


def _decode_lens(case: str, gen: torch.Generator):
    if case == "b1":
        return [4097]
    if case == "b19":
        base = [1, 17, 989, 4097]
        rest = torch.randint(1, 1500, (15,), generator=gen, device="cpu").tolist()
        return base + rest
    if case == "b99":
        base = [1, 17, 989, 4097, 2]
        rest = torch.randint(1, 700, (94,), generator=gen, device="cpu").tolist()
        return base + rest
    raise ValueError(case)


def _run_decode(dtype, head_dim, hq, hkv, kv_lens, seed, q=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    batch = len(kv_lens)
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, dtype, gen)
    if q is None:
        q = torch.randn(batch, hq, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    _poison((batch, hq, head_dim), dtype)
    out = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)
    expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                        kv_indices, scale)
    _check(out, expect, dtype)


@pytest.mark.parametrize("case", ["b1", "b19", "b99"])
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode(dtype, head_dim, gqa, case):
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{case}{head_dim}{gqa}".encode()))
    kv_lens = _decode_lens(case, gen)
    _run_decode(dtype, head_dim, gqa[0], gqa[1], kv_lens, seed=len(kv_lens) * 7 + head_dim)


@pytest.mark.parametrize("gqa", [(32, 2), (24, 2), (5, 5), (7, 1)], ids=str)
def test_decode_other_groups(gqa):
    # group 16 and 12 run as several q-head subgroups per kv head; 7 q heads on one kv head
    _run_decode(torch.bfloat16, 128, gqa[0], gqa[1], [1, 17, 989, 300, 4097], seed=3)


def test_decode_strided_q():
    # q as a view into a fused qkv buffer: rows not contiguous
    hq, hkv, d = 9, 3, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(19, hq + 2 * hkv, d, generator=gen, device="cuda").to(torch.bfloat16)
    q = qkv[:, :hq]
    assert not q.is_contiguous()
    _run_decode(torch.bfloat16, d, hq, hkv, [5, 17, 989] + [33] * 16, seed=6, q=q)


def test_decode_large_slot_offsets():
    # slots >= 2^21 with 8 kv heads x 128: slot * stride exceeds 2^31 elements
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    num_slots = (1 << 21) + 4096
    k_cache = torch.empty(num_slots, hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.empty(num_slots, hkv, d, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)
    kv_lens = [1000, 3000]
    slots = (num_slots - 1 - torch.randperm(4000, generator=gen, device="cuda")).to(torch.int64)
    k_cache[slots] = torch.randn(4000, hkv, d, generator=gen, device="cuda").to(dtype)
    v_cache[slots] = torch.randn(4000, hkv, d, generator=gen, device="cuda").to(dtype)
    kv_indptr = torch.tensor([0, 1000, 4000], dtype=torch.int32, device="cuda")
    kv_indices = slots.to(torch.int32)
    q = torch.randn(2, hq, d, generator=gen, device="cuda").to(dtype)
    out = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.08)
    kc, vc = k_cache[slots].float(), v_cache[slots].float()
    idx = torch.arange(4000, dtype=torch.int32, device="cuda")
    expect = ref.paged_decode_attention(q.float(), kc, vc, kv_indptr, idx, 0.08)
    _check(out, expect, dtype)
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.parametrize("batch,max_len,replays", [
    (19, 600, ([1] * 19, [600] * 19, [1, 17, 989, 2000] + [400] * 15)),
    # one request under a grid planned for 8k tokens: the device plan uses 1 split up to
    # kDecodeNoSplitTokens (256) tokens, then 5, 16 or all 64 as the real length asks
    (1, 8192, ([1], [64], [65], [256], [257], [1000], [8192])),
    (3, 4096, ([1, 4096, 70], [300, 1, 5000], [4096, 4096, 4096]))], ids=["b19", "b1", "b3"])
def test_decode_cuda_graph(batch, max_len, replays):
    """Capture once, replay with new contents and new lengths under the same nnz bound."""
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    max_nnz, num_slots = batch * max_len, batch * max_len + 4096
    gen = torch.Generator(device="cuda").manual_seed(21)
    k_cache = torch.randn(num_slots, hkv, d, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen, device="cuda").to(dtype)
    q = torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(max_nnz, dtype=torch.int32, device="cuda")

    def fill(lens):
        kv_indptr[1:] = torch.tensor(lens, device="cuda").cumsum(0).to(torch.int32)
        nnz = sum(lens)
        kv_indices.zero_()
        kv_indices[:nnz] = torch.randperm(num_slots, generator=gen, device="cuda")[:nnz].to(torch.int32)
        q.copy_(torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype))

    fill([min(100, max_len)] * batch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.1)

    for lens in replays:
        assert sum(lens) <= max_nnz
        fill(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(),
                                            kv_indptr, kv_indices[:sum(lens)], 0.1)
        _check(out, expect, dtype)


# ----------------------------------------------------------------------------- extend


@pytest.fixture(params=["auto", "mma"])
def extend_kernel(request, monkeypatch):
    """Each extend test runs twice: with the kernel the extension picks for this device (wgmma on
    an H100/H200 with an sm_90a build) and with the mma.sync kernel forced (the sm_80 path)."""
    if request.param == "mma":
        monkeypatch.setenv("RADIXSERVE_EXTEND_KERNEL", "mma")
    else:
        monkeypatch.delenv("RADIXSERVE_EXTEND_KERNEL", raising=False)
    return request.param


def _extend_case(case: str, gen: torch.Generator):
    """(qo_lens, prefix_lens)"""
    if case == "q989_p0":
        return [989], [0]
    if case == "q17_p4080":
        return [17], [4080]
    if case == "q1_p988":
        return [1], [988]
    if case == "b19_mixed":
        qo = [1, 17, 989, 300, 128, 129] + torch.randint(1, 200, (13,), generator=gen).tolist()
        pre = [0, 5, 0, 1000, 64, 0] + torch.randint(0, 1500, (13,), generator=gen).tolist()
        return qo, pre
    if case == "b99_small":
        qo = torch.randint(1, 40, (99,), generator=gen).tolist()
        pre = torch.randint(0, 400, (99,), generator=gen).tolist()
        pre[0], qo[1] = 0, 1
        return qo, pre
    raise ValueError(case)


def _run_extend(dtype, head_dim, hq, hkv, qo_lens, prefix_lens, seed, strided_q=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kv_lens = [a + b for a, b in zip(qo_lens, prefix_lens)]
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, dtype, gen)
    num_q = sum(qo_lens)
    qo_indptr = torch.zeros(len(qo_lens) + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.tensor(qo_lens, device="cuda").cumsum(0)
    if strided_q:   # q as the model passes it: a view into a fused qkv buffer
        qkv = torch.randn(num_q, hq + 2 * hkv, head_dim, generator=gen, device="cuda").to(dtype)
        q = qkv[:, :hq]
        assert not q.is_contiguous()
    else:
        q = torch.randn(num_q, hq, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    _poison((num_q, hq, head_dim), dtype)
    out = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale)
    expect = ref.paged_extend_attention(q.float(), k_cache.float(), v_cache.float(), qo_indptr,
                                        kv_indptr, kv_indices, scale)
    _check(out, expect, dtype)


@pytest.mark.parametrize("case", ["q989_p0", "q17_p4080", "q1_p988", "b19_mixed", "b99_small"])
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend(dtype, head_dim, gqa, case, extend_kernel):
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{case}{head_dim}{gqa}".encode()))
    qo_lens, prefix_lens = _extend_case(case, gen)
    _run_extend(dtype, head_dim, gqa[0], gqa[1], qo_lens, prefix_lens, seed=head_dim + len(qo_lens))


def test_extend_strided_q(extend_kernel):
    _run_extend(torch.bfloat16, 64, 9, 3, [300, 17, 129], [0, 500, 64], seed=12, strided_q=True)


def test_extend_long_prefill(extend_kernel):
    # one 4097-token prefill (tiles of 128 rows, last tile 1 row) plus a request with prefix
    _run_extend(torch.bfloat16, 128, 8, 2, [4097, 500], [0, 3000], seed=9)


def test_extend_large_slot_offsets(extend_kernel):
    hq, hkv, d, dtype = 8, 8, 128, torch.float16
    num_slots = (1 << 21) + 4096
    k_cache = torch.empty(num_slots, hkv, d, dtype=dtype, device="cuda")
    v_cache = torch.empty(num_slots, hkv, d, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(12)
    n = 700
    slots = (num_slots - 1 - torch.randperm(n, generator=gen, device="cuda")).to(torch.int64)
    k_cache[slots] = torch.randn(n, hkv, d, generator=gen, device="cuda").to(dtype)
    v_cache[slots] = torch.randn(n, hkv, d, generator=gen, device="cuda").to(dtype)
    qo_indptr = torch.tensor([0, 200], dtype=torch.int32, device="cuda")
    kv_indptr = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    q = torch.randn(200, hq, d, generator=gen, device="cuda").to(dtype)
    out = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr,
                                     slots.to(torch.int32), 0.09)
    idx = torch.arange(n, dtype=torch.int32, device="cuda")
    expect = ref.paged_extend_attention(q.float(), k_cache[slots].float(), v_cache[slots].float(),
                                        qo_indptr, kv_indptr, idx, 0.09)
    _check(out, expect, dtype)
    del k_cache, v_cache
    torch.cuda.empty_cache()


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_identical_values_average_to_themselves(dtype, head_dim, extend_kernel):
    """Every KV row of a head holds the same V: attention must return exactly that V (the
    softmax weights the PV product uses are the ones the denominator sums), for extend
    (prefix + causal, variable lengths) and decode."""
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    hq, hkv = 8, 2
    qo_lens, prefix_lens = [1, 17, 200, 129], [0, 40, 300, 1000]
    kv_lens = [a + b for a, b in zip(qo_lens, prefix_lens)]
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, dtype, gen)
    c = torch.randn(hkv, head_dim, generator=gen, device="cuda").to(dtype)   # [hkv, d]
    v_cache[:] = c
    q = (3 * torch.randn(sum(qo_lens), hq, head_dim, generator=gen, device="cuda")).to(dtype)
    qo_indptr = torch.zeros(len(qo_lens) + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.tensor(qo_lens, device="cuda").cumsum(0)
    want = c.repeat_interleave(hq // hkv, dim=0)                              # [hq, d]
    out = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                     1.0 / math.sqrt(head_dim))
    assert torch.equal(out, want.expand_as(out))
    dec = ops.paged_decode_attention(q[:len(kv_lens)].contiguous(), k_cache, v_cache, kv_indptr,
                                     kv_indices, 1.0 / math.sqrt(head_dim))
    assert torch.equal(dec, want.expand_as(dec))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_kernel_choice(dtype, head_dim, monkeypatch):
    """On a Hopper (9.0) the sm_90a wgmma kernel runs (so the "auto" runs above test it), the
    environment override selects the mma.sync kernel, and other GPUs always get mma.sync."""
    monkeypatch.delenv("RADIXSERVE_EXTEND_KERNEL", raising=False)
    q = torch.empty(1, 1, head_dim, dtype=dtype, device="cuda")
    choice = ops.extend_attention_kernel(q)
    if torch.cuda.get_device_capability() == (9, 0):
        assert choice == "wgmma_sm90"
    else:
        assert choice == "mma_sm80"
    monkeypatch.setenv("RADIXSERVE_EXTEND_KERNEL", "mma")
    assert ops.extend_attention_kernel(q) == "mma_sm80"


def _bad_inputs():
    q = torch.randn(2, 4, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 4], dtype=torch.int32, device="cuda")
    return q, kc, indptr, idx


@pytest.mark.parametrize("which", ["int32", "head_dim", "dtype", "multiple", "batch"])
def test_input_checks(which):
    q, kc, indptr, idx = _bad_inputs()
    dec = torch.ops.radixserve.paged_decode_attention
    with pytest.raises(RuntimeError, match=which):
        if which == "int32":
            dec(q, kc, kc, indptr.long(), idx, 0.1)
        elif which == "head_dim":
            q32, k32 = q[..., :32].contiguous(), kc[..., :32].contiguous()
            dec(q32, k32, k32, indptr, idx, 0.1)
        elif which == "dtype":
            dec(q, kc.half(), kc.half(), indptr, idx, 0.1)
        elif which == "multiple":
            torch.ops.radixserve.paged_extend_attention(q[:, :3], kc, kc, indptr, indptr, idx, 0.1)
        else:
            dec(q, kc, kc, indptr[:2], idx, 0.1)


# ----------------------------------------------------------------------------- decode split merge


@pytest.mark.parametrize("kv_lens", [[1000], [3000], [1000, 3000, 17]],
                         ids=["b1_1000", "b1_3000", "b3"])
@pytest.mark.parametrize("gqa", [(32, 8), (24, 2)], ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_split_merge_repeats(dtype, gqa, kv_lens):
    """The split path merges in the kernel (the last CTA of a request's splits combines their
    partials, through arrival counters every launch must leave zero): several splits per request
    (64-token floor: 1000 and 3000 tokens), beside a one-split request (17 tokens) and, for
    hq24/hkv2, two q-head subgroups per kv head. Two eager calls in a row give the same bits; a
    captured graph replayed with new q gives the bits of a fresh eager call each time."""
    hq, hkv = gqa
    d = 128
    batch = len(kv_lens)
    gen = torch.Generator(device="cuda").manual_seed(41 + batch + hq)
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, d, dtype, gen)
    q = torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(d)

    def call():
        return ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)

    def reference():
        return ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                          kv_indices, scale)

    _poison((batch, hq, d), dtype)
    first = call()
    _check(first, reference(), dtype)
    _poison((batch, hq, d), dtype)
    second = call()
    torch.cuda.synchronize()
    assert torch.equal(first, second), "a second launch wrote other bits (counters not reset?)"

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        q.copy_(torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        eager = call()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "a replay differs from an eager call"
        _check(out, reference(), dtype)


# ----------------------------------------------------------------------------- tensor-core decode


@pytest.mark.parametrize("gqa", [(32, 8), (16, 2), (24, 4), (48, 4)],
                         ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_tensor_cores(dtype, head_dim, gqa, monkeypatch):
    """A batch that fills the device without splits (160 requests x >= 2 kv heads) runs the
    tensor-core kernel for groups 4, 8 and 6 (a subgroup of 8 with 2 padding heads) and 12 (two
    subgroups, of 8 and 4): close to the reference; RADIXSERVE_DECODE_KERNEL=simt gives the
    CUDA-core kernel's other bits, equally close; a graph replay gives the eager bits. Lengths
    cross the kernel's 16-token tiles and 64-token rounds (1 token, 15, 16, 17, 63, 65, ...)."""
    hq, hkv = gqa
    gen = torch.Generator(device="cuda").manual_seed(hq * 7 + hkv + head_dim)
    lens_gen = torch.Generator(device="cpu").manual_seed(head_dim + hq)
    kv_lens = [1, 15, 16, 17, 63, 64, 65, 1500] + \
        torch.randint(1, 1200, (152,), generator=lens_gen).tolist()
    batch = len(kv_lens)
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, dtype, gen)
    q = torch.randn(batch, hq, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                        kv_indices, scale)

    def call():
        return ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale)

    _poison((batch, hq, head_dim), dtype)
    tc = call()
    _check(tc, expect, dtype)
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "simt")
    _poison((batch, hq, head_dim), dtype)
    simt = call()
    _check(simt, expect, dtype)
    assert not torch.equal(tc, simt), "the same bits: one kernel ran both times"
    monkeypatch.delenv("RADIXSERVE_DECODE_KERNEL")

    graph, out = capture_graph(call)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, tc), "a replay differs from the eager call"


# ----------------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize("lens,window", [([4097], 1), ([4097], 1000), ([4097], 4096),
                                         ([300, 17, 4097, 1], 256), ([5, 2000], 5000)],
                         ids=["b1_w1", "b1_w1000", "b1_w4096", "b4_w256", "b2_w_longer"])
@pytest.mark.parametrize("gqa", [(8, 8), (32, 8), (16, 2)], ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", ["auto", "simt"])
def test_decode_window_reads_only_the_window(dtype, gqa, lens, window, kernel):
    """A windowed decode call (Mistral's and Gemma's sliding windows) attends each request's
    last `window` KV tokens: close to the windowed reference, and every slot before the window
    is poisoned with NaN, so a kernel that read one would return NaN. Windows shorter than,
    equal to and longer than the requests; one split and many; both kernels."""
    hq, hkv = gqa
    head_dim = 128
    gen = torch.Generator(device="cuda").manual_seed(hq + hkv + window + len(lens))
    k_cache, v_cache, kv_indptr, kv_indices = _pool(lens, hkv, head_dim, dtype, gen)
    q = torch.randn(len(lens), hq, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                        kv_indices, scale, window=window)
    for b, n in enumerate(lens):                     # the slots outside every window
        start = int(kv_indptr[b])
        hidden = kv_indices[start:start + max(0, n - window)].long()
        hidden = hidden[hidden != 0]   # slot 0 is the pool's padding slot, which kernels may read
        k_cache[hidden] = float("nan")
        v_cache[hidden] = float("nan")
    _poison((len(lens), hq, head_dim), dtype)
    out = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale,
                                     kernel=kernel, window=window)
    _check(out, expect, dtype)


def test_decode_window_in_a_cuda_graph_and_tensor_cores():
    """160 requests x 8 kv heads fill the device without splits (the tensor-core kernel) and a
    window of 100 cuts most of them: close to the reference, and a CUDA graph replay gives the
    eager bits (the window is a launch argument)."""
    dtype, hq, hkv, head_dim, window = torch.bfloat16, 32, 8, 128, 100
    lens_gen = torch.Generator(device="cpu").manual_seed(4)
    lens = [1, 99, 100, 101, 1500] + torch.randint(1, 900, (155,), generator=lens_gen).tolist()
    gen = torch.Generator(device="cuda").manual_seed(5)
    k_cache, v_cache, kv_indptr, kv_indices = _pool(lens, hkv, head_dim, dtype, gen)
    q = torch.randn(len(lens), hq, head_dim, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    expect = ref.paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), kv_indptr,
                                        kv_indices, scale, window=window)

    def call():
        return ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, scale,
                                          window=window)

    eager = call()
    _check(eager, expect, dtype)
    graph, out = capture_graph(call)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_decode_window_must_not_be_negative():
    gen = torch.Generator(device="cuda").manual_seed(6)
    k_cache, v_cache, kv_indptr, kv_indices = _pool([10], 2, 64, torch.bfloat16, gen)
    q = torch.randn(1, 4, 64, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.radixserve.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices,
                                                    0.125, 1.0, 1.0, "auto", None, -1)


@pytest.mark.parametrize("case,window", [("q989_p0", 100), ("q989_p0", 1), ("q17_p4080", 64),
                                         ("q17_p4080", 1000), ("q1_p988", 300),
                                         ("b19_mixed", 130), ("b99_small", 37),
                                         ("q989_p0", 5000)])
@pytest.mark.parametrize("gqa", [(8, 8), (32, 8), (16, 2)], ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_window(dtype, head_dim, gqa, case, window, extend_kernel):
    """A windowed extend call (the query at position p attends (p - window, p]; the mma.sync
    kernel runs it whichever kernel is asked for) is close to the windowed reference: windows of 1,
    inside one 64-token KV tile, across many, and longer than every request. The slots of the
    KV tiles wholly before each request's first query's window are poisoned with NaN: the kernel
    must not load them (the tile that holds the window's edge is loaded and masked)."""
    hq, hkv = gqa
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{case}{head_dim}{gqa}w".encode()))
    qo_lens, prefix_lens = _extend_case(case, gen)
    cgen = torch.Generator(device="cuda").manual_seed(head_dim + window)
    kv_lens = [a + b for a, b in zip(qo_lens, prefix_lens)]
    k_cache, v_cache, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, dtype, cgen)
    qo_indptr = torch.zeros(len(qo_lens) + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.tensor(qo_lens, device="cuda").cumsum(0)
    q = torch.randn(sum(qo_lens), hq, head_dim, generator=cgen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(head_dim)
    expect = ref.paged_extend_attention(q.float(), k_cache.float(), v_cache.float(), qo_indptr,
                                        kv_indptr, kv_indices, scale, window=window)
    tile = 64                                            # the mma.sync kernel's KV tile
    for b, prefix in enumerate(prefix_lens):
        unread = max(0, prefix - window + 1) // tile * tile
        start = int(kv_indptr[b])
        hidden = kv_indices[start:start + unread].long()
        hidden = hidden[hidden != 0]
        k_cache[hidden] = float("nan")
        v_cache[hidden] = float("nan")
    _poison((sum(qo_lens), hq, head_dim), dtype)
    out = ops.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
                                     scale, window=window)
    _check(out, expect, dtype)


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_head_dims_the_kernels_lack_take_the_reference(head_dim):
    """Phi-3's 96 and Gemma's 256 (and the tiny test models' 32): the ops answer with the
    reference on CUDA instead of the kernel's 'head_dim must be 64 or 128'."""
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    lens = [5, 300]
    k_cache, v_cache, kv_indptr, kv_indices = _pool(lens, 2, head_dim, torch.bfloat16, gen)
    q = torch.randn(2, 4, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    got = ops.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.1, window=64)
    assert torch.equal(got, ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr,
                                                       kv_indices, 0.1, window=64))
    qo_indptr = torch.tensor([0, 5, 305], dtype=torch.int32, device="cuda")
    qe = torch.randn(305, 4, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    got = ops.paged_extend_attention(qe, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, 0.1)
    assert torch.equal(got, ref.paged_extend_attention(qe, k_cache, v_cache, qo_indptr,
                                                       kv_indptr, kv_indices, 0.1))
