"""rms_norm, fused_add_rms_norm, rotary_embedding, silu_and_mul kernels against the reference."""
import pytest
import torch

from _gpu import TOL, requires_kernels
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _close(got, want):
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("hidden", [17, 989, 4096, 16384])
def test_rms_norm(dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, device="cuda").to(dtype) * 3
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    out = torch.ops.radixserve.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    _close(out, ref.rms_norm(x, w, 1e-6))


def test_rms_norm_strided_rows():
    base = torch.randn(19, 3 * 1024, device="cuda", dtype=torch.bfloat16)
    x = base[:, 1024:2048]  # row stride 3072, contiguous rows
    w = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    _close(torch.ops.radixserve.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("hidden", [17, 989, 4096, 16384])
def test_fused_add_rms_norm_mutates_both(dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    residual = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    want_x, want_r = x.clone(), residual.clone()
    ref.fused_add_rms_norm(want_x, want_r, w, 1e-6)
    torch.ops.radixserve.fused_add_rms_norm(x, residual, w, 1e-6)
    _close(residual, want_r)
    _close(x, want_x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("hidden", [17, 576, 989, 4096, 16384])
def test_fused_add_rms_norm_fp32_residual(dtype, num_tokens, hidden):
    # half-precision models keep the residual stream in fp32 (model/llama.py); x stays bf16/fp16
    x = (torch.randn(num_tokens, hidden, device="cuda") * 3).to(dtype)
    residual = torch.randn(num_tokens, hidden, device="cuda") * 40   # f32: bf16 would round it
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    want_x, want_r = x.clone(), residual.clone()
    ref.fused_add_rms_norm(want_x, want_r, w, 1e-6)
    torch.ops.radixserve.fused_add_rms_norm(x, residual, w, 1e-6)
    assert residual.dtype == torch.float32 and x.dtype == dtype
    _close(residual, want_r)                      # fp32 tolerance: the residual is not rounded
    assert not torch.equal(residual, residual.to(dtype).float())
    _close(x, want_x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_add_rms_norm_fp32_residual_unaligned_rows(dtype):
    # storage offsets that break the 16-byte alignment of x, of the residual, or both: the kernel
    # must take its scalar path and touch nothing outside the two views
    num_tokens, hidden = 7, 1024
    n = num_tokens * hidden
    for x_off, r_off in ((1, 0), (0, 1), (1, 1), (0, 2)):
        xb = (torch.randn(n + 3, device="cuda") * 3).to(dtype)
        rb = torch.randn(n + 3, device="cuda") * 40
        xb_before, rb_before = xb.clone(), rb.clone()
        x = xb[x_off:x_off + n].view(num_tokens, hidden)
        residual = rb[r_off:r_off + n].view(num_tokens, hidden)
        w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
        want_x, want_r = x.clone(), residual.clone()
        ref.fused_add_rms_norm(want_x, want_r, w, 1e-6)
        torch.ops.radixserve.fused_add_rms_norm(x, residual, w, 1e-6)
        _close(residual, want_r)
        _close(x, want_x)
        outside_x = torch.ones(n + 3, dtype=torch.bool, device="cuda")
        outside_x[x_off:x_off + n] = False
        outside_r = torch.ones(n + 3, dtype=torch.bool, device="cuda")
        outside_r[r_off:r_off + n] = False
        assert torch.equal(xb[outside_x], xb_before[outside_x])
        assert torch.equal(rb[outside_r], rb_before[outside_r])


@pytest.mark.parametrize("x_dtype,res_dtype", [(torch.bfloat16, torch.float16),
                                               (torch.float16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_fused_add_rms_norm_rejects_other_residual_dtypes(x_dtype, res_dtype):
    x = torch.randn(4, 64, device="cuda").to(x_dtype)
    residual = torch.randn(4, 64, device="cuda").to(res_dtype)
    with pytest.raises(RuntimeError, match="residual dtype must equal x dtype"):
        torch.ops.radixserve.fused_add_rms_norm(x, residual, torch.ones(64, device="cuda", dtype=x_dtype),
                                                1e-6)


def _cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], -1).float().cuda()  # [max_pos, rotary_dim]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 17, 99])
@pytest.mark.parametrize("hq,hk,head_dim,rotary_dim", [(32, 8, 128, 128), (8, 1, 64, 64), (4, 4, 128, 64),
                                                       (6, 2, 10, 6)])
def test_rotary_on_fused_qkv_views(dtype, num_tokens, hq, hk, head_dim, rotary_dim):
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, device="cuda").to(dtype)
    q = qkv[:, :hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    v_before = qkv[:, (hq + hk) * head_dim:].clone()
    cache = _cos_sin_cache(4097, rotary_dim)
    positions = torch.randint(0, 4097, (num_tokens,), device="cuda")
    want_q, want_k = q.clone(), k.clone()
    ref.rotary_embedding(positions, want_q, want_k, cache)
    torch.ops.radixserve.rotary_embedding(positions, q, k, cache)
    _close(q, want_q)
    _close(k, want_k)
    assert torch.equal(qkv[:, (hq + hk) * head_dim:], v_before), "v was touched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 19, 99])
@pytest.mark.parametrize("inter", [17, 989, 14336])
def test_silu_and_mul(dtype, num_tokens, inter):
    x = (torch.randn(num_tokens, 2 * inter, device="cuda") * 4).to(dtype)
    out = torch.ops.radixserve.silu_and_mul(x)
    assert out.shape == (num_tokens, inter)
    _close(out, ref.silu_and_mul(x))


def test_rejects_bad_inputs():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.radixserve.rms_norm(x, torch.ones(63, device="cuda"), 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.radixserve.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        torch.ops.radixserve.silu_and_mul(torch.randn(4, 63, device="cuda"))
    q = torch.randn(4, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.radixserve.rotary_embedding(torch.zeros(4, device="cuda", dtype=torch.int32), q, q.clone(),
                                              _cos_sin_cache(10, 64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 17, 99])
@pytest.mark.parametrize("hq,hk,head_dim,rotary_dim", [(32, 8, 128, 128), (8, 1, 64, 64), (4, 4, 128, 64),
                                                       (6, 2, 10, 6)])
def test_rotary_store_kv_equals_the_two_ops(dtype, num_tokens, hq, hk, head_dim, rotary_dim):
    qkv = torch.randn(num_tokens, (hq + 2 * hk) * head_dim, device="cuda").to(dtype)
    q = qkv[:, :hq * head_dim].view(num_tokens, hq, head_dim)
    k = qkv[:, hq * head_dim:(hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    v = qkv[:, (hq + hk) * head_dim:].view(num_tokens, hk, head_dim)
    cache = _cos_sin_cache(4097, rotary_dim)
    positions = torch.randint(0, 4097, (num_tokens,), device="cuda")
    num_slots = 2 * num_tokens + 3
    slots = (torch.randperm(num_slots - 1, device="cuda")[:num_tokens] + 1).to(torch.int32)
    k_cache = torch.full((num_slots, hk, head_dim), float("nan"), device="cuda").to(dtype)
    v_cache = k_cache.clone()
    want_q, want_k, want_kc, want_vc = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    ref.rotary_embedding(positions, want_q, want_k, cache)
    ref.store_kv(want_kc, want_vc, want_k, v, slots)
    torch.ops.radixserve.rotary_embedding_store_kv(positions, q, k, v, cache, k_cache, v_cache, slots)
    _close(q, want_q)
    _close(k, want_k)
    # the pool holds exactly the kernel's own rotated k (bit for bit) and v; other slots untouched
    assert torch.equal(k_cache[slots.long()], k) and torch.equal(v_cache[slots.long()], v)
    untouched = torch.ones(num_slots, dtype=torch.bool, device="cuda")
    untouched[slots.long()] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()
    _close(k_cache[slots.long()], want_kc[slots.long()])


def test_rotary_store_kv_rejects_bad_inputs():
    q = torch.randn(4, 2, 64, device="cuda")
    k = torch.randn(4, 2, 64, device="cuda")
    cache = torch.zeros(10, 2, 64, device="cuda")
    with pytest.raises(RuntimeError, match="slot_indices"):
        torch.ops.radixserve.rotary_embedding_store_kv(torch.zeros(4, device="cuda", dtype=torch.long), q, k,
                                                       k.clone(), _cos_sin_cache(10, 64), cache, cache.clone(),
                                                       torch.zeros(3, device="cuda", dtype=torch.int32))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.radixserve.rotary_embedding_store_kv(torch.zeros(4, device="cuda", dtype=torch.long), q, k,
                                                       k.transpose(1, 2).contiguous().transpose(1, 2),
                                                       _cos_sin_cache(10, 64), cache, cache.clone(),
                                                       torch.zeros(4, device="cuda", dtype=torch.int32))
