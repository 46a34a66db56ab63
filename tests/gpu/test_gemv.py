"""skinny_linear (plain and gated), skinny_norm_linear and argmax_rows kernels against the
reference.

The skinny GEMM accumulates in fp32 in its own order, so it is compared with an fp64 product of
the same (rounded) inputs, within one rounding of the output dtype; the gated form must also
equal silu_and_mul of its own plain projections, since it rounds them as the unfused path does.
skinny_norm_linear must equal the norm kernel followed by skinny_linear bit for bit: it
reproduces the norm's arithmetic and reduction order."""
import pytest
import torch
import torch.nn.functional as F

from _gpu import requires_kernels
from radixserve import ops
from radixserve.ops import reference as ref

pytestmark = [pytest.mark.gpu, requires_kernels]

# one rounding of the output: half an ulp relative, plus an fp32-sum term for long k
ROUND = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _expect_close(got, want64, dtype):
    err = (got.double() - want64).abs()
    bound = ROUND[dtype] * want64.abs() + 1e-4 * want64.abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess error {worst}"


def _case(m, n, k, dtype, seed, x_stride=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = x_stride or k
    base = torch.randn(m, rows, generator=g, device="cuda").to(dtype)
    x = base[:, :k]                                                   # [m, k], row stride rows
    w = (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(1, 8), (19, 64), (989, 4096), (4096, 14336), (6144, 4096)])
def test_skinny_linear_matches_fp64(dtype, m, n, k):
    x, w, b = _case(m, n, k, dtype, seed=m * 7 + n)
    assert ops.skinny_linear_fits(x, w)
    for bias in (None, b):
        got = torch.ops.radixserve.skinny_linear(x, w, bias, False)
        assert got.shape == (m, n) and got.dtype == dtype
        want = x.double() @ w.double().t() + (0 if bias is None else bias.double())
        _expect_close(got, want, dtype)


