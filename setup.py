"""radixserve: pip install . installs the Python package (pysrc/) and, when nvcc and a CUDA
build of torch are present, the CUDA extension radixserve._C built from csrc/.

RADIXSERVE_CUDA=1 forces the extension (and fails loudly if it cannot be built);
RADIXSERVE_CUDA=0 skips it. Build with --no-build-isolation so the extension is compiled
against the torch that will import it (the Makefile does this).

RADIXSERVE_CUDA_ARCHS lists the GPU architectures (';'-separated, "+PTX" adds PTX of that arch
for GPUs newer than every cubin); default "90a;80", or RELEASE_ARCHS with RADIXSERVE_RELEASE=1
(`make wheel`), which also drops -lineinfo and strips the extension of its debug info.
A build that compiles the extension pins torch to the minor version it compiled against: _C
binds to that torch's C++ ABI.
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cutlass_include():
    """CuTe/CUTLASS headers come from the nvidia-cutlass wheel (third_party/README.md)."""
    try:
        import cutlass_library
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    return path if os.path.isdir(path) else None


def _nvidia_wheel_includes():
    """Headers of the CUDA libraries torch's CUDA build pulls in as wheels (nvidia/cu13/include
    holds cusparse.h, cublas_v2.h, ...): a minimal toolkit (nvcc + cudart) lacks them, and torch's
    ATen/cuda headers include them. Searched after every -I directory (-isystem)."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        for sub in sorted(os.listdir(root)):
            inc = os.path.join(root, sub, "include")
            if os.path.isfile(os.path.join(inc, "cusparse.h")):
                found.append(inc)
    return found


def _want_cuda():
    flag = os.environ.get("RADIXSERVE_CUDA")
    if flag == "0":
        return False
    # torch derives CUDA_HOME from `which nvcc` when unset; a /usr/local/bin/nvcc shim would make
    # that /usr/local. Point it at the toolkit before torch.utils.cpp_extension is imported.
    if "CUDA_HOME" not in os.environ and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        if flag == "1":
            sys.exit("RADIXSERVE_CUDA=1 but torch is not importable in the build environment")
        return False
    has_nvcc = cpp_extension.CUDA_HOME is not None or shutil.which("nvcc") is not None
    ok = has_nvcc and torch.version.cuda is not None
    if flag == "1" and not ok:
        sys.exit("RADIXSERVE_CUDA=1 but nvcc or a CUDA build of torch is missing")
    return ok


RELEASE_ARCHS = "80+PTX;90a;100a;120"


def _release() -> bool:
    return os.environ.get("RADIXSERVE_RELEASE") == "1"


def _archs():
    """['80+PTX', '90a', ...] from RADIXSERVE_CUDA_ARCHS, else the default for this build."""
    default = RELEASE_ARCHS if _release() else "90a;80"
    return [a.strip() for a in os.environ.get("RADIXSERVE_CUDA_ARCHS", default).split(";")
            if a.strip()]


def _gencode(arch: str):
    """'90a' -> a cubin for sm_90a; '80+PTX' -> a cubin for sm_80 and compute_80 PTX."""
    base = arch[:-4] if arch.upper().endswith("+PTX") else arch
    codes = [f"sm_{base}"] + ([f"compute_{base}"] if base != arch else [])
    return [f"-gencode=arch=compute_{base},code=[{','.join(codes)}]"]


def _torch_pin():
    """'torch==2.11.*': the torch minor version the extension is compiled against."""
    import torch
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"torch=={major}.{minor}.*"


def _extensions():
    if not _want_cuda():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cutlass = _cutlass_include()
    if cutlass:
        include_dirs.append(cutlass)
    system_includes = []
    for inc in _nvidia_wheel_includes():
        system_includes += ["-isystem", inc]
    sources = ["csrc/bindings.cpp"] + sorted(glob.glob("csrc/ops/*.cu"))
    archs = _archs()
    # recorded in the module (radixserve._C.CUDA_ARCHS, csrc/bindings.cpp) for ops/kernel_status.py
    archs_define = "-DRADIXSERVE_CUDA_ARCHS=" + ",".join(archs)
    gencode = [flag for a in archs for flag in _gencode(a)]
    debug = [] if _release() else ["-lineinfo"]
    # nvcc compiles one file's archs in parallel with --threads: use the cores that ninja's
    # MAX_JOBS parallel compiles (one per source file) leave idle
    cpus = os.cpu_count() or 1
    threads = max(1, min(len(archs), cpus // min(int(os.environ["MAX_JOBS"]), len(sources))))
    ext = CUDAExtension(
        name="radixserve._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": ["-O3", archs_define] + system_includes,
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", f"--threads={threads}"]
                    + debug + gencode + system_includes,
        },
        extra_link_args=["-s"] if _release() else [],   # strip: no debug info in a release
    )
    return [ext], {"build_ext": _build_ext_class(BuildExtension)}


def _build_ext_class(base):
    """torch's BuildExtension (ninja) with one object directory per Python and torch under
    build/, whatever build_temp the front end picked (pip's editable and wheel builds each pick a
    new temporary one): ninja then recompiles only what changed, so `make wheel` after
    `make test` with the same flags (CI exports RADIXSERVE_RELEASE=1 for both) only relinks."""
    import torch

    tag = f"cuda-objects-py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"

    class BuildExt(base.with_options(use_ninja=True)):
        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", tag.replace("+", "_"))

    return BuildExt


ext_modules, cmdclass = _extensions()
TORCH_REQUIREMENT = _torch_pin() if ext_modules else "torch>=2.4"

setup(
    name="radixserve",
    version="0.1.0",
    description="LLM serving runtime: radix-tree KV reuse, structured output, hand-written CUDA",
    package_dir={"": "pysrc"},
    packages=find_packages("pysrc"),
    # the dashboard's page (server/dashboard.py, --enable-dashboard)
    package_data={"radixserve.server": ["static/*.html"]},
    python_requires=">=3.10",
    install_requires=[
        TORCH_REQUIREMENT,
        "numpy",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "jinja2",
        "starlette",
        "uvicorn",
        "httptools",       # uvicorn's HTTP parser when installed (server/app.py says why)
        "uvloop",
        "xgrammar",
        "prometheus_client",
        "orjson",
        "pyzmq",           # --kv-events-config (cache/kv_events.py; imported only with the flag)
        "msgspec",         # idem: vLLM's KVEventBatch msgpack encoding
        "pydantic>=2",
        "tqdm",
        "gguf",
        "transformers",
        "accelerate",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "openai", "anthropic",
                 "httpx", "aiohttp", "matplotlib", "schemathesis", "jsonschema", "nvidia-cuda-cuobjdump",
                 "pyelftools", "smg>=1.13,<2"],
        # `radixserve serve --dp-size N`: SGLang's model gateway (Shepherd Model Gateway) in
        # front of the replicas (radixserve/replicas.py)
        "router": ["smg>=1.13,<2"],
        "bench": ["httpx", "aiohttp", "matplotlib"],
        "build": ["pybind11", "ninja", "nvidia-cutlass"],
    },
    entry_points={"console_scripts": ["radixserve=radixserve.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
