"""One-shot all-reduce for small messages over peer-mapped buffers of this one process (issue 37,
point 3): decode all-reduces are a few KB per layer, where NCCL's latency (its protocol setup,
several steps, each a cross-GPU round trip) dominates the bytes. Here every rank's kernel stages
its input in a buffer on its own GPU, signals every peer, waits for every peer's signal, then
reads all N staged inputs straight from the peers' memory (peer access: one process, so a device
pointer of GPU p is valid on GPU r once cudaDeviceEnablePeerAccess ran; no CUDA IPC) and sums
them: one round of flags, one read of N inputs. NCCL stays the path for everything else
(NcclGroup.all_reduce asks eligible()). NVLink multicast stays off (no NVLS, no multimem).

Kernel, its synchronisation and the memory-ordering argument:
csrc/include/radixserve/oneshot_allreduce.cuh; torch-facing ops: csrc/ops/oneshot_allreduce.cu.

Semantics (the same as ThreadGroup.all_reduce and reference_all_reduce below): the sum of every
rank's x, accumulated in fp32 in rank order (x0 + x1 + ... + x_{N-1}), rounded once to x's dtype;
a new tensor, bit-identical on every rank. bf16 / fp16 / fp32, up to max_bytes per call.

Rules for callers (all hold for NcclGroup's use, where every rank runs the same model code):
  * every rank calls all_reduce with the same numel and dtype, in the same order, each on its own
    stream (its kernel waits on the GPU for the peers' kernels of the same call);
  * whether a call is eligible() depends only on numel, dtype and the device type, so every
    rank takes the same path (one-shot or NCCL) for the same call;
  * CUDA graphs: a captured call replays with its fixed buffers; the call counter lives in
    device memory and each replay advances it, so eager calls and replays mix freely as long as
    every rank runs the same sequence;
  * after a rank failed mid-step (its peers may spin waiting for it), abort() releases the
    spinning kernels (NcclGroup.abort calls it, before NCCL's communicators are aborted: their
    cudaFree would wait for a spinning kernel), and reset() waits for the GPUs and clears every
    signal area (NcclGroup.reset, after the new communicators).
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_MAX_BYTES = 512 * 1024
DEFAULT_BLOCKS = 16          # CTAs per rank and call (csrc: 1..kMaxBlocks = 32)
MAX_RANKS = 8                # csrc: kMaxRanks
SIGNAL_ALIGN = 128           # csrc: alignof(Signal)


def reference_all_reduce(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The one-shot all-reduce's result, in plain torch: the ranks' tensors (same shape and
    dtype, any devices) summed in fp32 in rank order, rounded once to their dtype, on xs[0]'s
    device. What every rank's output equals, bit for bit."""
    if not xs:
        raise ValueError("reference_all_reduce needs at least one rank's tensor")
    first = xs[0]
    for r, x in enumerate(xs[1:], 1):
        if x.shape != first.shape or x.dtype != first.dtype:
            raise ValueError(f"rank {r}'s tensor is {tuple(x.shape)} {x.dtype}, rank 0's "
                             f"{tuple(first.shape)} {first.dtype}")
    acc = first.to(dtype=torch.float32, copy=True)
    for x in xs[1:]:
        acc += x.to(device=first.device, dtype=torch.float32)
    return acc if first.dtype == torch.float32 else acc.to(first.dtype)


