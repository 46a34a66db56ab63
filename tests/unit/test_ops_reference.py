"""The torch references (radixserve.ops.reference) against naive per-request loops and closed
formulas, on the CPU. They are the oracle of the kernel tests, so they are checked first."""
import importlib.util
import math

import pytest
import torch

from radixserve.ops import reference as ref

ALL_OPS = ["store_kv", "build_kv_indices", "paged_decode_attention", "paged_extend_attention",
           "bitmask_sample", "argmax_rows", "skinny_linear", "rms_norm", "fused_add_rms_norm",
           "rotary_embedding", "rotary_embedding_store_kv", "silu_and_mul"]


def _paged_case(lens, num_kv_heads, head_dim, seed):
    g = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 13
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    perm = torch.randperm(num_slots - 1, generator=g)[:sum(lens)] + 1  # slot 0 is padding
    kv_indptr = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    return k_cache, v_cache, kv_indptr, perm.to(torch.int32), g


def _naive_attention(q_rows, k, v, sm_scale, positions):
    """q_rows: [n, hq, d] at kv positions `positions`; k, v: [len, hk, d]; causal by position."""
    hq, hk = q_rows.shape[1], k.shape[1]
    out = torch.empty_like(q_rows)
    for i in range(q_rows.shape[0]):
        for h in range(hq):
            kh = h // (hq // hk)
            n = positions[i] + 1
            s = [sm_scale * float(q_rows[i, h] @ k[j, kh]) for j in range(n)]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            z = sum(w)
            out[i, h] = sum(w[j] / z * v[j, kh] for j in range(n))
    return out


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (6, 1)])
def test_decode_attention_vs_explicit_softmax(hq, hk):
    lens = [1, 7, 19]
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged_case(lens, hk, 16, hq * 10 + hk)
    q = torch.randn(len(lens), hq, 16, generator=g, dtype=torch.float64)
    out = ref.paged_decode_attention(q, k_cache, v_cache, kv_indptr, kv_indices, 0.25)
    for b, n in enumerate(lens):
        slots = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        want = _naive_attention(q[b:b + 1], k_cache[slots], v_cache[slots], 0.25, [n - 1])
        torch.testing.assert_close(out[b:b + 1], want, atol=2e-5, rtol=2e-5)  # the reference computes in fp32


@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2)])
def test_extend_attention_vs_per_request_causal(hq, hk):
    kv_lens, q_lens = [5, 9, 3], [2, 9, 1]  # prefix + new tokens; request 1 has no prefix
    k_cache, v_cache, kv_indptr, kv_indices, g = _paged_case(kv_lens, hk, 8, hq + hk)
    qo_indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(q_lens), hq, 8, generator=g, dtype=torch.float64)
    out = ref.paged_extend_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, 0.3)
    for b in range(3):
        slots = kv_indices[kv_indptr[b]:kv_indptr[b + 1]].long()
        qb = q[qo_indptr[b]:qo_indptr[b + 1]]
        prefix = kv_lens[b] - q_lens[b]
        want = _naive_attention(qb, k_cache[slots], v_cache[slots], 0.3,
                                [prefix + i for i in range(q_lens[b])])
        torch.testing.assert_close(out[qo_indptr[b]:qo_indptr[b + 1]], want, atol=2e-5, rtol=2e-5)  # the reference computes in fp32


def test_build_kv_indices_vs_loop():
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(0, 1000, (6, 50), generator=g, dtype=torch.int32)
    rpi = torch.tensor([4, 0, 2], dtype=torch.int64)
    lens = torch.tensor([17, 1, 50], dtype=torch.int32)
    kv_indptr = torch.full((4,), -1, dtype=torch.int32)
    kv_indices = torch.full((70,), -1, dtype=torch.int32)
    ref.build_kv_indices(req_to_token, rpi, lens, kv_indptr, kv_indices)
    want = []
    for r, n in zip(rpi.tolist(), lens.tolist()):
        want += req_to_token[r, :n].tolist()
    assert kv_indptr.tolist() == [0, 17, 18, 68]
    assert kv_indices[:68].tolist() == want
    assert (kv_indices[68:] == -1).all()


