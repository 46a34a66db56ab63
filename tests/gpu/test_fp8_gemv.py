"""fp8_skinny_linear (csrc/include/radixserve/fp8_gemv.cuh) against the dequantize-then-matmul
oracle in fp64, at odd sizes: 1..16 rows, n not a multiple of the 16-column tile, k not a
multiple of the 64-wide k block, per-channel and per-tensor scales, bias, strided x.

The kernel decodes e4m3 codes of exponent 0 (zero and subnormals) to within 2^-6 of their
value (its header says why); the bound below adds that term per output explicitly, so every
other disagreement (a wrong fragment layout, a lost k block, a wrong scale) fails."""
import pytest
import torch

from _gpu import requires_kernels

pytestmark = [pytest.mark.gpu, requires_kernels]

E4M3 = torch.float8_e4m3fn


def _quantize(w: torch.Tensor, per_channel: bool):
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1, 1)
    scale = (amax / 448.0).clamp(min=1e-12).float()
    q = (w / scale).clamp(-448, 448).to(E4M3)
    return q, scale.reshape(-1).contiguous()


def _check(got, x, q, scale, bias):
    s = scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double()
    wd = q.double() * s                                               # [n, k]
    want = x.double() @ wd.t() + (0 if bias is None else bias.double())
    sub = ((q.view(torch.uint8) & 0x78) == 0).double() * s * 2.0 ** -6   # exponent-0 codes
    sub_err = x.double().abs() @ sub.t()
    err = (got.double() - want).abs()
    bound = 8e-3 * want.abs() + 1e-4 * want.abs().max() + sub_err
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess error {worst}"


@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 16), (19, 80), (989, 4096), (4096, 14336), (6144, 4096)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_skinny_linear_matches_dequantized_fp64(m, n, k, per_channel):
    g = torch.Generator(device="cuda").manual_seed(m * 131 + n + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
    q, scale = _quantize(w, per_channel)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    for bias in (None, b):
        got = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        _check(got, x, q, scale, bias)


def test_fp8_skinny_linear_reads_strided_rows_only():
    g = torch.Generator(device="cuda").manual_seed(5)
    base = torch.randn(3, 1024 + 64, generator=g, device="cuda").to(torch.bfloat16)
    x = base[:, :1024]
    q, scale = _quantize(torch.randn(300, 1024, generator=g, device="cuda"), True)
    got = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None)
    _check(got, x, q, scale, None)
    assert torch.equal(got, torch.ops.radixserve.fp8_skinny_linear(x.contiguous(), q, scale, None))


def test_fp8_skinny_linear_refuses_what_it_cannot_serve():
    x = torch.randn(17, 64, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(32, 64, device="cuda"), True)
    with pytest.raises(RuntimeError, match="rows"):
        torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.radixserve.fp8_skinny_linear(x[:2, :40], q[:, :40].contiguous(), scale, None)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        torch.ops.radixserve.fp8_skinny_linear(x[:2], q.view(torch.uint8), scale, None)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("inter,k", [(24, 80), (989, 4096), (14336, 4096)])
@pytest.mark.parametrize("per_channel", [True, False])
def test_gated_form_is_the_projection_then_silu_and_mul(m, inter, k, per_channel):
    """The gated kernel (gate|up fused with the activation) gives what the plain kernel's
    [m, 2 inter] projection followed by the silu_and_mul kernel gives, up to the last place of
    the bf16 projections (the two forms sum k over different warp counts: fp8_gemv.cuh), and
    ops.fp8_skinny_gated_linear runs it."""
    from radixserve import ops

    g = torch.Generator(device="cuda").manual_seed(m * 7 + inter + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(2 * inter, k, generator=g, device="cuda") / k ** 0.5
    q, scale = _quantize(w, per_channel)
    b = torch.randn(2 * inter, generator=g, device="cuda").to(torch.bfloat16)
    for bias in (None, b):
        fused = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias, True)
        assert fused.shape == (m, inter) and fused.dtype == torch.bfloat16
        proj = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias)
        _check(proj, x, q, scale, bias)
        want = ops.silu_and_mul(proj).float()
        err = (fused.float() - want).abs()
        bound = 2.0 ** -6 * want.abs() + 2.0 ** -8 * want.abs().max()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        assert (err > 0).float().mean().item() < 0.05          # mostly the same bits
        assert torch.equal(ops.fp8_skinny_gated_linear(x, q, scale, bias), fused)


def test_gated_form_refuses_an_odd_weight():
    x = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(33, 64, device="cuda"), True)
    with pytest.raises(RuntimeError, match="even row count"):
        torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, True)
