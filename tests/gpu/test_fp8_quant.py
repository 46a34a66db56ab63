"""fp8_quantize and rmsnorm_quant_fp8 kernels (csrc/include/radixserve/fp8_quant.cuh) against
the references, bit for bit: the same scales and the same e4m3 bytes. The fused kernel's norm
must equal our norm kernels' output (same reduction), so its quantization is compared with the
reference quantization of what rms_norm / fused_add_rms_norm write on the GPU."""
import pytest
import torch

from _gpu import requires_kernels
from radixserve import ops
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]


def _same(a, b):
    qa, sa = a
    qb, sb = b
    assert qa.dtype == qb.dtype == torch.float8_e4m3fn and qa.shape == qb.shape
    assert torch.equal(sa.reshape(-1), sb.reshape(-1))
    assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 576), (33, 4096), (5, 1000), (3, 14336)])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantize_matches_reference_bytes(dtype, rows, hidden, static):
    g = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, generator=g, device="cuda") * 3).to(dtype)
    x[0, : min(4, hidden)] = 0
    if rows > 1:
        x[1] = 0                                  # an all-zero row: the amax floor
    scale = torch.tensor([0.02], device="cuda") if static else None
    got = torch.ops.radixserve.fp8_quantize(x, scale)
    _same(got, ref.fp8_quantize(x, scale))
    _same(ops.fp8_quantize(x, scale), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (9, 4096), (4, 8192), (3, 1000)])
@pytest.mark.parametrize("residual", [None, "same", "float32"])
@pytest.mark.parametrize("static", [False, True])
def test_rmsnorm_quant_fp8_matches_norm_then_quantize(dtype, rows, hidden, residual, static):
    g = torch.Generator(device="cuda").manual_seed(rows * 3 + hidden)
    x = torch.randn(rows, hidden, generator=g, device="cuda").to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    scale = torch.tensor([0.01], device="cuda") if static else None
    res = None
    if residual is not None:
        rdt = dtype if residual == "same" else torch.float32
        res = torch.randn(rows, hidden, generator=g, device="cuda").to(rdt)
    x0 = x.clone()
    # unfused, on our norm kernels
    if res is None:
        y = ops.rms_norm(x, w, 1e-6)
    else:
        y, res_want = x.clone(), res.clone()
        ops.fused_add_rms_norm(y, res_want, w, 1e-6)
    want = ref.fp8_quantize(y, scale)
    res_got = None if res is None else res.clone()
    got = torch.ops.radixserve.rmsnorm_quant_fp8(x, res_got, w, 1e-6, scale)
    _same(got, want)
    assert torch.equal(x, x0)                     # x is read only
    if res is not None:
        assert torch.equal(res_got, res_want)
    # and the seam picks the kernel with the same result
    res_seam = None if res is None else res.clone()
    _same(ops.rmsnorm_quant_fp8(x, res_seam, w, 1e-6, scale), want)


def test_rmsnorm_quant_fp8_long_rows_take_the_reference():
    x = torch.randn(2, 8192 + 8, device="cuda").to(torch.bfloat16)
    w = torch.ones(8192 + 8, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="8192"):
        torch.ops.radixserve.rmsnorm_quant_fp8(x, None, w, 1e-6, None)
    _same(ops.rmsnorm_quant_fp8(x, None, w, 1e-6), ref.rmsnorm_quant_fp8(x, None, w, 1e-6))
