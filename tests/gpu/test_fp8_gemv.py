"""fp8_skinny_linear (csrc/include/radixserve/fp8_gemv.cuh on the tensor cores, fp8_gemv_cc.cuh
on the CUDA cores for 1..4 rows; each forced through the op's cuda_core_rows) against the
dequantize-then-matmul oracle in fp64, at odd sizes: 1..16 rows, n not a multiple of the
16-column tile or the 8-warp CTA, k not a multiple of the 64-wide k block or of a lane's trip,
per-channel and per-tensor scales, bias, strided x.

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


# cuda_core_rows: 0 = the tensor-core kernel at every m; 4 = the CUDA-core kernel up to 4 rows
KERNELS = {"mma": 0, "cuda_core": 4}
CC_MAX_ROWS = 4


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 16), (19, 80), (989, 4096), (4096, 14336), (6144, 4096),
                                 (13, 8208)])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_fp8_skinny_linear_matches_dequantized_fp64(m, n, k, per_channel, kernel):
    if kernel == "cuda_core" and m > CC_MAX_ROWS:
        pytest.skip("the CUDA-core kernel serves 1..4 rows")
    g = torch.Generator(device="cuda").manual_seed(m * 131 + n + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, generator=g, device="cuda") / k ** 0.5
    q, scale = _quantize(w, per_channel)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16)
    for bias in (None, b):
        got = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias, False, KERNELS[kernel])
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        _check(got, x, q, scale, bias)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_both_kernels_agree_to_fp32_summation_order(m):
    """The CUDA-core and tensor-core kernels compute the same sums in different orders: their
    bf16 outputs differ by at most a last place, on a few columns."""
    g = torch.Generator(device="cuda").manual_seed(77 + m)
    x = torch.randn(m, 4096, generator=g, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(6144, 4096, generator=g, device="cuda") / 64, True)
    cc = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, False, 4).float()
    tc = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, False, 0).float()
    assert (cc - tc).abs().le(2.0 ** -7 * tc.abs() + 1e-4 * tc.abs().max()).all()
    assert (cc != tc).float().mean().item() < 0.2


def _kernels_run(fn):
    """Names of the CUDA kernels fn launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("m,gated,k,cuda_cores", [
    (1, True, 256, True), (2, True, 256, True), (3, True, 256, False),
    (1, False, 8192, True), (1, False, 8176, False), (2, False, 8192, False)])
def test_default_dispatch(m, gated, k, cuda_cores):
    """cuda_core_rows=-1 (what the server passes) runs the CUDA-core kernel exactly where
    fp8_gemv_cc::serves_by_default says, the tensor cores' elsewhere, with that kernel's bits."""
    g = torch.Generator(device="cuda").manual_seed(m + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(512, k, generator=g, device="cuda") / k ** 0.5, True)
    run = lambda rows: torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, gated, rows)
    names = _kernels_run(lambda: run(-1))
    want = "fp8_cc_kernel" if cuda_cores else "fp8_skinny_kernel"
    assert len(names) == 1 and want in names[0], names
    assert torch.equal(run(-1), run(4 if cuda_cores else 0))


def test_cuda_core_rows_is_checked():
    x = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(32, 64, device="cuda"), True)
    for bad in (-2, 5):
        with pytest.raises(RuntimeError, match="cuda_core_rows"):
            torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, False, bad)


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


@pytest.mark.parametrize("m", [1, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("inter,k", [(24, 80), (989, 4096), (14336, 4096)])
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_gated_form_is_the_projection_then_silu_and_mul(m, inter, k, per_channel, kernel):
    """The gated kernel (gate|up fused with the activation) gives what the plain kernel's
    [m, 2 inter] projection followed by the silu_and_mul kernel gives, up to the last place of
    the bf16 projections (the two forms sum k over different warp counts: fp8_gemv.cuh), and
    ops.fp8_skinny_gated_linear runs it."""
    from radixserve import ops

    if kernel == "cuda_core" and m > CC_MAX_ROWS:
        pytest.skip("the CUDA-core kernel serves 1..4 rows")
    rows = KERNELS[kernel]
    g = torch.Generator(device="cuda").manual_seed(m * 7 + inter + k)
    x = torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(2 * inter, k, generator=g, device="cuda") / k ** 0.5
    q, scale = _quantize(w, per_channel)
    b = torch.randn(2 * inter, generator=g, device="cuda").to(torch.bfloat16)
    for bias in (None, b):
        fused = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias, True, rows)
        assert fused.shape == (m, inter) and fused.dtype == torch.bfloat16
        proj = torch.ops.radixserve.fp8_skinny_linear(x, q, scale, bias, False, rows)
        _check(proj, x, q, scale, bias)
        want = ops.silu_and_mul(proj).float()
        err = (fused.float() - want).abs()
        bound = 2.0 ** -6 * want.abs() + 2.0 ** -8 * want.abs().max()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        assert (err > 0).float().mean().item() < 0.05          # mostly the same bits
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ops, "FP8_CUDA_CORE_ROWS", rows)
            assert torch.equal(ops.fp8_skinny_gated_linear(x, q, scale, bias), fused)


def test_gated_form_refuses_an_odd_weight():
    x = torch.randn(2, 64, device="cuda").to(torch.bfloat16)
    q, scale = _quantize(torch.randn(33, 64, device="cuda"), True)
    with pytest.raises(RuntimeError, match="even row count"):
        torch.ops.radixserve.fp8_skinny_linear(x, q, scale, None, True)
