"""FP8 KV cache kernels (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) against the torch references.

store_kv and rotary_embedding_store_kv into FP8 pools: the bytes of the reference
(reference.quantize_fp8), bit for bit, for bf16 / fp16 / fp32 inputs, odd row sizes (the
element-wise path) and 8-aligned ones (8 values a thread), strided views of a fused qkv buffer.
paged_decode_attention (CUDA-core kernel, split and not, and the tensor-core kernel) and
paged_extend_attention (mma.sync) over FP8 pages with k_scale / v_scale: close to the reference
(dequantize, then attend in fp32) at odd sizes; graph capture and replay; a model with an FP8
pool: CUDA-graph decode equals eager decode, and the kernels' logits agree with the references'.
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from _gpu import capture_graph, requires_kernels, rescale_dummy_weights
from radixserve import ops
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.bfloat16, torch.float16]
HEAD_DIMS = [64, 128]
GQA = [(8, 8), (9, 3), (32, 8), (16, 2)]  # groups 1, 3, 4, 8
# relative Frobenius error, max-abs error (times the reference's largest value), per q dtype
TOL = {torch.bfloat16: (1e-2, 3e-2), torch.float16: (3e-3, 8e-3)}
K_SCALE, V_SCALE = 0.75, 0.125


def _u8(t):
    return t.view(torch.uint8)


def _check(out, expect, dtype):
    assert out.shape == expect.shape and out.dtype == dtype
    out = out.float()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or NaN)"
    rel_tol, abs_tol = TOL[dtype]
    rel = ((out - expect).norm() / expect.norm()).item()
    max_abs = (out - expect).abs().max().item()
    assert rel < rel_tol, f"relative error {rel:.3e}"
    assert max_abs < abs_tol * max(1.0, expect.abs().max().item()), f"max abs error {max_abs:.3e}"


def _poison(shape, dtype):
    torch.empty(shape, dtype=dtype, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- store


@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("heads,head_dim", [(8, 128), (2, 64), (1, 64), (3, 5), (1, 12)])
def test_store_kv_fp8_bytes_equal_reference(kv, dtype, idx_dtype, num_tokens, heads, head_dim):
    g = torch.Generator(device="cuda").manual_seed(num_tokens * 31 + heads * 7 + head_dim)
    num_slots = 1000
    k_cache = ref.quantize_fp8(torch.randn(num_slots, heads, head_dim, device="cuda", generator=g),
                               kv, 1.0)
    v_cache = k_cache.clone()
    # values across the format's range, saturating ones and subnormal ones included
    k = (torch.randn(num_tokens, heads, head_dim, device="cuda", generator=g) *
         torch.tensor([1e-3, 1.0, 50.0, 1e4], device="cuda")[torch.randint(
             0, 4, (num_tokens, heads, head_dim), device="cuda", generator=g)]).to(dtype)
    v = torch.randn(num_tokens, heads, head_dim, device="cuda", generator=g).to(dtype)
    slots = torch.randperm(num_slots, device="cuda", generator=g)[:num_tokens].to(idx_dtype)
    for ks, vs in ((1.0, 1.0), (0.37, 3.0)):
        want_k, want_v = k_cache.clone(), v_cache.clone()
        ref.store_kv(want_k, want_v, k, v, slots, ks, vs)
        torch.ops.radixserve.store_kv(k_cache, v_cache, k, v, slots, ks, vs)
        assert torch.equal(_u8(k_cache), _u8(want_k))
        assert torch.equal(_u8(v_cache), _u8(want_v))


@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_store_kv_fp8_strided_views_of_fused_qkv(kv, dtype):
    tokens, hq, hk, d = 17, 8, 2, 128
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda").to(dtype)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d:].view(tokens, hk, d)
    k_cache = torch.zeros(300, hk, d, device="cuda", dtype=kv)
    v_cache = torch.zeros(300, hk, d, device="cuda", dtype=kv)
    slots = torch.randperm(300, device="cuda")[:tokens].to(torch.int32)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(want_k, want_v, k, v, slots, 0.5, 2.0)
    ops.store_kv(k_cache, v_cache, k, v, slots, 0.5, 2.0)
    assert torch.equal(_u8(k_cache), _u8(want_k)) and torch.equal(_u8(v_cache), _u8(want_v))


def test_store_kv_fp8_rejects_bad_scales_and_dtypes():
    k_cache = torch.zeros(10, 2, 64, device="cuda", dtype=torch.float8_e4m3fn)
    k = torch.randn(3, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(3, device="cuda", dtype=torch.int32)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(RuntimeError, match="k_scale"):
            torch.ops.radixserve.store_kv(k_cache, k_cache.clone(), k, k, slots, bad, 1.0)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.radixserve.store_kv(k_cache, k_cache.clone(), k, k.half(), slots, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.radixserve.store_kv(k_cache, torch.zeros_like(k_cache, dtype=torch.float8_e5m2),
                                      k, k, slots)


@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128), (4, 2, 12)])
def test_rotary_store_kv_fp8(kv, dtype, hq, hkv, d):
    """The fused rope + store: q and k rotated as the 16-bit kernel rotates them, and the pool
    rows are the reference quantization of the kernel's rotated k (and of v), bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(hq + d)
    n = 37
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
    pos = torch.randint(0, 500, (n,), device="cuda", generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    ang = torch.arange(512, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
    k_cache = torch.zeros(200, hkv, d, device="cuda", dtype=kv)
    v_cache = torch.zeros(200, hkv, d, device="cuda", dtype=kv)
    slots = torch.randperm(200, device="cuda", generator=g)[:n]
    q2, k2 = q.clone(), k.clone()
    ref.rotary_embedding(pos, q2, k2, cos_sin)
    ops.rotary_embedding_store_kv(pos, q, k, v, cos_sin, k_cache, v_cache, slots, K_SCALE, V_SCALE)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.float(), q2.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k.float(), k2.float(), atol=tol, rtol=tol)
    assert torch.equal(_u8(k_cache)[slots], _u8(ref.quantize_fp8(k, kv, K_SCALE)))
    assert torch.equal(_u8(v_cache)[slots], _u8(ref.quantize_fp8(v, kv, V_SCALE)))


# ----------------------------------------------------------------------------- decode


def _pool(kv_lens, hkv, d, kv, gen, extra=97):
    """FP8 pool with each request's slots a random scatter over a larger pool."""
    nnz = int(sum(kv_lens))
    num_slots = nnz + nnz // 3 + extra
    k8 = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=gen, device="cuda") * 2, kv,
                          K_SCALE)
    v8 = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=gen, device="cuda") * 0.2, kv,
                          V_SCALE)
    perm = torch.randperm(num_slots, generator=gen, device="cuda")[:nnz]
    kv_indptr = torch.zeros(len(kv_lens) + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = torch.tensor(kv_lens, device="cuda").cumsum(0)
    return k8, v8, kv_indptr, perm.to(torch.int32)


def _decode_lens(case, gen):
    if case == "b1":
        return [4097]
    if case == "b19":
        return [1, 17, 989, 4097] + torch.randint(1, 1500, (15,), generator=gen).tolist()
    if case == "b99":
        return [1, 17, 989, 4097, 2] + torch.randint(1, 700, (94,), generator=gen).tolist()
    if case == "b160":   # fills the device without splits: the tensor-core kernel (groups 4, 8)
        return [1, 15, 16, 17, 63, 64, 65, 1500] + torch.randint(1, 1200, (152,), generator=gen).tolist()
    raise ValueError(case)


def _decode(dtype, kv, d, hq, hkv, kv_lens, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k8, v8, kv_indptr, kv_indices = _pool(kv_lens, hkv, d, kv, gen)
    q = torch.randn(len(kv_lens), hq, d, generator=gen, device="cuda").to(dtype)
    scale = 1.0 / math.sqrt(d)
    expect = ref.paged_decode_attention(q.float(), k8, v8, kv_indptr, kv_indices, scale,
                                        K_SCALE, V_SCALE)

    def call():
        return ops.paged_decode_attention(q, k8, v8, kv_indptr, kv_indices, scale, K_SCALE, V_SCALE)
    return call, expect


@pytest.mark.parametrize("case", ["b1", "b19", "b99", "b160"])
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_fp8(dtype, kv, head_dim, gqa, case, monkeypatch):
    """Every decode kernel over FP8 pages: the default choice (tensor cores for b160 at groups 4
    and 8, the CUDA-core kernel, split or not, elsewhere), then the CUDA-core kernel forced."""
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{case}{head_dim}{gqa}".encode()))
    kv_lens = _decode_lens(case, gen)
    call, expect = _decode(dtype, kv, head_dim, gqa[0], gqa[1], kv_lens, seed=len(kv_lens) + head_dim)
    _poison(expect.shape, dtype)
    auto = call()
    _check(auto, expect, dtype)
    monkeypatch.setenv("RADIXSERVE_DECODE_KERNEL", "simt")
    _poison(expect.shape, dtype)
    simt = call()
    _check(simt, expect, dtype)
    if case == "b160" and gqa[0] // gqa[1] in (4, 8):
        assert not torch.equal(auto, simt), "the same bits: the tensor-core kernel did not run"


@pytest.mark.parametrize("gqa", [(32, 2), (24, 2), (5, 5), (7, 1), (48, 4)], ids=str)
def test_decode_fp8_other_groups(gqa):
    # subgroups of 8 (+ 4, + padding heads), 5 and 7 heads a kv head
    for case in ("b19", "b160"):
        gen = torch.Generator(device="cpu").manual_seed(gqa[0])
        call, expect = _decode(torch.bfloat16, torch.float8_e4m3fn, 128, gqa[0], gqa[1],
                               _decode_lens(case, gen), seed=3)
        _check(call(), expect, torch.bfloat16)


def test_decode_fp8_scales_fold_exactly():
    """k_scale and v_scale act as the reference's multiplication: the same pages read with scale
    s equal the pages read at scale 1 with sm_scale * s (keys) and the output times s (values)."""
    # scales 2^k leave every rounding unchanged: values exactly doubled, or the same
    gen = torch.Generator(device="cuda").manual_seed(9)
    k8, v8, indptr, idx = _pool([300, 1, 77], 2, 64, torch.float8_e4m3fn, gen)
    q = torch.randn(3, 8, 64, generator=gen, device="cuda").half()
    a = ops.paged_decode_attention(q, k8, v8, indptr, idx, 0.125, 1.0, 1.0)
    b = ops.paged_decode_attention(q, k8, v8, indptr, idx, 0.125, 1.0, 2.0)
    c = ops.paged_decode_attention(q, k8, v8, indptr, idx, 0.0625, 2.0, 1.0)
    assert torch.equal(b, a * 2) and torch.equal(c, a)


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_decode_fp8_cuda_graph(kv):
    """Capture once (scales are launch arguments), replay with new contents and lengths."""
    hq, hkv, d, dtype, batch, max_len = 32, 8, 128, torch.bfloat16, 19, 600
    max_nnz, num_slots = batch * max_len, batch * max_len + 4096
    gen = torch.Generator(device="cuda").manual_seed(21)
    k8 = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=gen, device="cuda"), kv, K_SCALE)
    v8 = ref.quantize_fp8(torch.randn(num_slots, hkv, d, generator=gen, device="cuda"), kv, V_SCALE)
    q = torch.randn(batch, hq, d, generator=gen, device="cuda").to(dtype)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(max_nnz, dtype=torch.int32, device="cuda")

    def fill(lens):
        kv_indptr[1:] = torch.tensor(lens, device="cuda").cumsum(0).to(torch.int32)
        nnz = sum(lens)
        kv_indices.zero_()
        kv_indices[:nnz] = torch.randperm(num_slots, generator=gen, device="cuda")[:nnz].to(torch.int32)

    def call():
        return ops.paged_decode_attention(q, k8, v8, kv_indptr, kv_indices, 0.1, K_SCALE, V_SCALE)

    fill([100] * batch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for lens in ([1] * batch, [600] * batch, [1, 17, 599, 2] + [400] * 15):
        fill(lens)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expect = ref.paged_decode_attention(q.float(), k8, v8, kv_indptr, kv_indices[:sum(lens)],
                                            0.1, K_SCALE, V_SCALE)
        _check(out, expect, dtype)


# ----------------------------------------------------------------------------- extend


def _extend_case(case, gen):
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


@pytest.mark.parametrize("case", ["q989_p0", "q17_p4080", "q1_p988", "b19_mixed", "b99_small"])
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"hq{g[0]}_hkv{g[1]}")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv", FP8, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extend_fp8(dtype, kv, head_dim, gqa, case):
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(f"{case}{head_dim}{gqa}".encode()))
    qo_lens, prefix = _extend_case(case, gen)
    hq, hkv = gqa
    cuda_gen = torch.Generator(device="cuda").manual_seed(head_dim + len(qo_lens))
    kv_lens = [a + b for a, b in zip(qo_lens, prefix)]
    k8, v8, kv_indptr, kv_indices = _pool(kv_lens, hkv, head_dim, kv, cuda_gen)
    qo_indptr = torch.zeros(len(qo_lens) + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.tensor(qo_lens, device="cuda").cumsum(0)
    # q as the model passes it: a view into a fused qkv buffer
    qkv = torch.randn(sum(qo_lens), hq + 2 * hkv, head_dim, generator=cuda_gen, device="cuda")
    q = qkv.to(dtype)[:, :hq]
    scale = 1.0 / math.sqrt(head_dim)
    _poison((sum(qo_lens), hq, head_dim), dtype)
    out = ops.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, kv_indices, scale,
                                     K_SCALE, V_SCALE)
    expect = ref.paged_extend_attention(q.float(), k8, v8, qo_indptr, kv_indptr, kv_indices, scale,
                                        K_SCALE, V_SCALE)
    _check(out, expect, dtype)