def is_eligible(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether the one-shot path takes x: a CUDA tensor of a supported dtype whose bytes fit
    max_bytes. Nothing rank-specific (alignment, strides) enters: all_reduce copies a tensor the
    kernel cannot read as is, so every rank decides the same for the same call."""
    return (x.is_cuda and x.dtype in SUPPORTED_DTYPES
            and x.numel() * x.element_size() <= max_bytes)


def peer_capable(indices: Sequence[int],
                 can_access: Optional[Callable[[int, int], bool]] = None) -> Tuple[bool, str]:
    """(True, "") when every ordered pair of distinct GPUs in indices can access each other's
    memory (torch.cuda.can_device_access_peer), else (False, the first pair that cannot). A GPU
    named twice (ranks emulated on one GPU) needs nothing."""
    can_access = can_access or torch.cuda.can_device_access_peer
    if not 2 <= len(indices) <= MAX_RANKS:
        return False, f"{len(indices)} ranks (the one-shot kernel takes 2..{MAX_RANKS})"
    for a in indices:
        for b in indices:
            if a != b and not can_access(a, b):
                return False, f"GPU {a} cannot access GPU {b}'s memory (no P2P)"
    return True, ""


def _kernels_available() -> bool:
    try:
        from radixserve.ops._ext import kernels_available
    except Exception:                           # noqa: BLE001 - no extension, no one-shot
        return False
    return kernels_available()


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class OneShotAllReduce:
    """The one-shot all-reduce of one group of ranks: for each rank a staging buffer of
    2 * max_bytes (two halves, alternated by call parity) and a signal area on its GPU, registered
    with the extension (which enables peer access between every pair of the GPUs)."""

    def __init__(self, devices: Sequence[torch.device], max_bytes: int = DEFAULT_MAX_BYTES,
                 blocks: int = DEFAULT_BLOCKS):
        self.devices = [torch.device(d) for d in devices]
        if any(d.type != "cuda" for d in self.devices):
            raise ValueError(f"the one-shot all-reduce runs on CUDA ranks, not "
                             f"{[str(d) for d in self.devices]}")
        if max_bytes <= 0 or max_bytes % 16:
            raise ValueError(f"max_bytes must be a positive multiple of 16, not {max_bytes}")
        self.size = len(self.devices)
        self.max_bytes = int(max_bytes)
        self.blocks = int(blocks)
        self._indices = [d.index if d.index is not None else 0 for d in self.devices]
        ok, why = peer_capable(self._indices)
        if not ok:
            raise RuntimeError(f"one-shot all-reduce unavailable: {why}")
        ops = torch.ops.radixserve
        signal_bytes = int(ops.oneshot_signal_bytes())
        self.buffers: List[torch.Tensor] = []
        self.signals: List[torch.Tensor] = []
        for idx in self._indices:
            dev = torch.device("cuda", idx)
            self.buffers.append(torch.zeros(2 * self.max_bytes, dtype=torch.uint8, device=dev))
            # torch's allocator hands out 512-byte aligned blocks: SIGNAL_ALIGN holds
            sig = torch.zeros(signal_bytes, dtype=torch.uint8, device=dev)
            if sig.data_ptr() % SIGNAL_ALIGN:
                raise RuntimeError("signal area allocation is not 128-byte aligned")
            self.signals.append(sig)
        for idx in sorted(set(self._indices)):
            torch.cuda.synchronize(idx)         # zeros in place before any kernel reads them
        self.handle = int(ops.oneshot_register(self.buffers, self.signals, self.blocks))

    @classmethod
    def maybe_create(cls, devices: Sequence[torch.device], **kwargs
                     ) -> Tuple[Optional["OneShotAllReduce"], str]:
        """(the one-shot all-reduce for devices, "") when it can run there (the extension built,
        2..8 CUDA ranks, P2P between every pair), else (None, why not)."""
        devices = [torch.device(d) for d in devices]
        if any(d.type != "cuda" for d in devices):
            return None, "CPU ranks"
        if not _kernels_available():
            return None, "the radixserve._C extension is not available"
        indices = [d.index if d.index is not None else 0 for d in devices]
        ok, why = peer_capable(indices)
        if not ok:
            return None, why
        try:
            return cls(devices, **kwargs), ""
        except Exception as e:                  # noqa: BLE001 - NCCL remains the path
            return None, f"setup failed: {e}"

    def describe(self) -> str:
        return (f"one-shot P2P kernel for <= {self.max_bytes // 1024} KB bf16/fp16/fp32 "
                f"({self.blocks} CTAs per rank, fp32 sum in rank order), NCCL above")

    def eligible(self, x: torch.Tensor) -> bool:
        """Whether all_reduce takes x (see is_eligible); the caller uses NCCL otherwise."""
        return is_eligible(x, self.max_bytes)

    def all_reduce(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """rank's share of the all-reduce of every rank's x: a new tensor on x's device (never x
        itself), enqueued on the current stream. Every rank must make the same call."""
        if not (x.is_contiguous() and _aligned(x)):
            x = x.clone(memory_format=torch.contiguous_format)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        torch.ops.radixserve.oneshot_all_reduce(self.handle, rank, x, out)
        return out

    def abort(self) -> None:
        """A rank failed: set every rank's abort word, so that kernels spinning for a peer's call
        that will never come (and any launched later) return at once, their outputs garbage.
        Enqueued on a side stream of each GPU, so it does not wait behind those kernels; no host
        synchronisation. reset() must follow before the next step."""
        for sig, idx in zip(self.signals, self._indices):
            side = torch.cuda.Stream(device=idx)
            with torch.cuda.device(idx), torch.cuda.stream(side):
                sig[:4].fill_(1)                # word 0: the abort word (any nonzero value)

    def reset(self) -> None:
        """Back to the initial state after a failed step: abort(), wait for every GPU (any NCCL
        kernel stuck on the failed rank must have been aborted first), then zero every signal
        area (call counters, flags, abort words). No rank may be launching a call meanwhile."""
        self.abort()
        devices = sorted(set(self._indices))
        for idx in devices:
            torch.cuda.synchronize(idx)
        for sig, idx in zip(self.signals, self._indices):
            with torch.cuda.device(idx):
                sig.zero_()
        for idx in devices:
            torch.cuda.synchronize(idx)
