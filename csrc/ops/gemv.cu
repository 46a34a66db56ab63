// skinny_linear: input checks, dtype dispatch, launch on the current stream.
// Kernel: csrc/include/radixserve/gemv.cuh. Contract: pysrc/radixserve/ops/__init__.py.
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/gemv.cuh"

namespace radixserve {
namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

void check_skinny_inputs(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool gated) {
  RS_CHECK(x.is_cuda() && weight.is_cuda() && weight.device() == x.device(),
           "x and weight must be CUDA tensors on one device");
  const auto dtype = x.scalar_type();
  RS_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "skinny_linear takes bf16 or fp16, got ", dtype);
  RS_CHECK(weight.scalar_type() == dtype, "weight dtype ", weight.scalar_type(), " must equal x dtype ", dtype);
  RS_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [m, k] and weight [n, k]");
  const int64_t m = x.size(0), k = x.size(1);
  RS_CHECK(m >= 1 && m <= gemv::kMaxRows, "skinny_linear serves 1..", gemv::kMaxRows, " rows, got ", m);
  RS_CHECK(weight.size(1) == k, "weight must be [n, k=", k, "], got ", weight.sizes());
  RS_CHECK(k >= 8 && k % 8 == 0, "k must be a positive multiple of 8, got ", k);
  RS_CHECK(!gated || weight.size(0) % 2 == 0, "a gated weight must be [2 * n, k], got ", weight.sizes());
  RS_CHECK(weight.is_contiguous() && aligned16(weight.data_ptr()), "weight must be contiguous and 16-byte aligned");
  RS_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned16(x.data_ptr()),
           "x rows must be contiguous and start at 16-byte boundaries");
  if (bias) {
    RS_CHECK(bias->is_cuda() && bias->device() == x.device() && bias->scalar_type() == dtype,
             "bias must be a CUDA tensor of x's device and dtype");
    RS_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->is_contiguous(),
             "bias must be contiguous [", weight.size(0), "]");
  }
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool gated) {
  check_skinny_inputs(x, weight, bias, gated);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = gated ? weight.size(0) / 2 : weight.size(0);
  auto out = at::empty({x.size(0), n}, x.options());  // [m, n]
  gemv::SkinnyParams p;
  p.x = x.data_ptr();
  p.x_stride = x.stride(0);
  p.w = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.m = static_cast<int>(x.size(0));
  p.n = n;
  p.k = x.size(1);
  p.pdl = at::cuda::getCurrentDeviceProperties()->major >= 9;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cudaError_t err;
  if (x.scalar_type() == at::kBFloat16)
    err = gated ? gemv::launch_skinny_gemm<__nv_bfloat16, true>(p, stream)
                : gemv::launch_skinny_gemm<__nv_bfloat16, false>(p, stream);
  else
    err = gated ? gemv::launch_skinny_gemm<__half, true>(p, stream)
                : gemv::launch_skinny_gemm<__half, false>(p, stream);
  RS_CHECK(err == cudaSuccess, "skinny_linear launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace radixserve
