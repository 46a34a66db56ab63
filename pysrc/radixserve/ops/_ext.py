"""Loads the compiled extension radixserve._C once, on first use, and says whether it is there.

Why it is or is not used (CPU torch, not built, torch ABI mismatch, a GPU architecture the build
lacks, ...) is worked out in ops/kernel_status.py; the model runner logs it once at start.
"""
from __future__ import annotations

import functools

import torch

from radixserve.ops import kernel_status as _status


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """True when radixserve._C imported, registered torch.ops.radixserve.*, and has code for the
    current GPU's architecture (otherwise CUDA tensors run the torch references, which is also
    what a GPU the build lacks gets instead of a 'no kernel image' error).

    RADIXSERVE_DISABLE_KERNELS=1 forces the torch references everywhere (for A/B checks).
    False without a GPU (no CUDA tensor can exist then).
    """
    return torch.cuda.is_available() and _status.kernel_status("cuda").in_use
