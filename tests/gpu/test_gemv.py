"""skinny_linear (plain and gated) and argmax_rows kernels against the reference.

The skinny GEMM accumulates in fp32 in its own order, so it is compared with an fp64 product of
the same (rounded) inputs, within one rounding of the output dtype; the gated form must also
equal silu_and_mul of its own plain projections, since it rounds them as the unfused path does."""
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