def test_store_kv_writes_only_given_slots():
    k_cache = torch.randn(10, 2, 4)
    v_cache = torch.randn(10, 2, 4)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([7, 2, 5], dtype=torch.int32)
    ref.store_kv(k_cache, v_cache, k, v, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(k_cache[s], k[i]) and torch.equal(v_cache[s], v[i])
    rest = [i for i in range(10) if i not in slots.tolist()]
    assert torch.equal(k_cache[rest], before_k[rest]) and torch.equal(v_cache[rest], before_v[rest])


def _bits(allowed):
    """[batch, vocab] bool -> packed [batch, ceil(vocab/32)] int32."""
    b, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(b, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(b, words, 32) << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _one(v, dtype=torch.float32):
    return torch.tensor([v], dtype=dtype)


def test_filtered_probs_semantics():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0, 2.5]])
    p_full = torch.softmax(logits, -1)[0]
    none = dict(top_k=_one(0, torch.int32), top_p=_one(1.0), min_p=_one(0.0))
    # no filter: the softmax itself
    torch.testing.assert_close(ref.filtered_probs(logits, None, _one(1.0), **none)[0], p_full)
    # temperature sharpens
    cold = ref.filtered_probs(logits, None, _one(0.5), **none)[0]
    torch.testing.assert_close(cold, torch.softmax(logits / 0.5, -1)[0])
    # top_k = 2 keeps the two largest (ids 0 and 5), renormalised
    p = ref.filtered_probs(logits, None, _one(1.0), _one(2, torch.int32), _one(1.0), _one(0.0))[0]
    assert (p > 0).nonzero().flatten().tolist() == [0, 5]
    torch.testing.assert_close(p[[0, 5]], p_full[[0, 5]] / p_full[[0, 5]].sum())
    # top_p: the smallest prefix whose mass reaches top_p
    order = p_full.argsort(descending=True)
    cum = p_full[order].cumsum(0)
    top_p = float(cum[1]) + 1e-4  # needs three tokens
    p = ref.filtered_probs(logits, None, _one(1.0), _one(0, torch.int32), _one(top_p), _one(0.0))[0]
    assert sorted((p > 0).nonzero().flatten().tolist()) == sorted(order[:3].tolist())
    # min_p: keeps p >= min_p * p_max
    p = ref.filtered_probs(logits, None, _one(1.0), _one(0, torch.int32), _one(1.0), _one(0.3))[0]
    keep = p_full >= 0.3 * p_full.max()
    assert torch.equal(p > 0, keep)
    # the bitmask removes tokens before everything else (argmax 0 masked: 5 becomes the max)
    allowed = torch.tensor([[False, True, True, True, True, True]])
    p = ref.filtered_probs(logits, _bits(allowed), _one(1.0), _one(1, torch.int32), _one(1.0), _one(0.0))[0]
    assert p.argmax().item() == 5 and p[5].item() == 1.0
    # the first token always survives, whatever top_p is
    p = ref.filtered_probs(logits, None, _one(1.0), _one(0, torch.int32), _one(1e-9), _one(0.0))[0]
    assert p[0].item() == 1.0


def test_bitmask_sample_reference_contract():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 70, generator=g) * 2
    allowed = torch.rand(5, 70, generator=g) < 0.5
    allowed[:, 3] = True
    bits = _bits(allowed)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 0.0])
    top_k = torch.tensor([0, 5, 0, 0, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0])
    seeds = torch.arange(5, dtype=torch.int64)
    offsets = torch.full((5,), 11, dtype=torch.int64)
    ids, logprobs = ref.bitmask_sample(logits, bits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert allowed.gather(1, ids[:, None]).all()
    masked = logits.masked_fill(~allowed, float("-inf"))
    assert ids[0] == masked[0].argmax() and ids[4] == masked[4].argmax()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])
    again, _ = ref.bitmask_sample(logits, bits, temperature, top_k, top_p, min_p, seeds, offsets)
    assert torch.equal(ids, again)


def test_rotary_vs_complex_formulation():
    g = torch.Generator().manual_seed(1)
    tokens, hq, hk, d = 5, 4, 2, 16
    q = torch.randn(tokens, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(tokens, hk, d, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 3, 17, 100, 4096])
    freqs = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(5000, dtype=torch.float64)[:, None] * freqs[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    want = []
    for t in (q, k):
        # neox: pairs (x[i], x[i + d/2]) as complex numbers, rotated by e^{i p f}
        z = torch.complex(t[..., :d // 2], t[..., d // 2:])
        z = z * torch.polar(torch.ones_like(ang[positions]), ang[positions])[:, None, :]
        want.append(torch.cat([z.real, z.imag], -1))
    ref.rotary_embedding(positions, q, k, cache)
    torch.testing.assert_close(q, want[0], atol=2e-6, rtol=2e-6)  # the reference rotates in fp32
    torch.testing.assert_close(k, want[1], atol=2e-6, rtol=2e-6)


def test_fused_add_rms_norm_mutation_and_formula():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 8, generator=g)
    residual = torch.randn(3, 8, generator=g)
    w = torch.rand(8, generator=g) + 0.5
    s = x + residual
    want_x = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w
    ref.fused_add_rms_norm(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, s)
    torch.testing.assert_close(x, want_x)
    torch.testing.assert_close(ref.rms_norm(s, w, 1e-6), want_x)


def test_fused_add_rms_norm_fp32_residual_beside_bf16_x():
    # a half-precision model's residual stream: residual fp32, x (block output / norm output) bf16
    g = torch.Generator().manual_seed(3)
    num_tokens, hidden = 19, 99
    x = (torch.randn(num_tokens, hidden, generator=g) * 3).bfloat16()
    residual = torch.randn(num_tokens, hidden, generator=g) * 40                # f32, large: bf16 would round it
    w = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    s = x.double() + residual.double()
    want_x = s / torch.sqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w.double()
    ref.fused_add_rms_norm(x, residual, w, 1e-6)
    assert residual.dtype == torch.float32 and x.dtype == torch.bfloat16
    # the residual is the fp32 sum (one fp32 rounding), not a bf16-rounded one
    torch.testing.assert_close(residual.double(), s, atol=0, rtol=2 ** -23)
    assert not torch.equal(residual, residual.bfloat16().float())
    # x is the norm of that fp32 sum, rounded once to bf16 (half a bf16 ulp, relative 2^-9)
    torch.testing.assert_close(x.double(), want_x, atol=1e-6, rtol=2 ** -8)


def test_fused_add_rms_norm_same_dtype_residual_unchanged_for_bf16():
    # residual in x's dtype (bf16) still works: the sum rounded to bf16, the norm of the fp32 sum
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g).bfloat16()
    residual = torch.randn(5, 64, generator=g).bfloat16()
    w = (torch.rand(64, generator=g) + 0.5).bfloat16()
    s = x.float() + residual.float()
    want_x = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w.float()).bfloat16()
    ref.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, s.bfloat16())
    assert torch.equal(x, want_x)


