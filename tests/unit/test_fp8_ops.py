"""The FP8 ops of the seam (radixserve.ops: fp8_quantize, fp8_scaled_mm, fp8_linear,
rmsnorm_quant_fp8) and their references, on the CPU, against closed formulas in fp64: the
oracle of the CUDA paths (torch._scaled_mm, fp8_skinny_linear) is checked first."""
import pytest
import torch
import torch.nn.functional as F

from radixserve import ops
from radixserve.ops import reference as ref
from radixserve.ops.reference import FP8_MIN_AMAX
from radixserve.quant.fp8 import SCALE_SEARCH, quantize_weight_per_channel

E4M3 = torch.float8_e4m3fn


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _e4m3_rel_step():
    return 2.0 ** -4          # half the spacing of e4m3's 3 mantissa bits, relative


def test_quantize_weight_per_channel_formula():
    """search=False: the plain absmax scale (the dummy weights' form)."""
    w = _randn(37, 80, seed=1, scale=0.05)
    w[3] = 0.0                                    # an all-zero row: tiny scale, zero codes
    w[5, 7] = 9.0                                 # an outlier sets its row's scale alone
    q, scale = quantize_weight_per_channel(w, search=False)
    assert q.dtype == E4M3 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    amax = w.abs().amax(dim=1)
    torch.testing.assert_close(scale[amax > 0], amax[amax > 0] / 448.0, rtol=0, atol=0)
    assert scale[3] > 0 and bool((q[3].float() == 0).all())
    assert bool((q.float().abs().amax(dim=1)[amax > 0] == 448.0).all())   # amax maps onto 448
    expected = (w / scale[:, None].clamp(min=1e-30)).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    back = q.float() * scale[:, None]
    assert bool(((back - w).abs() <= _e4m3_rel_step() * w.abs() + 2.0 ** -9 * scale[:, None]).all())


def _row_sq_err(w, q, scale):
    return (q.float() * scale[:, None] - w).square().sum(dim=1)


def test_quantize_weight_per_channel_scale_search():
    """The default (--quantization fp8) scale search: each row's scale is amax * c / 448 for a
    c of SCALE_SEARCH, its codes are the row quantized at that scale, its squared error is the
    least over every c (never above the absmax scale's), and in total clearly below it on
    heavy-tailed rows."""
    g = torch.Generator().manual_seed(3)
    chi2 = torch.randn(3, 64, 96, generator=g).square().sum(0) / 3
    w = torch.randn(64, 96, generator=g) / chi2.sqrt() * 0.02     # Student t (3 dof): heavy tails
    w[3] = 0.0
    q, scale = quantize_weight_per_channel(w)
    q0, scale0 = quantize_weight_per_channel(w, search=False)
    amax = w.abs().amax(dim=1)
    errs = []
    for c in SCALE_SEARCH:
        s_c = (amax * c).clamp(min=FP8_MIN_AMAX) / 448.0
        errs.append(_row_sq_err(w, (w / s_c[:, None]).clamp(-448, 448).to(E4M3), s_c))
    errs = torch.stack(errs, dim=1)                                  # [rows, candidates]
    err = _row_sq_err(w, q, scale)
    torch.testing.assert_close(err, errs.min(dim=1).values, rtol=1e-6, atol=0)
    ratio = scale / scale0
    for r in range(64):
        if r == 3:
            continue
        assert any(abs(ratio[r].item() - c) < 1e-6 for c in SCALE_SEARCH), (r, ratio[r])
        expected = (w[r] / scale[r]).clamp(-448, 448).to(E4M3)
        assert torch.equal(q[r].view(torch.uint8), expected.view(torch.uint8))
    assert bool((err <= _row_sq_err(w, q0, scale0)).all())
    assert err.sum() < 0.95 * _row_sq_err(w, q0, scale0).sum()
    assert bool((q[3].float() == 0).all()) and scale[3] > 0          # a zero row stays zero
    assert SCALE_SEARCH[0] == 1.0 and min(SCALE_SEARCH) < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_quantize_per_token_and_static(dtype):
    x = _randn(9, 48, seed=2, dtype=dtype)
    x[4] = 0                                       # a padding row quantizes to zeros
    q, s = ops.fp8_quantize(x)
    assert q.shape == x.shape and q.dtype == E4M3 and s.shape == (9, 1) and s.dtype == torch.float32
    amax = x.float().abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(s, amax.clamp(min=1e-12) / 448.0, rtol=0, atol=0)
    assert bool((q[4].float() == 0).all())
    back = q.float() * s
    assert bool(((back - x.float()).abs() <= _e4m3_rel_step() * x.float().abs() + 2.0 ** -9 * s).all())
    # static: the given scale on every row, values beyond 448 * scale clamp to +-448
    scale = torch.tensor([0.002])
    q2, s2 = ops.fp8_quantize(x, scale)
    assert torch.equal(s2, scale.expand(9, 1))
    expected = (x.float() / 0.002).clamp(-448, 448).to(E4M3)
    assert torch.equal(q2.view(torch.uint8), expected.view(torch.uint8))
    assert float(q2.float().abs().max()) == 448.0


