"""A tensor-parallel group of N ranks inside this one process, its collectives, and the worker
threads that run one function on every rank at once.

Issue 37's design: one process, one scheduler, one batch, one loop; each step's forward is
launched on every rank from that process. A rank is a thread: rank 0 runs on the caller's
thread (the engine's forward worker), ranks 1..N-1 on their own persistent worker threads
(RankWorkers), so N launches are not serialised behind each other. The model shards call the
collectives through this module's functions (all_reduce, gather_last_dim), which find the
calling thread's (group, rank) binding that RankWorkers sets.

Backends:
  * "threads" (ThreadGroup): every rank on the CPU. A collective is a rendezvous: each rank
    publishes its tensor in a shared slot and waits at a barrier; then every rank sums the
    published tensors itself, in rank order, in fp32 (cast back to the input's dtype), so the
    result is deterministic and bit-identical on every rank. Two slot generations alternate, so
    one barrier per collective is enough (a rank cannot reach collective k + 2, which reuses
    collective k's slots, before every rank has arrived at collective k + 1, i.e. finished
    reading k's). Tensors are never written in place: a collective returns a new tensor.
  * "nccl" (NcclGroup): rank r on local GPU r, NCCL communicators for the N GPUs made in this
    process by ncclCommInitAll (parallel/nccl.py, ctypes on the libnccl torch ships); each
    rank's collectives enqueue on its own stream.

A rank that raises aborts the group's barrier, so the others stop waiting (BrokenBarrierError)
instead of hanging; RankWorkers.run then resets the group and re-raises the first real error.
A barrier wait that outlasts the group's timeout (default 300 s: ranks that disagree on the
number of collectives) breaks the barrier the same way.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import torch

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 300.0


class ThreadGroup:
    """N ranks of one process on the CPU, each a thread; collectives through shared slots and a
    barrier (see the module docstring)."""

    backend = "threads"

    def __init__(self, size: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        if size < 1:
            raise ValueError(f"a tensor-parallel group needs at least one rank, not {size}")
        self.size = size
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: Tuple[List[Optional[torch.Tensor]], ...] = ([None] * size, [None] * size)
        self._generation = [0] * size          # collectives each rank has entered

    def rank_context(self, rank: int):
        """Nothing to set for a CPU rank."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        return (f"in-process threads ({self.size} ranks; all-reduce: fp32 sum in rank order "
                f"over shared buffers, one barrier per collective)")

    # ------------------------------------------------------------------ collectives
    def _publish(self, rank: int, x: torch.Tensor) -> List[Optional[torch.Tensor]]:
        """Put x in this collective's slot of rank; wait for every rank; the slots."""
        gen = self._generation[rank]
        self._generation[rank] = gen + 1
        slots = self._slots[gen & 1]
        slots[rank] = x
        self._barrier.wait()
        return slots

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The sum of every rank's x (same shape), summed in rank order in fp32, in x's dtype:
        a new tensor, the same bits on every rank."""
        slots = self._publish(rank, x)
        acc = slots[0].to(device=x.device, dtype=torch.float32, copy=True)
        for part in slots[1:]:
            acc.add_(part.to(x.device))
        return acc if x.dtype == torch.float32 else acc.to(x.dtype)

    def gather_last_dim(self, x: torch.Tensor, rank: int, dst: int = 0) -> Optional[torch.Tensor]:
        """Every rank's x concatenated along the last dimension, in rank order, on rank dst (a
        new tensor on dst's device); None on the other ranks."""
        slots = self._publish(rank, x)
        if rank != dst:
            return None
        return torch.cat([part.to(x.device) for part in slots], dim=-1)

    # ------------------------------------------------------------------ failure handling
    def abort(self) -> None:
        """Break the barrier: every rank waiting in (or later entering) a collective raises
        threading.BrokenBarrierError until reset()."""
        self._barrier.abort()

    def reset(self) -> None:
        """Back to a fresh group (no rank may be inside a collective)."""
        self._barrier.reset()
        self._slots = ([None] * self.size, [None] * self.size)
        self._generation = [0] * self.size


