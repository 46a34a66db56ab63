"""NCCL for the local GPUs of this one process, through ctypes on the libnccl that ships with
torch (the nvidia-nccl wheel, or torch/lib): no second process, no torch.distributed, no
rendezvous. Issue 37 point 2.

    comms = Nccl().init_all([0, 1])          # ncclCommInitAll: one communicator per GPU
    lib.all_reduce(x, out, comms[r], stream)  # on rank r's thread, x and out on GPU r

What it binds (nccl.h, stable since NCCL 2.0): ncclGetVersion, ncclCommInitAll,
ncclCommDestroy, ncclCommAbort, ncclGetErrorString, ncclAllReduce, ncclAllGather, ncclBroadcast, ncclGroupStart/End. Every
call checks its ncclResult_t and raises NcclError naming the call and NCCL's message.

Calls through ctypes release the GIL, so N rank threads enqueue their collectives at once; a
collective enqueued on a stream under CUDA graph capture is captured (NCCL >= 2.9 supports
capture; tests/gpu/test_tp_cuda.py replays one): the per-GPU decode graphs under TP
(model/cuda_graph_runner.TPCudaGraphRunner) hold their all-reduces, broadcast and gather so.

NCCL_NVLS_ENABLE is set to 0 before the library loads (NVLink multicast stays off: the device
README's rule), unless the environment already sets it.
"""
from __future__ import annotations

import ctypes
import glob
import os
from typing import List, Optional, Sequence

import torch

_NCCL_SUCCESS = 0
# ncclDataType_t and ncclRedOp_t values of nccl.h
_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
           torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
_SUM = 0


class NcclError(RuntimeError):
    """An NCCL call returned an error (or the library could not be loaded)."""


def library_candidates() -> List[str]:
    """Where libnccl.so.2 may be, most specific first: the nvidia-nccl wheel torch depends on,
    torch's own lib/, then the loader's search path."""
    found: List[str] = []
    try:
        import nvidia.nccl as nv           # the wheel torch's CUDA build pins
        for root in list(getattr(nv, "__path__", [])):
            found += sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
    except ImportError:
        pass
    found += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnccl*.so*")))
    found.append("libnccl.so.2")
    return found


class Nccl:
    """The loaded library and its calls (one instance per process is enough: Nccl.get())."""

    _instance: Optional["Nccl"] = None

    def __init__(self, path: Optional[str] = None):
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        errors = []
        self.lib = None
        for candidate in ([path] if path else library_candidates()):
            try:
                self.lib = ctypes.CDLL(candidate)
                self.path = candidate
                break
            except OSError as e:
                errors.append(f"{candidate}: {e}")
        if self.lib is None:
            raise NcclError("libnccl could not be loaded (" + "; ".join(errors) + ")")
        lib = self.lib
        c_p, c_size, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [c_int]
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
        lib.ncclCommInitAll.argtypes = [ctypes.POINTER(c_p), c_int, ctypes.POINTER(c_int)]
        lib.ncclCommDestroy.argtypes = [c_p]
        lib.ncclCommAbort.argtypes = [c_p]
        lib.ncclAllReduce.argtypes = [c_p, c_p, c_size, c_int, c_int, c_p, c_p]
        lib.ncclAllGather.argtypes = [c_p, c_p, c_size, c_int, c_p, c_p]
        lib.ncclBroadcast.argtypes = [c_p, c_p, c_size, c_int, c_int, c_p, c_p]
        for fn in ("ncclGetVersion", "ncclCommInitAll", "ncclCommDestroy", "ncclCommAbort", "ncclAllReduce",
                   "ncclAllGather", "ncclBroadcast", "ncclGroupStart", "ncclGroupEnd"):
            getattr(lib, fn).restype = c_int

    @classmethod
    def get(cls) -> "Nccl":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _check(self, call: str, result: int) -> None:
        if result != _NCCL_SUCCESS:
            text = self.lib.ncclGetErrorString(result).decode(errors="replace")
            raise NcclError(f"{call} failed: NCCL error {result} ({text})")

    def version(self) -> str:
        """'2.27.3' and the like."""
        v = ctypes.c_int()
        self._check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(v)))
        code = v.value
        major, rest = divmod(code, 10000) if code >= 10000 else divmod(code, 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"

    def init_all(self, device_indices: Sequence[int]) -> List[int]:
        """ncclCommInitAll over these CUDA device indices (distinct): one communicator handle
        per device, rank r = device_indices[r]."""
        n = len(device_indices)
        if len(set(device_indices)) != n:
            raise NcclError(f"NCCL needs distinct GPUs, one per rank: {list(device_indices)}")
        comms = (ctypes.c_void_p * n)()
        devs = (ctypes.c_int * n)(*device_indices)
        self._check("ncclCommInitAll", self.lib.ncclCommInitAll(comms, n, devs))
        return [int(c) for c in comms]

    def destroy(self, comm: int) -> None:
        self._check("ncclCommDestroy", self.lib.ncclCommDestroy(ctypes.c_void_p(comm)))

    def abort(self, comm: int) -> None:
        """ncclCommAbort: frees comm even with a collective stuck in flight."""
        self._check("ncclCommAbort", self.lib.ncclCommAbort(ctypes.c_void_p(comm)))

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        if t.dtype not in _DTYPES:
            raise NcclError(f"NCCL has no type for {t.dtype}")
        return _DTYPES[t.dtype]

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor, comm: int, stream: int) -> None:
        """out = sum over ranks of x (same shape and dtype, contiguous, on this rank's GPU),
        enqueued on stream (a cudaStream_t as int)."""
        self._check("ncclAllReduce", self.lib.ncclAllReduce(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_size_t(x.numel()), self._dtype(x), _SUM, ctypes.c_void_p(comm),
            ctypes.c_void_p(stream)))

    def all_gather(self, x: torch.Tensor, out: torch.Tensor, comm: int, stream: int) -> None:
        """out [N * x.numel()] = every rank's x in rank order, enqueued on stream."""
        self._check("ncclAllGather", self.lib.ncclAllGather(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_size_t(x.numel()), self._dtype(x), ctypes.c_void_p(comm),
            ctypes.c_void_p(stream)))

    def broadcast(self, x: torch.Tensor, root: int, comm: int, stream: int) -> None:
        """x on every rank = root's x (in place: x contiguous, same shape and dtype on every
        rank), enqueued on stream."""
        self._check("ncclBroadcast", self.lib.ncclBroadcast(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(x.data_ptr()),
            ctypes.c_size_t(x.numel()), self._dtype(x), root, ctypes.c_void_p(comm),
            ctypes.c_void_p(stream)))