def test_skinny_linear_reads_strided_rows_only():
    # x rows at stride 4104 (a view into a wider buffer): the columns past k must not be read
    x, w, b = _case(3, 99, 4096, torch.bfloat16, seed=1, x_stride=4104)
    x.as_strided((3, 8), (4104, 1), 4096).fill_(float("nan"))
    got = torch.ops.radixserve.skinny_linear(x, w, b, False)
    assert torch.isfinite(got).all()
    _expect_close(got, x.double() @ w.double().t() + b.double(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("inter,k", [(19, 64), (989, 576), (14336, 4096)])
def test_skinny_gated_linear_is_silu_and_mul_of_its_projections(dtype, m, inter, k):
    x, w, b = _case(m, 2 * inter, k, dtype, seed=inter + m)
    for bias in (None, b):
        got = torch.ops.radixserve.skinny_linear(x, w, bias, True)
        assert got.shape == (m, inter)
        plain = torch.ops.radixserve.skinny_linear(x, w, bias, False)       # [m, 2 * inter]
        # same dot products, same rounding to dtype, same activation formula as silu_and_mul
        torch.testing.assert_close(got, torch.ops.radixserve.silu_and_mul(plain), atol=0, rtol=0)
        want = ref.skinny_gated_linear(x.double(), w.double(),
                                       None if bias is None else bias.double())
        torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(),
                                   rtol=2e-2)


def test_skinny_linear_rejects_what_it_cannot_serve():
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert not ops.skinny_linear_fits(x, w)            # 5 rows: cuBLAS's
    with pytest.raises(RuntimeError, match="rows"):
        torch.ops.radixserve.skinny_linear(x, w, None, False)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.radixserve.skinny_linear(x[:1, :60], w[:, :60].contiguous(), None, False)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.radixserve.skinny_linear(x[:1], w.half(), None, False)
    with pytest.raises(RuntimeError, match="gated"):
        torch.ops.radixserve.skinny_linear(x[:1], w[:31], None, True)
    # the seam falls back to the reference for a shape the kernel does not take
    torch.testing.assert_close(ops.skinny_linear(x, w), F.linear(x, w))


def _norm_case(m, n_rows, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(m, k, generator=g, device="cuda").to(dtype)              # block output
    residual = 4 * torch.randn(m, k, generator=g, device="cuda")            # f32 stream
    gamma = (torch.rand(k, generator=g, device="cuda") + 0.5).to(dtype)
    w = (torch.randn(n_rows, k, generator=g, device="cuda") / k ** 0.5).to(dtype)
    b = torch.randn(n_rows, generator=g, device="cuda").to(dtype)
    return h, residual, gamma, w, b


def _unfused(h, residual, gamma, w, bias, gated, eps):
    """The kernels the fused op replaces: fused_add_rms_norm (rms_norm without a residual),
    then skinny_linear (plain or gated) -> (out, the new residual)."""
    if residual is None:
        s, normed = h.float(), ops.rms_norm(h, gamma, eps)
    else:
        s, normed = residual.clone(), h.clone()
        ops.fused_add_rms_norm(normed, s, gamma, eps)
    return torch.ops.radixserve.skinny_linear(normed, w, bias, gated), s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n_rows,k", [(20, 64), (1000, 576), (512, 2048), (6144, 4096),
                                      (2 * 14336, 4096), (96, 8192)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_skinny_norm_linear_is_the_norm_then_the_projection_bit_for_bit(dtype, m, n_rows, k,
                                                                       with_residual):
    h, residual, gamma, w, b = _norm_case(m, n_rows, k, dtype, seed=m + n_rows + k)
    residual = residual if with_residual else None
    assert ops.skinny_norm_linear_fits(h, residual, gamma, w)
    h_before = h.clone()
    r_before = None if residual is None else residual.clone()
    for gated in (False, True):
        for bias in (None, b):
            want, want_s = _unfused(h, residual, gamma, w, bias, gated, 1e-5)
            got, s = torch.ops.radixserve.skinny_norm_linear(h, residual, gamma, 1e-5, w, bias,
                                                             gated)
            assert got.shape == ((m, n_rows // 2) if gated else (m, n_rows)) and got.dtype == dtype
            assert s.shape == (m, k) and s.dtype == torch.float32
            assert torch.equal(got, want), (gated, bias is None)
            assert torch.equal(s, want_s)
    assert torch.equal(h, h_before)                       # nothing written in place
    assert residual is None or torch.equal(residual, r_before)
    # and against the plain-torch reference: fp64 of the rounded normalised rows
    ref_out, ref_s = ref.skinny_norm_linear(h, residual, gamma, 1e-5, w, b)
    torch.testing.assert_close(s, ref_s, atol=0, rtol=0)
    got = ops.skinny_norm_linear(h, residual, gamma, 1e-5, w, b)[0]
    normed = ref.rms_norm(ref_s, gamma, 1e-5).to(dtype)
    _expect_close(got, normed.double() @ w.double().t() + b.double(), dtype)


def test_skinny_norm_linear_reads_strided_residual_and_x_rows_only():
    h, residual, gamma, w, _ = _norm_case(3, 99, 4096, torch.bfloat16, seed=5)
    wide_h = torch.full((3, 4104), float("nan"), device="cuda", dtype=torch.bfloat16)
    wide_r = torch.full((3, 4100), float("nan"), device="cuda")
    wide_h[:, :4096], wide_r[:, :4096] = h, residual
    got, s = torch.ops.radixserve.skinny_norm_linear(wide_h[:, :4096], wide_r[:, :4096], gamma,
                                                     1e-6, w, None, False)
    want, want_s = _unfused(h, residual, gamma, w, None, False, 1e-6)
    assert torch.equal(got, want) and torch.equal(s, want_s)


def test_skinny_norm_linear_rejects_what_it_cannot_serve():
    h, residual, gamma, w, _ = _norm_case(1, 32, 64, torch.bfloat16, seed=2)
    with pytest.raises(RuntimeError, match="at most 8192"):
        big = torch.zeros(1, 8200, device="cuda", dtype=torch.bfloat16)
        torch.ops.radixserve.skinny_norm_linear(big, None, big[0], 1e-6,
                                                torch.zeros(8, 8200, device="cuda",
                                                            dtype=torch.bfloat16), None, False)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.radixserve.skinny_norm_linear(h, residual.bfloat16(), gamma, 1e-6, w, None, False)
    with pytest.raises(RuntimeError, match="norm_weight"):
        torch.ops.radixserve.skinny_norm_linear(h, residual, gamma[:32], 1e-6, w, None, False)
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.radixserve.skinny_norm_linear(h, residual[:, :32], gamma, 1e-6, w, None, False)
    # the seam takes the reference where the kernel cannot run: same values
    h5 = h.expand(5, 64).contiguous()
    r5 = residual.expand(5, 64).contiguous()
    assert not ops.skinny_norm_linear_fits(h5, r5, gamma, w)
    out, s = ops.skinny_norm_linear(h5, r5, gamma, 1e-6, w)
    want_out, want_s = ref.skinny_norm_linear(h5, r5, gamma, 1e-6, w)
    assert torch.equal(out, want_out) and torch.equal(s, want_s)


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("vocab", [1, 7, 2049, 128256, 151937])
def test_argmax_rows_matches_torch(rows, vocab):
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 4
    if vocab > 8:
        # ties: a row's maximum repeated later (the first index wins), and one row all -inf but one
        logits[0, vocab - 3] = logits[0].max()
        logits[-1] = float("-inf")
        logits[-1, vocab // 2] = -1e30
    got = torch.ops.radixserve.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.argmax(-1))


def test_argmax_rows_strided_rows_and_nan():
    base = torch.randn(4, 5000, device="cuda")
    logits = base[:, :4093]                            # row stride 5000, odd vocab (a ragged tail)
    logits[2, 4000] = float("nan")
    logits[2, 4001] = float("nan")
    got = torch.ops.radixserve.argmax_rows(logits)
    assert torch.equal(got, logits.argmax(-1)) and got[2].item() == 4000


def test_dependent_launch_chain_is_race_free():
    """norm -> skinny -> gated skinny -> skinny, each reading the one before: launched back to
    back (the skinny kernels with programmatic dependent launch on sm_90+, so each may start
    before its producer ends) and inside a CUDA graph, the results equal a run with a device
    sync between every op, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(11)
    hidden, inter = 4096, 14336
    w_in = (torch.randn(6144, hidden, generator=g, device="cuda") / 64).bfloat16()
    w_gu = (torch.randn(2 * inter, 6144, generator=g, device="cuda") / 78).bfloat16()
    w_dn = (torch.randn(hidden, inter, generator=g, device="cuda") / 120).bfloat16()
    gamma = (torch.rand(hidden, generator=g, device="cuda") + 0.5).bfloat16()

    def chain(x0, sync):
        steps = [lambda t: ops.rms_norm(t, gamma, 1e-6), lambda t: ops.skinny_linear(t, w_in),
                 lambda t: ops.skinny_gated_linear(t, w_gu), lambda t: ops.skinny_linear(t, w_dn)]
        t = x0
        for _ in range(3):
            for f in steps:
                t = f(t)
                if sync:
                    torch.cuda.synchronize()
        return t

    x0 = torch.randn(1, hidden, generator=g, device="cuda").bfloat16()
    want = chain(x0, sync=True)
    assert torch.isfinite(want.float()).all() and want.float().abs().max() > 0
    for _ in range(20):
        assert torch.equal(chain(x0, sync=False), want)
    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    chain(static_x, sync=False)                       # warm-up allocations outside the capture
    with torch.cuda.graph(graph):
        out = chain(static_x, sync=False)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)


def test_dependent_launch_chain_with_fused_norms_is_race_free():
    """Two decoder blocks at batch 1 as the model runs them (norm fused into q|k|v, o, norm fused
    into gate|up + activation, down), the residual stream passed from kernel to kernel: back to
    back and under graph replay, equal to a run with a device sync after every op, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(12)
    hidden, inter = 4096, 14336
    w_qkv = (torch.randn(6144, hidden, generator=g, device="cuda") / 64).bfloat16()
    w_o = (torch.randn(hidden, 4096, generator=g, device="cuda") / 64).bfloat16()
    w_gu = (torch.randn(2 * inter, hidden, generator=g, device="cuda") / 64).bfloat16()
    w_dn = (torch.randn(hidden, inter, generator=g, device="cuda") / 120).bfloat16()
    g1 = (torch.rand(hidden, generator=g, device="cuda") + 0.5).bfloat16()
    g2 = (torch.rand(hidden, generator=g, device="cuda") + 0.5).bfloat16()

    def chain(h, sync):
        residual = None
        for _ in range(2):
            steps = [lambda h, r: ops.skinny_norm_linear(h, r, g1, 1e-5, w_qkv),
                     lambda h, r: (ops.skinny_linear(h[:, :4096], w_o), r),
                     lambda h, r: ops.skinny_norm_linear(h, r, g2, 1e-5, w_gu, gated=True),
                     lambda h, r: (ops.skinny_linear(h, w_dn), r)]
            for f in steps:
                h, residual = f(h, residual)
                if sync:
                    torch.cuda.synchronize()
        return h, residual

    x0 = torch.randn(1, hidden, generator=g, device="cuda").bfloat16()
    want_h, want_r = chain(x0, sync=True)
    assert torch.isfinite(want_h.float()).all() and want_h.float().abs().max() > 0
    for _ in range(20):
        h, r = chain(x0, sync=False)
        assert torch.equal(h, want_h) and torch.equal(r, want_r)
    static_x = x0.clone()
    graph = torch.cuda.CUDAGraph()
    chain(static_x, sync=False)                       # warm-up allocations outside the capture
    with torch.cuda.graph(graph):
        out_h, out_r = chain(static_x, sync=False)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_h, want_h) and torch.equal(out_r, want_r)