def test_extend_fp8_long_prefill_and_forced_mma_kernel(monkeypatch):
    """A 4097-token prefill and a request over a 3000-token prefix; RADIXSERVE_EXTEND_KERNEL=mma
    changes nothing for an FP8 pool (it always runs the mma.sync kernel): the same bits."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    qo_lens, prefix, hq, hkv, d = [4097, 500], [0, 3000], 8, 2, 128
    k8, v8, kv_indptr, idx = _pool([a + b for a, b in zip(qo_lens, prefix)], hkv, d,
                                   torch.float8_e4m3fn, gen)
    qo_indptr = torch.tensor([0, 4097, 4597], dtype=torch.int32, device="cuda")
    q = torch.randn(4597, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    out = ops.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, idx, 0.09, K_SCALE, V_SCALE)
    _check(out, ref.paged_extend_attention(q.float(), k8, v8, qo_indptr, kv_indptr, idx, 0.09,
                                           K_SCALE, V_SCALE), torch.bfloat16)
    monkeypatch.setenv("RADIXSERVE_EXTEND_KERNEL", "mma")
    again = ops.paged_extend_attention(q, k8, v8, qo_indptr, kv_indptr, idx, 0.09, K_SCALE, V_SCALE)
    assert torch.equal(out, again)


def test_attention_fp8_input_checks():
    q = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16)
    k8 = torch.zeros(10, 2, 64, device="cuda", dtype=torch.float8_e4m3fn)
    indptr = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    idx = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="dtypes differ"):
        torch.ops.radixserve.paged_decode_attention(
            q, k8, torch.zeros_like(k8, dtype=torch.float8_e5m2), indptr, idx, 0.1, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="v_scale"):
        torch.ops.radixserve.paged_decode_attention(q, k8, k8, indptr, idx, 0.1, 1.0, 0.0)
    with pytest.raises(RuntimeError, match="k_scale"):
        torch.ops.radixserve.paged_extend_attention(q, k8, k8, indptr, indptr, idx, 0.1,
                                                    math.nan, 1.0)


# ----------------------------------------------------------------------------- a model


@pytest.fixture(scope="module")
def fp8_runner(tmp_path_factory):
    """A ModelRunner (random-weight Llama, bf16, head_dim 128, GQA 2) with an fp8_e4m3 pool and
    checkpoint-style scales, decode CUDA graphs captured."""
    from test_cuda_graph import _model_dir

    from radixserve.config import ModelConfig, ServerArgs
    from radixserve.model.loader import load_model
    from radixserve.model.runner import ModelRunner

    path = _model_dir(tmp_path_factory, 128)
    config = ModelConfig.from_path(path)
    model = load_model(path, config, "dummy", torch.bfloat16, torch.device("cuda"))
    rescale_dummy_weights(model)
    for i in range(config.num_hidden_layers):
        model.checkpoint_kv_scales[f"model.layers.{i}.self_attn.k_scale"] = 0.5 + i
        model.checkpoint_kv_scales[f"model.layers.{i}.self_attn.v_scale"] = 0.25
    args = ServerArgs(model_path=path, load_format="dummy", device="cuda", dtype="bfloat16",
                      kv_cache_dtype="fp8_e4m3", max_total_tokens=6000, max_running_requests=32,
                      cuda_graph_max_bs=24)
    r = ModelRunner(args, config, path, context_len=512, model=model)
    assert r.kv_pool.dtype == torch.float8_e4m3fn and r.graph_runner is not None
    assert [layer.self_attn.k_scale for layer in model.model.layers] == [0.5, 1.5]
    return r


@pytest.mark.parametrize("bs", [1, 3, 17])
def test_fp8_pool_graph_decode_equals_eager(fp8_runner, bs):
    from test_cuda_graph import _eager_decode, _prefill, _release

    runner = fp8_runner
    gen = torch.Generator(device="cuda").manual_seed(bs)
    lens = torch.randint(1, 200, (bs,), generator=gen, device="cuda").tolist()
    rows, slots = _prefill(runner, lens, gen)
    dev = runner.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    runner.next_ids[rows_t] = torch.randint(3, 1000, (bs,), generator=gen, device=dev)
    seq_t = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=dev)
    loc = torch.stack([s[n] for s, n in zip(slots, lens)]).to(dev)
    eager = _eager_decode(runner, rows_t, seq_t, loc).clone()
    k_eager = [_u8(k)[loc.long()].clone() for k in runner.kv_pool.k_buffers]
    graph = runner.graph_runner.replay(bs, rows_t, seq_t, loc).clone()
    torch.cuda.synchronize()
    scale = eager.abs().max().item()
    assert scale > 1.0 and torch.isfinite(graph).all()
    assert (graph - eager).abs().max().item() <= 0.03 * scale
    assert all(torch.equal(_u8(k)[loc.long()], ke)
               for k, ke in zip(runner.kv_pool.k_buffers, k_eager))
    _release(runner, slots)


def test_fp8_pool_kernels_agree_with_references(fp8_runner, monkeypatch):
    """The same prefill and decode step through the kernels and through the torch references
    (the CPU's path) on one FP8 pool: logits agree to bf16 tolerance."""
    from test_cuda_graph import _eager_decode, _prefill, _release

    runner = fp8_runner
    out = {}
    for path in ("kernels", "references"):
        if path == "references":
            monkeypatch.setattr(ops, "_use_kernel", lambda t: False)
        gen = torch.Generator(device="cuda").manual_seed(77)
        lens = [5, 130, 64, 1]
        rows, slots = _prefill(runner, lens, gen)
        dev = runner.device
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        runner.next_ids[rows_t] = torch.randint(3, 1000, (4,), generator=gen, device=dev)
        seq_t = torch.tensor([n + 1 for n in lens], dtype=torch.int32, device=dev)
        loc = torch.stack([s[n] for s, n in zip(slots, lens)]).to(dev)
        out[path] = _eager_decode(runner, rows_t, seq_t, loc).float().clone()
        _release(runner, slots)
    a, b = out["kernels"], out["references"]
    assert (a - b).abs().max().item() <= 0.03 * b.abs().max().item()


@pytest.mark.parametrize("pool", ["e4m3", "bf16"])
@pytest.mark.parametrize("shape", ["split_b8_8k", "tc_b128_1k"])
def test_decode_repeats_bit_for_bit(pool, shape):
    """The same inputs give the same bits, call after call, over layers that alternate (as a
    decode step's do): the split kernel's last-CTA merge (b8 x 8k: 5 splits a request) and the
    tensor-core kernels (b128 x 1k, group 4; the FP8 one's row tiles share shared memory across
    a warp's lanes), eagerly and as CUDA-graph replays. A race in either, or a split arrival
    counter left wrong by one launch for the next, would show here as a changed bit."""
    batch, kv_len = (8, 8192) if shape.startswith("split") else (128, 1024)
    hq, hkv, d, layers, rounds = 32, 8, 128, 4, 24
    gen = torch.Generator(device="cuda").manual_seed(5)
    nnz = batch * kv_len
    indptr = torch.arange(0, nnz + 1, kv_len, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, generator=gen, device="cuda").bfloat16()
    caches = []
    for _ in range(layers):
        k = torch.randn(nnz + 1, hkv, d, generator=gen, device="cuda")
        v = torch.randn(nnz + 1, hkv, d, generator=gen, device="cuda") * 0.2
        if pool == "e4m3":
            k, v = (ref.quantize_fp8(t, torch.float8_e4m3fn, 1.0) for t in (k, v))
        else:
            k, v = k.bfloat16(), v.bfloat16()
        idx = (torch.randperm(nnz, generator=gen, device="cuda") + 1).to(torch.int32)
        caches.append((k, v, idx))

    def step():
        return [ops.paged_decode_attention(q, k, v, indptr, idx, d ** -0.5) for k, v, idx in caches]

    first = step()
    if shape.startswith("tc"):   # the tensor-core kernel ran, not the CUDA-core one
        k, v, idx = caches[0]
        simt = ops.paged_decode_attention(q, k, v, indptr, idx, d ** -0.5, kernel="simt")
        assert not torch.equal(simt, first[0]), "the same bits: the tensor-core kernel did not run"
    for r in range(rounds):
        for layer, out in enumerate(step()):
            assert torch.equal(out, first[layer]), f"eager round {r}, layer {layer}: bits changed"
    # the same layers as one CUDA graph, replayed as a decode step is (the split kernel's
    # arrival counters persist from replay to replay)
    graph, outs = capture_graph(step)
    for r in range(4 * rounds):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer, out in enumerate(outs):
            assert torch.equal(out, first[layer]), f"replay {r}, layer {layer}: bits changed"
