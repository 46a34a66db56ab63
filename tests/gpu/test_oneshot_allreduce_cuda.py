"""The one-shot all-reduce kernel (issue 37, point 3; parallel/oneshot.py,
csrc/include/radixserve/oneshot_allreduce.cuh) on ONE GPU, N = 2 and 4 ranks emulated: every
rank's buffers on the same device (peer access to itself needs nothing), each rank's kernel on
its own CUDA stream, all N in flight at once (small grids, so they are resident together and can
wait on each other).

  * eager calls: every rank's output equals the fp32 rank-order sum (reference_all_reduce) bit for
    bit, for several calls in a row (the call counter and buffer parity), odd sizes (a tail below
    one 16-byte vector, 4096 + 8 elements, 8192 * 3, exactly max_bytes), bf16 / fp16 / fp32, sizes
    changing from call to call, non-contiguous and misaligned inputs;
  * CUDA graphs: each rank's calls captured in its own graph (on its own stream), replayed several
    times with new inputs, and eager calls between replays;
  * abort / reset: a call that one rank never makes leaves the others spinning; abort() releases
    them, reset() brings the group back, and the next calls are right again;
  * argument checks of the op;
  * on 2+ GPUs: NcclGroup takes the one-shot path for small all-reduces and NCCL for large ones.

Every wait for the GPU goes through _wait: a hang (a synchronisation bug) aborts the kernels and
fails the test instead of hanging the suite.
"""
from __future__ import annotations

import time

import pytest
import torch

from _gpu import requires_kernels
from radixserve.parallel.oneshot import OneShotAllReduce, reference_all_reduce

pytestmark = [pytest.mark.gpu, requires_kernels]

MAX_BYTES = 512 * 1024
HANG_S = 20.0


def _make(n, max_bytes=MAX_BYTES, blocks=16):
    ar = OneShotAllReduce([torch.device("cuda", 0)] * n, max_bytes=max_bytes, blocks=blocks)
    streams = [torch.cuda.Stream() for _ in range(n)]
    return ar, streams


def _wait(ar, streams):
    """The caller's stream waits for every rank's stream; then the host waits for it, at most
    HANG_S seconds (then: abort, reset, fail)."""
    cur = torch.cuda.current_stream()
    for s in streams:
        cur.wait_stream(s)
    done = torch.cuda.Event()
    done.record(cur)
    deadline = time.monotonic() + HANG_S
    while not done.query():
        if time.monotonic() > deadline:
            ar.reset()
            pytest.fail(f"the one-shot all-reduce did not finish within {HANG_S} s (hang)")
        time.sleep(0.001)


def _call(ar, streams, xs, ranks=None):
    """Every rank's all_reduce of its x, each on its stream; outputs in rank order."""
    cur = torch.cuda.current_stream()
    outs = [None] * len(xs)
    for r in (range(len(xs)) if ranks is None else ranks):
        streams[r].wait_stream(cur)
        with torch.cuda.stream(streams[r]):
            outs[r] = ar.all_reduce(xs[r], r)
    return outs


def _inputs(n, numel, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(numel, generator=gen, device="cuda") * 4).to(dtype) for _ in range(n)]


def _check(outs, xs):
    expect = reference_all_reduce(xs)
    for r, out in enumerate(outs):
        assert out.dtype == xs[r].dtype and out.shape == xs[r].shape
        assert torch.equal(out, expect), f"rank {r}: {(out.float() - expect.float()).abs().max()}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel_of", [lambda es: 4096 + 8, lambda es: 8192 * 3, lambda es: 3,
                                      lambda es: 1000 + 5, lambda es: MAX_BYTES // es],
                         ids=["4104", "24576", "3", "1005", "max"])
def test_eager_calls_in_a_row_equal_the_rank_order_sum(n, dtype, numel_of):
    ar, streams = _make(n)
    numel = numel_of(torch.empty(0, dtype=dtype).element_size())
    for call in range(5):                       # both buffer halves, several times each
        xs = _inputs(n, numel, dtype, seed=100 * n + call)
        outs = _call(ar, streams, xs)
        _wait(ar, streams)
        _check(outs, xs)


