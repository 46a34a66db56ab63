"""Shared skip condition for the kernel tests: a CUDA device and the built extension."""
import pytest
import torch

from radixserve.ops._ext import kernels_available

HAS_KERNELS = torch.cuda.is_available() and kernels_available()
requires_kernels = pytest.mark.skipif(not HAS_KERNELS,
                                      reason="needs a CUDA device and the radixserve._C extension")

# (atol, rtol) per dtype for kernels that compute in fp32 and round once at the end
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
