"""Whether the CUDA kernels of radixserve._C are in use, and if not, why.

kernel_status(device) classifies, in this order:
  disabled      RADIXSERVE_DISABLE_KERNELS=1 (the debugging switch: torch references everywhere)
  cpu_torch     torch is a CPU-only build (torch.version.cuda is None): _C cannot load
  not_built     no radixserve._C file next to the package (nvcc or a CUDA torch was missing at
                install time, or RADIXSERVE_CUDA=0)
  abi_mismatch  _C exists but failed to load against this torch (undefined symbol, libc10/libtorch):
                it was built against another torch; rebuild against this one
  import_error  _C exists but failed to load for another reason (the message is kept)
  cpu_device    _C loaded (or not: the reason says), but the device is the CPU: not needed
  no_gpu        a CUDA device was asked for but torch sees none
  arch_missing  _C has no machine code for this GPU's architecture (its build recorded the
                archs, RADIXSERVE_CUDA_ARCHS, in _C.CUDA_ARCHS; a build that did not is "unknown"
                and is probed with one tiny launch instead)
  in_use        the kernels run

The extension is imported at most once per process; statuses are cached per device. reset()
forgets both (tests).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import logging
import re
from typing import List, Optional, Tuple, Union

import torch

from radixserve import knobs

FALLBACK = "the torch reference ops (radixserve.ops.reference)"
EXTENSION = "radixserve._C"
_ABI_PATTERNS = ("undefined symbol", "libc10", "libtorch", "symbol not found")


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    in_use: bool
    kind: str                       # one of the codes in the module doc
    reason: str                     # one human sentence: why (not) in use
    built_archs: List[str]          # e.g. ["sm_90a", "sm_80"]; [] when not recorded or not loaded
    device_arch: Optional[str]      # e.g. "sm_90" (the GPU's compute capability); None on the CPU
    torch_version: str
    torch_cuda: Optional[str]       # torch.version.cuda: None for a CPU-only torch
    device: str = "cpu"             # "cpu" or "cuda:N"
    device_name: Optional[str] = None
    extension_loaded: bool = False
    import_error: Optional[str] = None
    kernel_arch: Optional[str] = None   # the built arch whose code runs on this GPU

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def built_archs_text(self) -> str:
        return ",".join(self.built_archs) if self.built_archs else "unknown archs (not recorded)"

    def extension_summary(self) -> str:
        """The extension's own state, whatever the device: for the CPU line and `radixserve env`."""
        if self.kind == "disabled":
            return "not loaded (RADIXSERVE_DISABLE_KERNELS=1)"
        if self.extension_loaded:
            return f"loaded, built for {self.built_archs_text}"
        if self.import_error:
            return f"failed to load: {self.import_error}"
        if self.torch_cuda is None:
            return "not loadable (CPU-only torch)"
        return "not built"

    def log_line(self) -> Tuple[int, str]:
        """(level, message) of the one start-up line: WARNING on a GPU without kernels."""
        if self.in_use:
            return logging.INFO, (f"CUDA kernels: in use ({EXTENSION}, {self.kernel_arch or '?'}, "
                                  f"built for {self.built_archs_text}; GPU {self.device_name}, "
                                  f"{self.device_arch})")
        tail = " (slow on a GPU)" if self.on_gpu and self.kind != "no_gpu" else ""
        level = logging.WARNING if self.on_gpu else logging.INFO
        return level, f"CUDA kernels: not in use: {self.reason}; using {FALLBACK}{tail}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["extension"] = self.extension_summary()
        return d


# ---------------------------------------------------------------------------------------------
# Seams (tests replace these)

def _extension_file() -> Optional[str]:
    """Path of the radixserve._C shared object, or None when there is none (never imports it)."""
    try:
        spec = importlib.util.find_spec(EXTENSION)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _import_extension():
    return importlib.import_module(EXTENSION)


# every op csrc/bindings.cpp registers: what a build must provide (.ci/run, release/check_wheel.sh)
EXTENSION_OPS = ("store_kv", "build_kv_indices", "paged_decode_attention",
                 "paged_extend_attention", "extend_attention_kernel", "bitmask_sample",
                 "argmax_rows", "skinny_linear", "fp8_skinny_linear", "fp8_quantize",
                 "rmsnorm_quant_fp8", "rms_norm", "fused_add_rms_norm",
                 "rotary_embedding", "rotary_embedding_store_kv", "silu_and_mul")