class NcclGroup:
    """N ranks of one process on N distinct local GPUs: NCCL communicators made in-process
    (parallel/nccl.py: ncclCommInitAll), one per GPU; each rank's collectives enqueue on the
    calling thread's current stream of its GPU (captured when that stream is capturing a CUDA
    graph). Rank r >= 1 runs on its own stream (streams[r], made here); rank 0 on the caller's.
    Collectives return new tensors (never write x)."""

    backend = "nccl"

    def __init__(self, devices: Sequence[torch.device]):
        from radixserve.parallel.nccl import Nccl

        self.devices = [torch.device(d) for d in devices]
        self.size = len(self.devices)
        self.nccl = Nccl.get()
        self._indices = [d.index if d.index is not None else 0 for d in self.devices]
        self.comms = self.nccl.init_all(self._indices)
        self.streams: List[Optional[torch.cuda.Stream]] = [None] + [
            torch.cuda.Stream(device=d) for d in self.devices[1:]]
        self.broken = False
        # small all-reduces: a one-shot kernel over peer-mapped buffers (parallel/oneshot.py),
        # None (NCCL for every size) without P2P between every pair of GPUs or the extension
        from radixserve.parallel.oneshot import OneShotAllReduce

        self.oneshot, self._oneshot_off = OneShotAllReduce.maybe_create(self.devices)

    def describe(self) -> str:
        nvls = "off" if os.environ.get("NCCL_NVLS_ENABLE") == "0" else "on"
        small = (self.oneshot.describe() if self.oneshot is not None
                 else f"NCCL (one-shot off: {self._oneshot_off})")
        return (f"NCCL {self.nccl.version()} in-process ({self.size} GPUs {self._indices}, "
                f"ncclCommInitAll; NVLS {nvls}; small all-reduces: {small})")

    @contextlib.contextmanager
    def rank_context(self, rank: int) -> Iterator[None]:
        """The calling thread runs rank's work: its GPU current, its stream (rank 0: the
        caller's own) current."""
        with torch.cuda.device(self.devices[rank]):
            if rank == 0:
                yield
            else:
                with torch.cuda.stream(self.streams[rank]):
                    yield

    def _stream(self, x: torch.Tensor) -> int:
        return torch.cuda.current_stream(x.device).cuda_stream

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The sum of every rank's x (same shape and dtype): a new tensor on x's GPU."""
        if self.oneshot is not None and self.oneshot.eligible(x):
            return self.oneshot.all_reduce(x, rank)
        x = x.contiguous()
        out = torch.empty_like(x)
        self.nccl.all_reduce(x, out, self.comms[rank], self._stream(x))
        return out

    def broadcast(self, x: torch.Tensor, rank: int, root: int = 0) -> None:
        """Overwrite x (contiguous, the same shape and dtype on every rank) with root's x, in
        place: how the decode graphs under TP hand every rank rank 0's step inputs."""
        if not x.is_contiguous():
            raise ValueError("broadcast needs a contiguous tensor (it writes in place)")
        self.nccl.broadcast(x, root, self.comms[rank], self._stream(x))

    def gather_last_dim(self, x: torch.Tensor, rank: int, dst: int = 0) -> Optional[torch.Tensor]:
        """Every rank's x concatenated along the last dimension on rank dst (an all-gather:
        NCCL has no gather), None on the other ranks."""
        x = x.contiguous()
        buf = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        self.nccl.all_gather(x, buf, self.comms[rank], self._stream(x))
        if rank != dst:
            return None
        return torch.cat(list(buf.unbind(0)), dim=-1)

    def abort(self) -> None:
        """A rank failed: its peers may wait on the GPU for a collective it never enqueued.
        reset() must rebuild the communicators before the next step."""
        self.broken = True
        if self.oneshot is not None:
            self.oneshot.abort()                 # one-shot kernels waiting for it return

    def reset(self) -> None:
        """Fresh communicators (the old ones aborted: a half-run collective cannot complete)."""
        for comm in self.comms:
            try:
                self.nccl.abort(comm)
            except Exception:                    # noqa: BLE001 - rebuilding anyway
                pass
        self.comms = self.nccl.init_all(self._indices)
        if self.oneshot is not None:
            self.oneshot.reset()                 # its call counters and flags back to zero
        self.broken = False


def make_group(devices: Sequence[torch.device], timeout_s: float = DEFAULT_TIMEOUT_S):
    """The group for ranks on devices (one per rank): threads for CPU ranks (ThreadGroup), NCCL
    for distinct local GPUs (NcclGroup). Mixed kinds, or a GPU named twice, raise ValueError."""
    devices = [torch.device(d) for d in devices]
    kinds = {d.type for d in devices}
    if kinds == {"cpu"}:
        return ThreadGroup(len(devices), timeout_s)
    if kinds == {"cuda"}:
        indices = [d.index if d.index is not None else 0 for d in devices]
        if len(set(indices)) != len(indices):
            raise ValueError(f"tensor parallelism on CUDA needs one GPU per rank, distinct: "
                             f"{[str(d) for d in devices]}")
        return NcclGroup(devices)
    raise ValueError(f"tensor-parallel ranks must all be CPU or all CUDA: "
                     f"{[str(d) for d in devices]}")


