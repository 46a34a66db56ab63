"""Loads the compiled extension radixserve._C once, on first use, and says whether it is there."""
from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """True when radixserve._C imported and registered torch.ops.radixserve.*.

    RADIXSERVE_DISABLE_KERNELS=1 forces the torch references everywhere (for A/B checks).
    """
    if os.environ.get("RADIXSERVE_DISABLE_KERNELS", "0") == "1":
        return False
    try:
        import torch  # noqa: F401

        from radixserve import _C  # noqa: F401
    except ImportError as e:
        logger.debug("radixserve._C not available (%s); using torch references", e)
        return False
    return True