def missing_extension_ops() -> List[str]:
    """Imports radixserve._C (ImportError if it cannot) and returns the EXTENSION_OPS that
    torch.ops.radixserve lacks: [] for a complete build."""
    _import_extension()
    return [op for op in EXTENSION_OPS if not hasattr(torch.ops.radixserve, op)]


def _probe_launch(device: torch.device) -> Optional[str]:
    """One tiny kernel launch; None if it ran, else the error (e.g. no kernel image)."""
    try:
        x = torch.zeros(1, 2, dtype=torch.float32, device=device)
        torch.ops.radixserve.silu_and_mul(x)
        torch.cuda.synchronize(device)
    except RuntimeError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    return None


# ---------------------------------------------------------------------------------------------

def parse_archs(text: Optional[str]) -> List[str]:
    """'90a,80' or '90a;80' or 'sm_90a,sm_80' -> ['sm_90a', 'sm_80']; an entry with '+PTX'
    ('80+PTX', setup.py's spelling for a cubin plus PTX) -> ['sm_80', 'compute_80'];
    ''/None -> []."""
    if not text:
        return []
    out = []
    for a in re.split(r"[,;\s]+", text.strip()):
        a = a.strip()
        if not a:
            continue
        ptx = a.upper().endswith("+PTX")
        a = a[:-4] if ptx else a
        a = a.split("sm_")[-1].split("compute_")[-1]
        out.append(f"sm_{a}")
        if ptx:
            out.append(f"compute_{a}")
    return out


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")


def arch_runs_on(built: str, capability: Tuple[int, int]) -> bool:
    """Whether code built for `built` runs on a GPU of compute capability (major, minor).
    A cubin (sm_XY) runs on the same major with an equal or higher minor; an 'a'
    (architecture-specific) one only on exactly its own; an 'f' (family) one on the same major
    with an equal or higher minor. PTX (compute_XY, no suffix) is compiled by the driver for any
    GPU of capability >= XY; 'a'/'f' PTX only where its cubin would run."""
    m = _ARCH.fullmatch(built)
    if m is None:
        return False
    kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    dmaj, dmin = capability
    if suffix == "a":
        return (dmaj, dmin) == (major, minor)
    if kind == "compute" and not suffix:
        return (dmaj, dmin) >= (major, minor)
    return dmaj == major and dmin >= minor


def best_arch(built_archs: List[str], capability: Tuple[int, int]) -> Optional[str]:
    """The built arch the driver would pick for this GPU (a compatible cubin, the newest, before
    any PTX), or None."""
    ok = [a for a in built_archs if arch_runs_on(a, capability)]
    if not ok:
        return None

    def key(a: str):
        m = _ARCH.fullmatch(a)
        return (m.group(1) == "sm", int(m.group(2)), int(m.group(3)), m.group(4) == "a",
                m.group(4) == "f")
    return max(ok, key=key)


@functools.lru_cache(maxsize=None)
def _load_extension() -> Tuple[bool, Optional[str], Optional[str], List[str]]:
    """(loaded, kind of failure or None, error message or None, built archs). Imports once."""
    if _extension_file() is None:
        return False, "not_built", None, []
    try:
        mod = _import_extension()
    except (ImportError, OSError) as e:
        msg = str(e).strip() or repr(e)
        kind = "abi_mismatch" if any(p in msg for p in _ABI_PATTERNS) else "import_error"
        return False, kind, msg, []
    return True, None, None, parse_archs(getattr(mod, "CUDA_ARCHS", None))


