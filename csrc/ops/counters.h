// Device counters that kernels find zero and leave zero (the last-CTA patterns).
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace radixserve {

// Counters a kernel finds zero and leaves zero (the split decode's last-CTA merge,
// DecodeParams::split_counters; the extend kernel's item queue, ExtendParams::work_counters; the
// skinny GEMM's add + norm epilogue, SkinnyParams::arrivals):
// int32, one buffer per device and pool, zero-initialised once (at::zeros) and left zero by every
// launch, so it is reused without a memset, by eager launches and CUDA-graph replays alike. Grown
// (a new zeroed buffer) when a launch needs more than it holds, but only outside a CUDA-graph
// capture: a capture would record the growth's memset and bake in a pointer of its own. The eager
// warm-up that precedes every capture (model/cuda_graph_runner.py runs each bucket twice on the
// capture stream, largest bucket first; torch.cuda.graphs' recipe) grows it first; a capture that
// finds it too small fails. An outgrown buffer is kept alive, not freed: graphs captured with its
// pointer still replay into it. Launches of one device share a pool's buffer: they must not run
// concurrently (the attention ops run on one stream). The tensors are never destroyed (no
// teardown-order issue with the caching allocator at exit).
enum CounterPool { kDecodeSplits = 0, kExtendItems = 1, kGemvArrivals = 2, kCounterPools = 3 };

// At least `needed` int32 counters of pool on like's device, all zero. Raises (naming `what`)
// when they would have to grow during a CUDA graph capture. Defined in attention.cu.
int* left_zero_counters(const at::Tensor& like, CounterPool pool, int64_t needed, const char* what);

}  // namespace radixserve