@pytest.mark.parametrize("x_dtype,res_dtype", [(torch.bfloat16, torch.float16),
                                               (torch.float32, torch.bfloat16),
                                               (torch.float16, torch.float64)])
def test_fused_add_rms_norm_rejects_other_residual_dtypes(x_dtype, res_dtype):
    x = torch.ones(2, 8, dtype=x_dtype)
    residual = torch.ones(2, 8, dtype=res_dtype)
    with pytest.raises(ValueError, match="residual dtype must equal x dtype"):
        ref.fused_add_rms_norm(x, residual, torch.ones(8, dtype=x_dtype), 1e-6)


def test_silu_and_mul_formula():
    x = torch.randn(4, 10)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(ref.silu_and_mul(x), g / (1 + torch.exp(-g)) * u)


@pytest.mark.skipif(importlib.util.find_spec("radixserve._C") is None, reason="radixserve._C not built")
def test_extension_registers_every_op():
    import radixserve._C  # noqa: F401

    for name in ALL_OPS:
        assert hasattr(torch.ops.radixserve, name), f"torch.ops.radixserve.{name} missing"


def test_argmax_rows_takes_the_first_maximum():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [-1.0, -1.0, -5.0, -1.0],
                           [0.0, float("nan"), 9.0, float("nan")]])
    assert ref.argmax_rows(logits).tolist() == [1, 0, 1]


def test_skinny_gated_linear_is_the_mlp_projection_and_activation():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, generator=g)
    w = torch.randn(2 * 6, 16, generator=g)   # [gate rows | up rows]
    b = torch.randn(12, generator=g)
    gate, up = x @ w[:6].t() + b[:6], x @ w[6:].t() + b[6:]
    want = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(ref.skinny_gated_linear(x, w, b), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref.skinny_linear(x, w, b), x @ w.t() + b, atol=1e-5, rtol=1e-5)


def test_skinny_linear_never_fits_off_the_kernel_path():
    # the op seam sends CPU tensors (and fp32) to the reference: the model keeps its CPU GEMMs
    from radixserve import ops
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    assert not ops.skinny_linear_fits(x, w)
    torch.testing.assert_close(ops.skinny_linear(x, w), torch.nn.functional.linear(x, w))


def test_rotary_embedding_store_kv_equals_the_two_ops():
    from radixserve import ops
    g = torch.Generator().manual_seed(6)
    hq, hk, d, n = 4, 2, 8, 3
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=g)
    q = qkv[:, :hq * d].view(n, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(n, hk, d)
    v = qkv[:, (hq + hk) * d:].view(n, hk, d)
    ang = torch.arange(64, dtype=torch.float64)[:, None] / (100 ** (torch.arange(0, d, 2) / d))
    cache = torch.cat([ang.cos(), ang.sin()], -1).float()
    positions = torch.tensor([5, 0, 63])
    slots = torch.tensor([4, 1, 7], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(9, hk, d), torch.zeros(9, hk, d)
    want_q, want_k = q.clone(), k.clone()
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    ref.rotary_embedding(positions, want_q, want_k, cache)
    ref.store_kv(want_kc, want_vc, want_k, v, slots)
    ops.rotary_embedding_store_kv(positions, q, k, v, cache, k_cache, v_cache, slots)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)
    assert k_cache[4].abs().sum() > 0 and v_cache[7].abs().sum() > 0, "nothing was stored"