def _fp64_scaled_mm(xq, xs, w, ws, bias):
    out = (xq.double() @ w.double().t()) * xs.double() * ws.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_scaled_mm_reference_is_the_fp64_product(per_channel, out_dtype):
    x = _randn(11, 96, seed=3)
    w = _randn(40, 96, seed=4, scale=0.1)
    if per_channel:
        wq, ws = quantize_weight_per_channel(w)
    else:
        ws = (w.abs().amax() / 448).reshape(1)
        wq = (w / ws).clamp(-448, 448).to(E4M3)
    xq, xs = ops.fp8_quantize(x)
    bias = _randn(40, seed=5, dtype=out_dtype)
    for b in (None, bias):
        got = ops.fp8_scaled_mm(xq, xs, wq, ws, b, out_dtype)
        assert got.shape == (11, 40) and got.dtype == out_dtype
        want = _fp64_scaled_mm(xq, xs, wq, ws, b)
        tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())


def _cpu_scaled_mm() -> bool:
    try:
        one = torch.ones(16, 16).to(E4M3)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm")
@pytest.mark.parametrize("variant", ["plain", "fast", "swap", "swap-fast"])
@pytest.mark.parametrize("m", [5, 32])
def test_scaled_mm_rowwise_variants_are_the_same_product(variant, m):
    """ops.scaled_mm_rowwise (the GPU's W8A8 call, RADIXSERVE_FP8_SCALED_MM) on torch's CPU
    _scaled_mm: every variant is the fp64 product of the quantized operands, [M, N] contiguous
    (swap transposes its [N, M] result back; at M % 16 != 0 it runs plain); per-tensor weight
    scales are spread over the rows."""
    x = _randn(m, 96, seed=7)
    w = _randn(48, 96, seed=8, scale=0.1)
    xq, xs = ops.fp8_quantize(x)
    for per_channel in (True, False):
        if per_channel:
            wq, ws = quantize_weight_per_channel(w)
        else:
            ws = (w.abs().amax() / 448).reshape(1)
            wq = (w / ws).clamp(-448, 448).to(E4M3)
        got = ops.scaled_mm_rowwise(xq, xs, wq, ws, variant)
        assert got.shape == (m, 48) and got.dtype == torch.bfloat16 and got.is_contiguous()
        want = _fp64_scaled_mm(xq, xs, wq, ws, None)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -8,
                                   atol=2 ** -8 * want.abs().max().item())


def test_fp8_linear_modes():
    x = _randn(7, 64, seed=6, dtype=torch.bfloat16)
    w = _randn(24, 64, seed=7, scale=0.05)
    wq, ws = quantize_weight_per_channel(w)
    bias = _randn(24, seed=8, dtype=torch.bfloat16)
    # weight-only: the weight dequantized (rounded once to x's dtype), F.linear in x's dtype
    got = ops.fp8_linear(x, wq, ws, bias, act_quant="none")
    w_deq = (wq.float() * ws[:, None]).to(torch.bfloat16)
    assert torch.equal(got, F.linear(x, w_deq, bias))
    # dynamic / static W8A8: fp8_quantize then fp8_scaled_mm, in x's dtype
    xq, xs = ops.fp8_quantize(x)
    assert torch.equal(ops.fp8_linear(x, wq, ws, bias, act_quant="dynamic"),
                       ops.fp8_scaled_mm(xq, xs, wq, ws, bias, torch.bfloat16))
    scale = torch.tensor([0.01])
    xq, xs = ops.fp8_quantize(x, scale)
    assert torch.equal(ops.fp8_linear(x, wq, ws, None, act_quant="static", input_scale=scale),
                       ops.fp8_scaled_mm(xq, xs, wq, ws, None, torch.bfloat16))
    # input_scale is ignored unless static
    assert torch.equal(ops.fp8_linear(x, wq, ws, None, act_quant="dynamic", input_scale=scale),
                       ops.fp8_linear(x, wq, ws, None, act_quant="dynamic"))
    # W8A8 approximates the weight-only product (activation rounding only)
    w8a8 = ops.fp8_linear(x, wq, ws, None, act_quant="dynamic").float()
    w8a16 = ops.fp8_linear(x, wq, ws, None, act_quant="none").float()
    assert (w8a8 - w8a16).abs().max() < 0.1 * w8a16.abs().max()
    with pytest.raises(ValueError, match="act_quant"):
        ops.fp8_linear(x, wq, ws, None, act_quant="token")
    with pytest.raises(ValueError, match="input_scale"):
        ops.fp8_linear(x, wq, ws, None, act_quant="static")


