"""The one-shot all-reduce's CPU-checkable parts (issue 37, point 3; parallel/oneshot.py): the
reference's semantics (fp32 sum in rank order, rounded once, the same as ThreadGroup's), the
eligible() rules that pick it over NCCL, the P2P capability check, and that without the extension
or GPUs no OneShotAllReduce is made (NcclGroup then keeps NCCL for every size). The kernel itself:
tests/gpu/test_oneshot_allreduce_cuda.py."""
import threading

import pytest
import torch

from radixserve.parallel import group as tp_group
from radixserve.parallel import oneshot


def _parts(n, numel, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=gen) * 10).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_reference_is_fp32_rank_order_sum_rounded_once(dtype, n):
    xs = _parts(n, 4096 + 8, dtype, seed=n)
    out = oneshot.reference_all_reduce(xs)
    assert out.dtype == dtype and out.shape == xs[0].shape
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    assert torch.equal(out, acc.to(dtype))
    for x in xs:                                  # inputs untouched, output a new tensor
        assert out.data_ptr() != x.data_ptr()


def test_reference_order_matters_and_is_rank_order():
    """fp32 addition is not associative: the reference sums x0 + x1 + x2 in that order."""
    a = torch.tensor([1e8], dtype=torch.float32)
    b = torch.tensor([-1e8], dtype=torch.float32)
    c = torch.tensor([1.0], dtype=torch.float32)
    assert oneshot.reference_all_reduce([a, b, c]).item() == 1.0     # (1e8 - 1e8) + 1
    assert oneshot.reference_all_reduce([a, c, b]).item() == 0.0     # (1e8 + 1) - 1e8


def test_reference_rounds_once_not_per_step():
    """bf16: summing in bf16 step by step loses the small parts; the reference does not."""
    big = torch.tensor([256.0], dtype=torch.bfloat16)
    small = torch.tensor([1.0], dtype=torch.bfloat16)      # 256 + 1 is not a bf16 (spacing 2)
    out = oneshot.reference_all_reduce([big, small, small])
    assert out.item() == 258.0
    assert (big + small + small).item() == 256.0            # per-step rounding: ties to even


def test_reference_equals_thread_group_all_reduce():
    """The one-shot path keeps ThreadGroup's semantics bit for bit."""
    n = 4
    xs = _parts(n, 8192 * 3, torch.bfloat16, seed=7)
    group = tp_group.ThreadGroup(n)
    outs = [None] * n

    def run(r):
        outs[r] = group.all_reduce(xs[r], r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expect = oneshot.reference_all_reduce(xs)
    for out in outs:
        assert torch.equal(out, expect)


def test_reference_rejects_mismatched_parts():
    with pytest.raises(ValueError, match="rank 1"):
        oneshot.reference_all_reduce([torch.zeros(4), torch.zeros(5)])
    with pytest.raises(ValueError, match="rank 1"):
        oneshot.reference_all_reduce([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)])
    with pytest.raises(ValueError):
        oneshot.reference_all_reduce([])


class _FakeCuda:
    """A tensor stand-in: is_cuda, dtype, numel, element_size are all eligible() reads."""

    def __init__(self, numel, dtype, is_cuda=True):
        self.is_cuda = is_cuda
        self.dtype = dtype
        self._numel = numel
        self._es = torch.empty(0, dtype=dtype).element_size()

    def numel(self):
        return self._numel

    def element_size(self):
        return self._es


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eligible_by_bytes(dtype):
    max_bytes = 512 * 1024
    es = torch.empty(0, dtype=dtype).element_size()
    assert oneshot.is_eligible(_FakeCuda(max_bytes // es, dtype), max_bytes)
    assert not oneshot.is_eligible(_FakeCuda(max_bytes // es + 1, dtype), max_bytes)
    assert oneshot.is_eligible(_FakeCuda(4096 + 8, dtype), max_bytes)     # odd sizes are fine
    assert oneshot.is_eligible(_FakeCuda(3, dtype), max_bytes)            # below one vector
    assert oneshot.is_eligible(_FakeCuda(0, dtype), max_bytes)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.int8,
                                   torch.uint8])
def test_eligible_rejects_other_dtypes(dtype):
    assert not oneshot.is_eligible(_FakeCuda(16, dtype), 512 * 1024)


def test_eligible_rejects_cpu_tensors():
    assert not oneshot.is_eligible(torch.zeros(16, dtype=torch.bfloat16), 512 * 1024)
    assert not oneshot.is_eligible(_FakeCuda(16, torch.bfloat16, is_cuda=False), 512 * 1024)


def test_eligible_ignores_layout():
    """Strides and alignment are rank-local (all_reduce copies such a tensor): eligibility
    depends on numel, dtype and device type only, so every rank takes the same path."""
    x = torch.zeros(64, 64, dtype=torch.bfloat16)
    assert oneshot.is_eligible(x.t(), 10**6) == oneshot.is_eligible(x, 10**6)
    assert oneshot.is_eligible(x[1:], 10**6) == oneshot.is_eligible(x[:-1], 10**6)


def test_peer_capable():
    def can(a, b):
        return {(0, 1): True, (1, 0): True, (0, 2): True, (2, 0): True,
                (1, 2): True, (2, 1): False}.get((a, b), False)

    assert oneshot.peer_capable([0, 1], can) == (True, "")
    ok, why = oneshot.peer_capable([0, 1, 2], can)
    assert not ok and "GPU 2 cannot access GPU 1" in why
    assert oneshot.peer_capable([3, 3], lambda a, b: False) == (True, "")   # one GPU, emulated
    ok, why = oneshot.peer_capable([0], can)
    assert not ok and "1 ranks" in why
    ok, why = oneshot.peer_capable(list(range(9)), lambda a, b: True)
    assert not ok and "9 ranks" in why


def test_no_oneshot_for_cpu_ranks():
    made, why = oneshot.OneShotAllReduce.maybe_create([torch.device("cpu")] * 2)
    assert made is None and "CPU" in why
    with pytest.raises(ValueError):
        oneshot.OneShotAllReduce([torch.device("cpu")] * 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_no_oneshot_without_gpu_or_extension():
    made, why = oneshot.OneShotAllReduce.maybe_create([torch.device("cuda", 0),
                                                       torch.device("cuda", 1)])
    assert made is None and why


def test_constants_match_the_kernel_header():
    """MAX_RANKS / DEFAULT_BLOCKS / SIGNAL_ALIGN agree with csrc's kMaxRanks / kMaxBlocks /
    alignas(Signal) (read from the header: no extension needed)."""
    import os
    import re

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "csrc", "include", "radixserve", "oneshot_allreduce.cuh")).read()
    assert int(re.search(r"kMaxRanks = (\d+);", text).group(1)) == oneshot.MAX_RANKS
    assert 1 <= oneshot.DEFAULT_BLOCKS <= int(re.search(r"kMaxBlocks = (\d+);", text).group(1))
    assert int(re.search(r"struct alignas\((\d+)\) Signal", text).group(1)) == oneshot.SIGNAL_ALIGN
    assert oneshot.DEFAULT_MAX_BYTES % 16 == 0