def _resolve_device(device: Union[None, str, torch.device]) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def probe(device: Union[None, str, torch.device] = None) -> KernelStatus:
    """The status for device (None: the GPU if torch sees one, else the CPU); uncached."""
    dev = _resolve_device(device)
    base = dict(built_archs=[], device_arch=None, torch_version=str(torch.__version__),
                torch_cuda=torch.version.cuda, device="cpu")
    if dev.type == "cuda":
        base["device"] = f"cuda:{dev.index if dev.index is not None else 0}"

    def status(in_use: bool, kind: str, reason: str, **kw) -> KernelStatus:
        return KernelStatus(in_use=in_use, kind=kind, reason=reason, **{**base, **kw})

    if knobs.value("RADIXSERVE_DISABLE_KERNELS"):
        return status(False, "disabled", "disabled by RADIXSERVE_DISABLE_KERNELS=1")
    if torch.version.cuda is None:
        if dev.type != "cuda":
            return status(False, "cpu_device", f"the device is the CPU, where they are not needed "
                          f"(and torch {torch.__version__} is a CPU-only build)")
        return status(False, "cpu_torch", f"torch {torch.__version__} is a CPU-only build "
                      "(torch.version.cuda is None); install a CUDA build of torch and rebuild "
                      "radixserve")
    loaded, fail_kind, error, archs = _load_extension()
    base.update(built_archs=archs, extension_loaded=loaded, import_error=error)
    if dev.type != "cuda":
        summary = KernelStatus(False, "cpu_device", "", **base).extension_summary()
        return status(False, "cpu_device", f"the device is the CPU, where they are not needed "
                      f"({EXTENSION}: {summary})")
    if fail_kind == "not_built":
        return status(False, "not_built", f"{EXTENSION} is not built (no extension file: install "
                      "with nvcc and a CUDA torch present, --no-build-isolation)")
    if fail_kind == "abi_mismatch":
        return status(False, "abi_mismatch", f"torch ABI mismatch: {EXTENSION} was built against "
                      f"another torch than this {torch.__version__} (rebuild radixserve against "
                      f"it with --no-build-isolation): {error}")
    if fail_kind == "import_error":
        return status(False, "import_error", f"{EXTENSION} failed to import: {error}")
    if not torch.cuda.is_available():
        return status(False, "no_gpu", "torch sees no GPU (torch.cuda.is_available() is False)")
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    cap = tuple(torch.cuda.get_device_capability(idx))
    arch = f"sm_{cap[0]}{cap[1]}"
    name = torch.cuda.get_device_name(idx)
    base.update(device=f"cuda:{idx}", device_arch=arch, device_name=name)
    if archs:
        chosen = best_arch(archs, cap)
        if chosen is None:
            wanted = "90a" if cap == (9, 0) else f"{cap[0]}{cap[1]}"   # 90a: the wgmma kernel
            return status(False, "arch_missing", f"{EXTENSION} has no code for this GPU's "
                          f"architecture ({name}, {arch}; built for {','.join(archs)}): rebuild "
                          f"with {wanted} in RADIXSERVE_CUDA_ARCHS")
        how = (f"{chosen} PTX, compiled by the driver for {name} ({arch}) at first use"
               if chosen.startswith("compute_") else f"{chosen} code runs on {name} ({arch})")
        return status(True, "in_use", how, kernel_arch=chosen)
    err = _probe_launch(torch.device("cuda", idx))
    if err is not None:
        kind = "arch_missing" if "no kernel image" in err.lower() else "import_error"
        what = (f"{EXTENSION} has no code for this GPU's architecture ({name}, {arch}; its build "
                "did not record its archs)" if kind == "arch_missing"
                else f"{EXTENSION} loaded but a test launch failed on {name} ({arch})")
        return status(False, kind, f"{what}: {err}")
    return status(True, "in_use", f"a test launch ran on {name} ({arch}); built archs not "
                  "recorded", kernel_arch=arch)


@functools.lru_cache(maxsize=None)
def _cached(device_key: str) -> KernelStatus:
    return probe(None if device_key == "auto" else device_key)


def kernel_status(device: Union[None, str, torch.device] = None) -> KernelStatus:
    """probe(device), cached per device."""
    return _cached("auto" if device is None else str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """True when radixserve._C imported, registered torch.ops.radixserve.*, and has code for the
    current GPU's architecture (otherwise CUDA tensors run the torch references, which is also
    what a GPU the build lacks gets instead of a 'no kernel image' error).

    RADIXSERVE_DISABLE_KERNELS=1 forces the torch references everywhere (for A/B checks).
    False without a GPU (no CUDA tensor can exist then). Cached; reset() forgets it.
    """
    return torch.cuda.is_available() and kernel_status("cuda").in_use


def log_kernel_status(device: Union[None, str, torch.device] = None,
                      log: Optional[logging.Logger] = None) -> KernelStatus:
    """Log the one start-up line (see KernelStatus.log_line) and return the status."""
    st = kernel_status(device)
    level, msg = st.log_line()
    (log or logging.getLogger("radixserve.ops")).log(level, msg)
    return st


def reset() -> None:
    """Forget the import attempt and every cached status, kernels_available()'s too (tests)."""
    _load_extension.cache_clear()
    _cached.cache_clear()
    kernels_available.cache_clear()
