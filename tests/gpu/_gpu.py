"""Shared skip condition for the kernel tests: a CUDA device and the built extension."""
import pytest
import torch

from radixserve.ops._ext import kernels_available

HAS_KERNELS = torch.cuda.is_available() and kernels_available()
requires_kernels = pytest.mark.skipif(not HAS_KERNELS,
                                      reason="needs a CUDA device and the radixserve._C extension")

# (atol, rtol) per dtype for kernels that compute in fp32 and round once at the end
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def rescale_dummy_weights(model, seed: int = 3) -> None:
    """O(1) logits for a dummy-initialised model (its std-0.02 init makes them nearly flat, and
    comparisons between kernels meaningless): norms near 1, other weights ~ N(0, 1/fan_in)."""
    import math

    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, device="cuda"))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") / math.sqrt(p.shape[-1]))


def run_until_done(sched, limit: int = 2000) -> None:
    """Step a Scheduler until it has no work, check_integrity after every step; then every KV
    slot is home (free or evictable in the radix cache)."""
    steps = 0
    while sched.has_work():
        sched.step()
        sched.check_integrity()
        steps += 1
        assert steps < limit, "the scheduler made no progress"
    assert sched.kv_pool.available_size() + sched.cache.evictable_size() == \
        sched.kv_pool.num_slots


def capture_graph(call):
    """call() captured in a CUDA graph, after one warm-up run on a side stream (allocator and
    first-launch work stay out of the capture) -> (graph, the output tensor of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out
