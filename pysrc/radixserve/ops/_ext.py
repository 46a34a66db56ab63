"""Whether the compiled extension radixserve._C is there and used: kernels_available(), the
one question the ops ask before launching a kernel.

It is answered, and cached, in ops/kernel_status.py, which also works out why the kernels are or
are not used (CPU torch, not built, torch ABI mismatch, a GPU architecture the build lacks, ...);
the model runner logs that once at start. The import points one way (this module ->
kernel_status), so there is no circle between the two.
"""
from __future__ import annotations

from radixserve.ops.kernel_status import kernels_available

__all__ = ["kernels_available"]
