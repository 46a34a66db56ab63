"""radixserve: pip install . installs the Python package (pysrc/) and, when nvcc and a CUDA
build of torch are present, the CUDA extension radixserve._C built from csrc/.

RADIXSERVE_CUDA=1 forces the extension (and fails loudly if it cannot be built);
RADIXSERVE_CUDA=0 skips it. Build with --no-build-isolation so the extension is compiled
against the torch that will import it (the Makefile does this).
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


def _want_cuda():
    flag = os.environ.get("RADIXSERVE_CUDA")
    if flag == "0":
        return False
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


def _extensions():
    if not _want_cuda():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 2))
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]
    cutlass = _cutlass_include()
    if cutlass:
        include_dirs.append(cutlass)
    archs = os.environ.get("RADIXSERVE_CUDA_ARCHS", "90a;80").split(";")
    gencode = []
    for a in archs:
        gencode += [f"-gencode=arch=compute_{a},code=sm_{a}"]
    sources = ["csrc/bindings.cpp"] + sorted(glob.glob("csrc/ops/*.cu"))
    ext = CUDAExtension(
        name="radixserve._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": ["-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda",
                     "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
                     "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-lineinfo"] + gencode,
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="radixserve",
    version="0.1.0",
    description="LLM serving runtime: radix-tree KV reuse, structured output, hand-written CUDA",
    package_dir={"": "pysrc"},
    packages=find_packages("pysrc"),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "numpy",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "jinja2",
        "starlette",
        "uvicorn",
        "uvloop",
        "xgrammar",
        "prometheus_client",
        "tqdm",
        "gguf",
        "transformers",
        "accelerate",
    ],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "openai", "httpx"],
        "build": ["pybind11", "ninja", "nvidia-cutlass"],
    },
    entry_points={"console_scripts": ["radixserve=radixserve.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
