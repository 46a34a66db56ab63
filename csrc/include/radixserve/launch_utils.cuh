// Host-side launch helpers shared by the kernel families. Header-only, torch-free.
#pragma once

#include <atomic>
#include <cstdint>

#include <cuda_runtime.h>

namespace radixserve {

// cudaFuncSetAttribute(MaxDynamicSharedMemorySize) once per kernel and device, not on every
// launch: the driver call costs about as much host time as a small kernel takes on the GPU
// (measured on the H200: eager decode attention went from 0.735 to 0.824 of copy bandwidth
// when it left the launch path).
template <auto kKernel>
cudaError_t set_max_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done{0};  // per kernel; bit d: set on device d (devices 0..63)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const uint64_t bit = dev < 64 ? (uint64_t(1) << dev) : 0;
  if (bit && (done.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

}  // namespace radixserve
