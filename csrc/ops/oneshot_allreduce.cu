// oneshot_register / oneshot_all_reduce / oneshot_signal_bytes: the one-shot all-reduce over
// peer-mapped buffers of one process (issue 37, point 3). Kernel and its synchronisation:
// csrc/include/radixserve/oneshot_allreduce.cuh. Python side: pysrc/radixserve/parallel/oneshot.py.
//
// A registration is a table of per-rank buffers and signal areas (tensors the Python object keeps
// alive; only their device pointers are stored here) plus the grid size; it enables peer access
// between every pair of distinct devices it spans. oneshot_all_reduce(handle, rank, input, out)
// launches rank's kernel on the current stream of input's device: every rank of the registration
// must make the same call (same numel and dtype, same order), each on its own stream, or the
// kernels wait for each other forever (until OneShotAllReduce.reset sets the abort words).
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/oneshot_allreduce.cuh"

namespace radixserve {
namespace {


struct Registration {
  oneshot::Params base;          // buffers, signals, capacity filled; input/output/numel/rank per call
  std::vector<int> device;  // device index of each rank's buffer
  int world = 0;
  int blocks = 0;
};

std::mutex g_mutex;
std::vector<std::unique_ptr<Registration>> g_registrations;  // handle = index; never removed

bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) % n) == 0; }

void enable_peer(int dev, int peer) {
  if (dev == peer) return;
  int can = 0;
  cudaError_t err = cudaDeviceCanAccessPeer(&can, dev, peer);
  RS_CHECK(err == cudaSuccess, "cudaDeviceCanAccessPeer(", dev, ", ", peer, ") failed: ",
           cudaGetErrorString(err));
  RS_CHECK(can != 0, "GPU ", dev, " cannot access GPU ", peer,
           "'s memory (no peer-to-peer path): the one-shot all-reduce needs P2P between every "
           "pair of its GPUs; use NCCL");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  err = cudaDeviceEnablePeerAccess(peer, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // not sticky, but clear it so no later check reports it
    return;
  }
  RS_CHECK(err == cudaSuccess, "cudaDeviceEnablePeerAccess(", peer, ") on GPU ", dev,
           " failed: ", cudaGetErrorString(err));
}

const Registration& lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  RS_CHECK(handle >= 0 && handle < static_cast<int64_t>(g_registrations.size()),
           "oneshot_all_reduce: unknown handle ", handle, " (oneshot_register returns handles)");
  return *g_registrations[handle];
}

}  // namespace

int64_t oneshot_signal_bytes() { return static_cast<int64_t>(sizeof(oneshot::Signal)); }