@pytest.mark.parametrize("n", [2, 4])
def test_sizes_and_dtypes_change_between_calls(n):
    ar, streams = _make(n)
    plan = [(4096 + 8, torch.bfloat16), (17, torch.float32), (8192 * 3, torch.float16),
            (0, torch.bfloat16), (MAX_BYTES // 4, torch.float32), (1, torch.bfloat16),
            (4096, torch.bfloat16), (8192 * 3, torch.float32)] * 2
    pending = []
    for call, (numel, dtype) in enumerate(plan):   # enqueued back to back, checked at the end
        xs = _inputs(n, numel, dtype, seed=call)
        pending.append((_call(ar, streams, xs), xs))
    _wait(ar, streams)
    for outs, xs in pending:
        _check(outs, xs)


def test_shapes_views_and_misaligned_inputs():
    n = 2
    ar, streams = _make(n)
    base = _inputs(n, 64 * 130 + 1, torch.bfloat16, seed=5)
    cases = [
        [b[: 64 * 130].view(64, 130) for b in base],          # 2-D, contiguous
        [b[: 64 * 130].view(130, 64).t() for b in base],      # transposed: copied
        [b[1: 1 + 4096] for b in base],                       # 2 bytes off 16-byte alignment
    ]
    for xs in cases:
        outs = _call(ar, streams, xs)
        _wait(ar, streams)
        expect = reference_all_reduce([x.contiguous() for x in xs])
        for out, x in zip(outs, xs):
            assert out.shape == x.shape and out.is_contiguous()
            assert torch.equal(out, expect)
    # the inputs are never written
    again = _inputs(n, 64 * 130 + 1, torch.bfloat16, seed=5)
    for b, a in zip(base, again):
        assert torch.equal(b, a)


def test_rounded_once_from_fp32():
    """Rounded once from fp32: with large and small parts, the result keeps the small ones."""
    n = 4
    ar, streams = _make(n)
    big = torch.full((4096,), 256.0, device="cuda", dtype=torch.bfloat16)
    one = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    xs = [big, one, one, torch.zeros_like(one)]              # 256 + 1 + 1 + 0 = 258
    outs = _call(ar, streams, xs)
    _wait(ar, streams)
    for out in outs:
        assert torch.all(out == 258.0)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graphs_one_per_rank_replayed_with_new_inputs(n, dtype):
    ar, streams = _make(n)
    numel = 4096 + 8
    static = _inputs(n, numel, dtype, seed=1)
    outs = _call(ar, streams, static)                         # warm up, eagerly
    _wait(ar, streams)
    _check(outs, static)

    graphs = [torch.cuda.CUDAGraph() for _ in range(n)]
    captured = [None] * n
    torch.cuda.synchronize()
    for r in range(n):                          # capture runs nothing: one rank at a time is fine
        with torch.cuda.stream(streams[r]):
            with torch.cuda.graph(graphs[r], stream=streams[r]):
                mid = ar.all_reduce(static[r], r)
                captured[r] = ar.all_reduce(mid * 0.5, r)        # two calls per replay

    cur = torch.cuda.current_stream()
    for replay in range(6):
        fresh = _inputs(n, numel, dtype, seed=10 + replay)
        for s, f in zip(static, fresh):
            s.copy_(f)
        for r in range(n):
            streams[r].wait_stream(cur)
            with torch.cuda.stream(streams[r]):
                graphs[r].replay()
        _wait(ar, streams)
        first = reference_all_reduce(fresh)
        expect = reference_all_reduce([first * 0.5] * n)
        for r in range(n):
            assert torch.equal(captured[r], expect), f"replay {replay}, rank {r}"
        if replay % 2:                          # eager calls between replays keep the epochs in step
            xs = _inputs(n, 8192 * 3, dtype, seed=50 + replay)
            eager = _call(ar, streams, xs)
            _wait(ar, streams)
            _check(eager, xs)


def test_abort_releases_waiting_ranks_and_reset_restores():
    n = 4
    ar, streams = _make(n)
    xs = _inputs(n, 4096, torch.bfloat16, seed=3)
    outs = _call(ar, streams, xs)
    _wait(ar, streams)
    _check(outs, xs)

    _call(ar, streams, xs, ranks=range(n - 1))   # the last rank never makes this call
    time.sleep(0.2)
    stuck = torch.cuda.Event()
    stuck.record(streams[0])
    assert not stuck.query(), "rank 0 finished a call its peer never made"
    ar.abort()                                   # what NcclGroup.abort does for a failed rank
    deadline = time.monotonic() + HANG_S
    while not stuck.query():
        assert time.monotonic() < deadline, "abort() did not release the waiting kernels"
        time.sleep(0.001)
    ar.reset()

    for call in range(3):
        xs = _inputs(n, 4096 + 8, torch.bfloat16, seed=20 + call)
        outs = _call(ar, streams, xs)
        _wait(ar, streams)
        _check(outs, xs)


def test_argument_checks():
    ar, _ = _make(2, max_bytes=4096)
    ops = torch.ops.radixserve
    x = torch.zeros(2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    big = torch.zeros(2049, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="exceed the registered capacity"):
        ops.oneshot_all_reduce(ar.handle, 0, big, torch.empty_like(big))
    with pytest.raises(RuntimeError, match="rank 2"):
        ops.oneshot_all_reduce(ar.handle, 2, x, out)
    with pytest.raises(RuntimeError, match="bf16, fp16 or fp32"):
        ops.oneshot_all_reduce(ar.handle, 0, x.int(), out.int())
    with pytest.raises(RuntimeError, match="output dtype"):
        ops.oneshot_all_reduce(ar.handle, 0, x, out.float())
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        ops.oneshot_all_reduce(ar.handle, 0, x[1:1025], out[:1024])
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.oneshot_all_reduce(ar.handle, 0, x.view(32, 64).t(), out.view(64, 32))
    with pytest.raises(RuntimeError, match="unknown handle"):
        ops.oneshot_all_reduce(10**6, 0, x, out)
    buf = [torch.zeros(64, dtype=torch.uint8, device="cuda")] * 2
    sig = [torch.zeros(int(ops.oneshot_signal_bytes()), dtype=torch.uint8, device="cuda")] * 2
    with pytest.raises(RuntimeError, match="2..8 ranks"):
        ops.oneshot_register(buf[:1], sig[:1], 16)
    with pytest.raises(RuntimeError, match="blocks must be"):
        ops.oneshot_register(buf, sig, 33)
    with pytest.raises(RuntimeError, match="oneshot_signal_bytes"):
        ops.oneshot_register(buf, [s[:16] for s in sig], 16)
    assert ar.eligible(x) and not ar.eligible(big) and not ar.eligible(x.cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_group_takes_oneshot_for_small_and_nccl_for_large():
    from radixserve.parallel import group as tp_group

    n = 2
    group = tp_group.make_group([torch.device("cuda", r) for r in range(n)])
    if not all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n)
               if a != b):
        assert group.oneshot is None and "one-shot off" in group.describe()
        pytest.skip("no P2P between GPUs 0 and 1")
    assert group.oneshot is not None and "one-shot" in group.describe()
    workers = tp_group.RankWorkers(group)
    try:
        for numel in (4096, 4096 + 8, 8192 * 3, 2 * MAX_BYTES):       # the last: NCCL
            xs = [(torch.randn(numel, device=f"cuda:{r}") * 3).to(torch.bfloat16)
                  for r in range(n)]
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)

            def step(r):
                out = tp_group.all_reduce(xs[r], n)
                torch.cuda.current_stream().synchronize()
                return out

            outs = workers.run(step)
            expect = reference_all_reduce(xs)
            for out in outs:
                if group.oneshot.eligible(xs[0]):
                    assert torch.equal(out.to("cuda:0"), expect)
                else:                                   # NCCL's own order and rounding
                    torch.testing.assert_close(out.to("cuda:0"), expect, atol=0.1, rtol=0.02)
    finally:
        workers.close()
