"""Small all-reduces: NCCL (parallel/nccl.py, communicators made in this process) against the
one-shot P2P kernel (parallel/oneshot.py), issue 37 point 3, on the local GPUs of one host.

Every rank is a thread of this process on its own GPU and stream (parallel/group.RankWorkers, as
the tensor-parallel model runs); each rank captures `--calls` back-to-back all-reduces of one size
in a CUDA graph (a decode step's collectives are captured the same way), then all ranks replay
their graphs `--reps` times at once. Reported: microseconds per all-reduce (graph time / calls,
median over reps, the slowest rank), per size and path; the one-shot kernel for each --blocks
value. Before timing, each size's one-shot result is checked against the fp32 rank-order sum and
NCCL's against it loosely (NCCL sums in its own order).

  PYTHONPATH=pysrc python3 bench/allreduce_bench.py                 # every GPU, 4 KB .. 1 MB
  PYTHONPATH=pysrc python3 bench/allreduce_bench.py --gpus 2 --blocks 8,16,32 --dtype fp32
  PYTHONPATH=pysrc python3 bench/allreduce_bench.py --emulate 4     # one GPU, 4 ranks on 4
      streams: checks the kernel runs and replays; its timings say nothing about P2P

NVLink multicast stays off (nccl.py sets NCCL_NVLS_ENABLE=0 unless the environment sets it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "pysrc"))

from radixserve.parallel.oneshot import OneShotAllReduce, reference_all_reduce  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SIZES = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10,
                 512 << 10, 1 << 20]


def _kb(nbytes: int) -> str:
    return f"{nbytes >> 10} KB" if nbytes < (1 << 20) else f"{nbytes >> 20} MB"


# ----------------------------------------------------------------------------- multi-GPU


_CAPTURE_LOCK = threading.Lock()


def _bench_rank(rank, fn, x, calls, reps, barrier, times):
    """On rank's thread (its device and stream current): capture `calls` chained fn calls in a
    graph, then replay it reps times, each between two events; times[rank] = per-call us.
    Captures run one rank at a time (torch.cuda.graph synchronises and empties the allocator's
    cache on entry, which must not meet another rank's capture); they execute nothing, so no
    rank waits for another inside one."""
    for _ in range(3):                                  # eager warm-up (NCCL connects lazily)
        fn(x)
    stream = torch.cuda.current_stream()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    capture_stream = torch.cuda.Stream()
    with _CAPTURE_LOCK:
        capture_stream.wait_stream(stream)
        with torch.cuda.graph(graph, stream=capture_stream):
            y = x
            for _ in range(calls):
                y = fn(y)                               # each input the previous output
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    barrier.wait()
    graph.replay()                                      # one untimed replay
    stream.synchronize()
    barrier.wait()
    for a, b in events:
        a.record(stream)
        graph.replay()
        b.record(stream)
    stream.synchronize()
    times[rank] = statistics.median(a.elapsed_time(b) for a, b in events) * 1e3 / calls
    barrier.wait()                                      # no rank frees its graph while one runs
    del graph


def run_multi_gpu(args) -> list:
    from radixserve.parallel import group as tp_group

    n = args.gpus or torch.cuda.device_count()
    devices = [torch.device("cuda", r) for r in range(n)]
    group = tp_group.make_group(devices)
    print(group.describe())
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    sizes = args.sizes
    oneshots = {}
    for blocks in args.blocks:
        made, why = OneShotAllReduce.maybe_create(devices, max_bytes=max(sizes), blocks=blocks)
        if made is None:
            print(f"one-shot unavailable ({why}): NCCL only")
            break
        oneshots[blocks] = made
    workers = tp_group.RankWorkers(group)
    rows = []
    try:
        for nbytes in sizes:
            numel = nbytes // es
            xs = [(torch.randn(numel, device=d) * 0.01).to(dtype) for d in devices]
            for d in devices:
                torch.cuda.synchronize(d)
            expect = reference_all_reduce(xs)
            row = {"bytes": nbytes, "ranks": n, "dtype": args.dtype}

            def nccl(x):
                r = tp_group.current()[1]
                out = torch.empty_like(x)
                group.nccl.all_reduce(x, out, group.comms[r], torch.cuda.current_stream().cuda_stream)
                return out

            paths = [("nccl", nccl)]
            for blocks, ar in oneshots.items():
                def oneshot(x, ar=ar):
                    return ar.all_reduce(x, tp_group.current()[1])
                paths.append((f"oneshot_b{blocks}", oneshot))
            for name, fn in paths:
                # correctness, eagerly
                outs = workers.run(lambda r: fn(xs[r]))
                for d in devices:
                    torch.cuda.synchronize(d)
                for out in outs:
                    if name == "nccl":
                        torch.testing.assert_close(out.to(expect.device), expect, atol=1e-2,
                                                   rtol=2e-2)
                    elif not torch.equal(out.to(expect.device), expect):
                        raise AssertionError(f"{name} at {_kb(nbytes)}: not the rank-order sum")
                times = [0.0] * n
                barrier = threading.Barrier(n, timeout=300)
                workers.run(lambda r: _bench_rank(r, fn, xs[r], args.calls, args.reps, barrier,
                                                  times))
                row[name] = max(times)
            rows.append(row)
            _print_row(row, oneshots)
    finally:
        workers.close()
    return rows


def _print_row(row, oneshots):
    parts = [f"{_kb(row['bytes']):>7}", f"nccl {row['nccl']:8.2f} us"]
    for blocks in oneshots:
        key = f"oneshot_b{blocks}"
        if key in row:
            parts.append(f"one-shot/{blocks} CTAs {row[key]:8.2f} us "
                         f"(x{row['nccl'] / row[key]:.2f})")
    print("  ".join(parts), flush=True)


# ----------------------------------------------------------------------------- one GPU


def run_emulated(args) -> list:
    """N ranks on GPU 0, one stream each, every rank's graph replayed on its stream."""
    n = args.emulate
    dtype = DTYPES[args.dtype]
    es = torch.empty(0, dtype=dtype).element_size()
    rows = []
    streams = [torch.cuda.Stream() for _ in range(n)]
    cur = torch.cuda.current_stream()
    for blocks in args.blocks:
        ar = OneShotAllReduce([torch.device("cuda", 0)] * n, max_bytes=max(args.sizes),
                              blocks=blocks)
        for nbytes in args.sizes:
            numel = nbytes // es
            xs = [(torch.randn(numel, device="cuda") * 0.01).to(dtype) for _ in range(n)]
            outs = [None] * n
            for r in range(n):
                streams[r].wait_stream(cur)
                with torch.cuda.stream(streams[r]):
                    outs[r] = ar.all_reduce(xs[r], r)
            torch.cuda.synchronize()
            expect = reference_all_reduce(xs)
            assert all(torch.equal(o, expect) for o in outs), f"{_kb(nbytes)}: wrong sum"
            graphs = [torch.cuda.CUDAGraph() for _ in range(n)]
            for r in range(n):
                with torch.cuda.graph(graphs[r], stream=streams[r]):
                    for _ in range(args.calls):
                        ar.all_reduce(xs[r], r)
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
            samples = []
            for _ in range(args.reps):
                for r in range(n):
                    with torch.cuda.stream(streams[r]):
                        starts[r].record()
                        graphs[r].replay()
                        ends[r].record()
                torch.cuda.synchronize()
                samples.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)))
            us = statistics.median(samples) * 1e3 / args.calls
            rows.append({"bytes": nbytes, "ranks": n, "dtype": args.dtype, "emulated": True,
                         f"oneshot_b{blocks}": us})
            print(f"{_kb(nbytes):>7}  one-shot/{blocks} CTAs, {n} ranks on one GPU: "
                  f"{us:8.2f} us", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(str(s) for s in DEFAULT_SIZES),
                   help="message sizes in bytes, comma-separated")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--calls", type=int, default=32, help="all-reduces per CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="timed replays per size and path")
    p.add_argument("--blocks", default="16", help="one-shot CTAs per rank, comma-separated")
    p.add_argument("--gpus", type=int, default=0, help="ranks (GPUs 0..N-1); 0: every GPU")
    p.add_argument("--emulate", type=int, default=0,
                   help="N ranks on one GPU (kernel check only; timings are not P2P's)")
    p.add_argument("--json", default="", help="write the rows to this file")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.blocks = [int(b) for b in args.blocks.split(",")]
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    print(f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
          f"{args.dtype}, {args.calls} all-reduces per graph")
    if args.emulate:
        rows = run_emulated(args)
    elif (args.gpus or torch.cuda.device_count()) >= 2:
        rows = run_multi_gpu(args)
    else:
        sys.exit("needs 2+ GPUs (or --emulate N on one)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