int64_t oneshot_register(at::TensorList buffers,
                         at::TensorList signals, int64_t blocks) {
  const int64_t world = static_cast<int64_t>(buffers.size());
  RS_CHECK(world >= 2 && world <= oneshot::kMaxRanks, "oneshot_register takes 2..", oneshot::kMaxRanks,
           " ranks, got ", world);
  RS_CHECK(static_cast<int64_t>(signals.size()) == world, "oneshot_register: ", world,
           " buffers but ", static_cast<int64_t>(signals.size()), " signal areas");
  RS_CHECK(blocks >= 1 && blocks <= oneshot::kMaxBlocks, "oneshot_register: blocks must be 1..",
           oneshot::kMaxBlocks, ", got ", blocks);
  auto reg = std::make_unique<Registration>();
  reg->world = static_cast<int>(world);
  reg->blocks = static_cast<int>(blocks);
  reg->base = oneshot::Params{};
  const int64_t total = buffers[0].numel();
  for (int64_t r = 0; r < world; ++r) {
    const at::Tensor& b = buffers[r];
    const at::Tensor& s = signals[r];
    RS_CHECK(b.is_cuda() && b.scalar_type() == at::kByte && b.is_contiguous(), "buffer ", r,
             " must be a contiguous uint8 CUDA tensor");
    RS_CHECK(s.is_cuda() && s.scalar_type() == at::kByte && s.is_contiguous(), "signal area ", r,
             " must be a contiguous uint8 CUDA tensor");
    RS_CHECK(s.device() == b.device(), "signal area ", r, " is on ", s.device(), ", its buffer on ",
             b.device());
    RS_CHECK(b.numel() == total, "buffer ", r, " has ", b.numel(), " bytes, buffer 0 ", total,
             ": every rank's buffer must be the same size");
    RS_CHECK(total > 0 && total % 32 == 0, "buffers must be 2 halves of a multiple of 16 bytes, got ",
             total, " bytes");
    RS_CHECK(s.numel() >= oneshot_signal_bytes(), "signal area ", r, " has ", s.numel(),
             " bytes; it needs oneshot_signal_bytes() = ", oneshot_signal_bytes());
    RS_CHECK(aligned(b.data_ptr(), 16), "buffer ", r, " must be 16-byte aligned");
    RS_CHECK(aligned(s.data_ptr(), alignof(oneshot::Signal)), "signal area ", r, " must be ",
             static_cast<int64_t>(alignof(oneshot::Signal)), "-byte aligned");
    reg->base.buffers[r] = b.data_ptr();
    reg->base.signals[r] = static_cast<oneshot::Signal*>(s.data_ptr());
    reg->device.push_back(b.device().index());
  }
  reg->base.capacity = total / 2;
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t q = 0; q < world; ++q) enable_peer(reg->device[r], reg->device[q]);
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  g_registrations.push_back(std::move(reg));
  return static_cast<int64_t>(g_registrations.size()) - 1;
}

void oneshot_all_reduce(int64_t handle, int64_t rank, const at::Tensor& input, at::Tensor output) {
  const Registration& reg = lookup(handle);
  RS_CHECK(rank >= 0 && rank < reg.world, "oneshot_all_reduce: rank ", rank, " of a ", reg.world,
           "-rank registration");
  const auto dtype = input.scalar_type();
  RS_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
           "oneshot_all_reduce takes bf16, fp16 or fp32, got ", dtype);
  RS_CHECK(input.is_cuda() && input.device().index() == reg.device[rank], "rank ", rank,
           "'s input must be on cuda:", reg.device[rank], ", got ", input.device());
  RS_CHECK(output.is_cuda() && output.device() == input.device(),
           "output must be on the input's device ", input.device(), ", got ", output.device());
  RS_CHECK(output.scalar_type() == dtype, "output dtype ", output.scalar_type(),
           " must equal the input's ", dtype);
  RS_CHECK(output.numel() == input.numel(), "output has ", output.numel(), " elements, input ",
           input.numel());
  RS_CHECK(input.is_contiguous() && output.is_contiguous(), "input and output must be contiguous");
  RS_CHECK(aligned(input.data_ptr(), 16) && aligned(output.data_ptr(), 16),
           "input and output must be 16-byte aligned");
  const int64_t bytes = input.numel() * input.element_size();
  RS_CHECK(bytes <= reg.base.capacity, "oneshot_all_reduce: ", bytes,
           " bytes exceed the registered capacity of ", reg.base.capacity,
           " (fall back to NCCL: OneShotAllReduce.eligible)");

  const c10::cuda::CUDAGuard guard(input.device());
  oneshot::Params p = reg.base;
  p.input = input.data_ptr();
  p.output = output.data_ptr();
  p.numel = input.numel();
  p.rank = static_cast<int>(rank);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err;
  switch (dtype) {
    case at::kBFloat16:
      err = oneshot::launch_oneshot_allreduce<__nv_bfloat16>(p, reg.world, reg.blocks, stream);
      break;
    case at::kHalf:
      err = oneshot::launch_oneshot_allreduce<__half>(p, reg.world, reg.blocks, stream);
      break;
    default:
      err = oneshot::launch_oneshot_allreduce<float>(p, reg.world, reg.blocks, stream);
      break;
  }
  RS_CHECK(err == cudaSuccess, "oneshot_all_reduce launch failed: ", cudaGetErrorString(err));
}

}  // namespace radixserve