# ----------------------------------------------------------------------------- the binding

_local = threading.local()


@contextlib.contextmanager
def bind(group: ThreadGroup, rank: int) -> Iterator[None]:
    """The calling thread is `rank` of `group` while the block runs (the collectives below use it)."""
    before = getattr(_local, "binding", None)
    _local.binding = (group, rank)
    try:
        yield
    finally:
        _local.binding = before


def current() -> Optional[Tuple[ThreadGroup, int]]:
    """(group, rank) of the calling thread, or None outside RankWorkers."""
    return getattr(_local, "binding", None)


def _bound(size: int) -> Tuple[ThreadGroup, int]:
    binding = current()
    if binding is None:
        raise RuntimeError(f"a tensor-parallel shard (tp_size {size}) ran a collective outside "
                           f"its rank's thread; run the shards through "
                           f"model/tensor_parallel.TensorParallelModel")
    if binding[0].size != size:
        raise RuntimeError(f"a shard of tp_size {size} ran in a group of {binding[0].size} ranks")
    return binding


def all_reduce(x: torch.Tensor, size: int) -> torch.Tensor:
    """Sum x over the calling thread's group (size ranks): see ThreadGroup.all_reduce."""
    group, rank = _bound(size)
    return group.all_reduce(x, rank)


def gather_last_dim(x: torch.Tensor, size: int, dst: int = 0) -> Optional[torch.Tensor]:
    """The ranks' x concatenated along the last dimension on rank dst, None elsewhere."""
    group, rank = _bound(size)
    return group.gather_last_dim(x, rank, dst)


# ----------------------------------------------------------------------------- the workers


class RankWorkers:
    """Runs fn(rank) on every rank at once: rank 0 on the calling thread, rank r >= 1 on its own
    persistent worker thread ("tp-rank-r"), each bound to the group and in inference mode."""

    def __init__(self, group: ThreadGroup, name: str = "tp-rank"):
        self.group = group
        self._pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{r}")
                       for r in range(1, group.size)]

    def _call(self, fn: Callable[[int], T], rank: int) -> T:
        with bind(self.group, rank), self.group.rank_context(rank), torch.inference_mode():
            try:
                return fn(rank)
            except BaseException:
                self.group.abort()            # the other ranks stop waiting for this one
                raise

    def run(self, fn: Callable[[int], T]) -> List[T]:
        """[fn(0), ..., fn(N - 1)], run concurrently. If any rank raises, every rank is waited
        for, the group is reset, and the first error that is not a broken barrier is raised."""
        futures = [pool.submit(self._call, fn, r) for r, pool in enumerate(self._pools, 1)]
        results: List[Optional[T]] = [None] * self.group.size
        errors: List[BaseException] = []
        try:
            results[0] = self._call(fn, 0)
        except BaseException as e:       # noqa: BLE001 - re-raised below
            errors.append(e)
        for r, future in enumerate(futures, 1):
            try:
                results[r] = future.result()
            except BaseException as e:   # noqa: BLE001 - re-raised below
                errors.append(e)
        if errors:
            self.group.reset()
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True)
        self._pools = []


def backends_summary(num_gpus: int) -> str:
    """One line for `radixserve env`: how --tp-size N > 1 runs here and its all-reduce path."""
    cpu = ("on the CPU: N rank threads of this process, all-reduce in-process (fp32 sum in rank "
           "order over shared buffers)")
    if not num_gpus:
        return f"--tp-size N > 1 {cpu}; no GPU"
    try:
        from radixserve.parallel.nccl import Nccl

        nccl = f"NCCL {Nccl.get().version()} ({Nccl.get().path})"
    except Exception as e:                      # noqa: BLE001 - a report line, not a failure
        nccl = f"NCCL unavailable: {e}"
    return (f"--tp-size N > 1 {cpu}; on CUDA: N of the {num_gpus} local GPU(s), one rank thread "
            f"each, communicators made in-process by ncclCommInitAll, {nccl}; decode as one CUDA "
            f"graph per GPU")