def test_fp8_linear_per_tensor_scale_broadcasts():
    x = _randn(5, 32, seed=9)
    w = _randn(16, 32, seed=10, scale=0.1)
    ws = (w.abs().amax() / 448).reshape(1)
    wq = (w / ws).clamp(-448, 448).to(E4M3)
    for mode in ("none", "dynamic"):
        one = ops.fp8_linear(x, wq, ws, None, act_quant=mode)
        rows = ops.fp8_linear(x, wq, ws.expand(16).contiguous(), None, act_quant=mode)
        assert torch.equal(one, rows), mode


def test_fp8_references_in_tiles_equal_one_tile(monkeypatch):
    """Weights and activations larger than a tile run in slices (bounded fp32 copies) with the
    results of one tile."""
    x = _randn(50, 64, seed=11)
    w = _randn(300, 64, seed=12, scale=0.1)
    wq, ws = quantize_weight_per_channel(w)
    whole = {m: ops.fp8_linear(x, wq, ws, None, act_quant=m) for m in ("none", "dynamic")}
    xq_whole = ops.fp8_quantize(x)
    monkeypatch.setattr(ref, "TILE_BYTES", 32 * 64 * 7)        # 7 rows a tile
    assert len(ref._row_tiles(300, 64)) > 1
    for mode, want in whole.items():
        torch.testing.assert_close(ops.fp8_linear(x, wq, ws, None, act_quant=mode), want,
                                   rtol=1e-6, atol=1e-6)
    xq, xs = ops.fp8_quantize(x)
    assert torch.equal(xq.view(torch.uint8), xq_whole[0].view(torch.uint8))
    assert torch.equal(xs, xq_whole[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_rmsnorm_quant_fp8_is_norm_then_quantize(dtype, static):
    x = _randn(6, 40, seed=13, dtype=dtype)
    residual = _randn(6, 40, seed=14)                      # the fp32 residual stream
    weight = (1 + 0.1 * _randn(40, seed=15)).to(dtype)
    scale = torch.tensor([0.02]) if static else None
    # fused
    x_in, res = x.clone(), residual.clone()
    q, s = ops.rmsnorm_quant_fp8(x_in, res, weight, 1e-6, scale)
    assert torch.equal(x_in, x)                            # x is read only
    # unfused: fused_add_rms_norm in place, then fp8_quantize
    x_ref, res_ref = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x_ref, res_ref, weight, 1e-6)
    q_ref, s_ref = ops.fp8_quantize(x_ref, scale)
    assert torch.equal(res, res_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    # no residual: rms_norm then quantize
    q0, s0 = ops.rmsnorm_quant_fp8(x, None, weight, 1e-6, scale)
    q0_ref, s0_ref = ops.fp8_quantize(ops.rms_norm(x, weight, 1e-6), scale)
    assert torch.equal(q0.view(torch.uint8), q0_ref.view(torch.uint8)) and torch.equal(s0, s0_ref)


def test_fp8_ops_run_the_reference_on_the_cpu():
    x = _randn(3, 32, seed=16, dtype=torch.bfloat16)
    wq, ws = quantize_weight_per_channel(_randn(16, 32, seed=17))
    assert not ops.fp8_scaled_mm_fits(*ops.fp8_quantize(x)[:1], wq)
    assert not ops.fp8_skinny_linear_fits(x, wq, ws, None)
    assert torch.equal(ops.fp8_linear(x, wq, ws, None, act_quant="none"),
                       ref.fp8_linear(x, wq, ws, None, "none", None))
    empty = ops.fp8_linear(x[:0], wq, ws, None, act_quant="dynamic")
    assert empty.shape == (0, 16)
