"""What a built wheel carries, checked against what a release must carry.

    python release/inspect_wheel.py dist/radixserve-*.whl [--expect-archs "80+PTX;90a;100a;120"]

Prints one JSON object: the wheel's file name, size, tags (from its WHEEL file), the torch it
requires (METADATA), the extension's size, its cubin and PTX architectures (cuobjdump
--list-elf / --list-ptx; cuobjdump from the CUDA toolkit or the nvidia-cuda-cuobjdump wheel),
whether it still has debug sections, and the shared libraries it needs. Exits 1, naming what is
wrong, when an expected architecture is missing, the torch requirement is not pinned to a minor
version, or debug sections remain. Runs with a Python that imports radixserve (the build's:
the expected archs are read by radixserve.ops.kernel_status.parse_archs).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from typing import Dict, List, Optional


def find_cuobjdump() -> Optional[str]:
    """cuobjdump on PATH, in the CUDA toolkit, or in an nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")]
    for root in [sysconfig.get_paths()["purelib"]] + sys.path:
        candidates += glob.glob(os.path.join(root, "nvidia", "*", "bin", "cuobjdump"))
    return next((c for c in candidates if os.path.isfile(c)), None)


def list_archs(cuobjdump: str, so_path: str, flag: str) -> List[str]:
    """'--list-elf' -> ['sm_80', 'sm_90a', ...]; '--list-ptx' -> ['compute_80', ...]."""
    out = subprocess.run([cuobjdump, flag, so_path], capture_output=True, text=True).stdout
    # lines like "ELF file 2: _C.cpython-311-x86_64-linux-gnu.2.sm_90a.cubin" and
    # "PTX file 1: _C....1.sm_80.ptx" (PTX is named by its sm_ too)
    ext, kind = ("cubin", "sm") if flag == "--list-elf" else ("ptx", "compute")
    found = re.findall(rf"\.(?:sm|compute)_(\d+[af]?)\.{ext}\b", out)
    return sorted({f"{kind}_{a}" for a in found})


def expected_archs(spec: str) -> Dict[str, List[str]]:
    """'80+PTX;90a' -> {'elf': ['sm_80', 'sm_90a'], 'ptx': ['compute_80']} (setup.py's spelling,
    read by the one parser of it, radixserve.ops.kernel_status.parse_archs)."""
    from radixserve.ops.kernel_status import parse_archs

    archs = parse_archs(spec)
    return {"elf": [a for a in archs if a.startswith("sm_")],
            "ptx": [a for a in archs if a.startswith("compute_")]}


def debug_sections(so_path: str) -> List[str]:
    from elftools.elf.elffile import ELFFile   # pyelftools: auditwheel's own dependency
    with open(so_path, "rb") as f:
        return [s.name for s in ELFFile(f).iter_sections() if s.name.startswith(".debug")]


def needed_libraries(so_path: str) -> List[str]:
    from elftools.elf.elffile import ELFFile
    with open(so_path, "rb") as f:
        dyn = ELFFile(f).get_section_by_name(".dynamic")
        return sorted(t.needed for t in dyn.iter_tags() if t.entry.d_tag == "DT_NEEDED")


def inspect(wheel: str, workdir: str) -> Dict:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        wheel_file = zf.read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
        so_name = next((n for n in names if re.fullmatch(r"radixserve/_C\..*\.so", n)), None)
        so_path = zf.extract(so_name, workdir) if so_name else None
    info = {
        "wheel": os.path.basename(wheel),
        "size_mb": round(os.path.getsize(wheel) / 1e6, 1),
        "tags": re.findall(r"^Tag: (.+)$", wheel_file, re.M),
        "requires_torch": re.findall(r"^Requires-Dist: (torch\b[^;\n]*)", meta, re.M),
        "extension": so_name,
    }
    if so_path:
        info["extension_size_mb"] = round(os.path.getsize(so_path) / 1e6, 1)
        info["debug_sections"] = debug_sections(so_path)
        info["needed_libraries"] = needed_libraries(so_path)
        cuobjdump = find_cuobjdump()
        if cuobjdump:
            info["cubin_archs"] = list_archs(cuobjdump, so_path, "--list-elf")
            info["ptx_archs"] = list_archs(cuobjdump, so_path, "--list-ptx")
    return info


def problems(info: Dict, expect: Optional[str]) -> List[str]:
    out = []
    if not info["extension"]:
        return ["the wheel carries no radixserve/_C extension"]
    if not any(re.fullmatch(r"torch==\d+\.\d+\.\*", r.strip()) for r in info["requires_torch"]):
        out.append(f"torch is not pinned to a minor version: {info['requires_torch']}")
    if info["debug_sections"]:
        out.append(f"debug sections remain: {info['debug_sections']}")
    if expect:
        if "cubin_archs" not in info:
            out.append("cuobjdump not found (pip install nvidia-cuda-cuobjdump): archs unchecked")
        else:
            want = expected_archs(expect)
            for kind, key in (("elf", "cubin_archs"), ("ptx", "ptx_archs")):
                missing = sorted(set(want[kind]) - set(info[key]))
                if missing:
                    out.append(f"missing {key}: {missing} (has {info[key]})")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel")
    ap.add_argument("--expect-archs", default=None,
                    help="setup.py's spelling, e.g. '80+PTX;90a;100a;120' (default: no check)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        info = inspect(args.wheel, tmp)
    print(json.dumps(info, indent=1))
    bad = problems(info, args.expect_archs)
    for p in bad:
        print(f"wheel check: {p}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
