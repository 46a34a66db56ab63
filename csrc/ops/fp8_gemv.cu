// fp8_skinny_linear: input checks, launch on the current stream.
// Kernels: csrc/include/radixserve/fp8_gemv.cuh (tensor cores, 1..16 rows) and fp8_gemv_cc.cuh
// (CUDA cores, 1..4 rows). Contract: pysrc/radixserve/ops/__init__.py.
#include <optional>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include "ops/check.h"
#include "ops/ops.h"
#include "radixserve/fp8_gemv.cuh"
#include "radixserve/fp8_gemv_cc.cuh"

namespace radixserve {

at::Tensor fp8_skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                             bool gated, int64_t cuda_core_rows) {
  RS_CHECK(x.is_cuda() && weight.is_cuda() && weight_scale.is_cuda() &&
               weight.device() == x.device() && weight_scale.device() == x.device(),
           "x, weight and weight_scale must be CUDA tensors on one device");
  RS_CHECK(x.scalar_type() == at::kBFloat16, "fp8_skinny_linear takes bf16 activations, got ",
           x.scalar_type());
  RS_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn, "weight must be float8_e4m3fn, got ",
           weight.scalar_type());
  RS_CHECK(weight_scale.scalar_type() == at::kFloat, "weight_scale must be float32, got ",
           weight_scale.scalar_type());
  RS_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [m, k] and weight [n, k]");
  // rows: the weight's (gated: [gate | up], 2 n of them); n: the output's columns
  const int64_t m = x.size(0), k = x.size(1), rows = weight.size(0);
  RS_CHECK(!gated || rows % 2 == 0, "a gated weight holds [gate | up]: an even row count, got ", rows);
  const int64_t n = gated ? rows / 2 : rows;
  RS_CHECK(m >= 1 && m <= fp8_gemv::kMaxRows, "fp8_skinny_linear serves 1..", fp8_gemv::kMaxRows,
           " rows, got ", m);
  RS_CHECK(weight.size(1) == k, "weight must be [n, k=", k, "], got ", weight.sizes());
  RS_CHECK(k >= 16 && k % 16 == 0, "k must be a positive multiple of 16, got ", k);
  RS_CHECK(weight.is_contiguous() && (reinterpret_cast<uintptr_t>(weight.data_ptr()) & 15) == 0,
           "weight must be contiguous and 16-byte aligned");
  RS_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 &&
               (reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) == 0,
           "x rows must be contiguous and start at 16-byte boundaries");
  RS_CHECK(weight_scale.is_contiguous() && (weight_scale.numel() == rows || weight_scale.numel() == 1),
           "weight_scale must hold one scale per weight row [", rows, "] or one in all");
  if (bias) {
    RS_CHECK(bias->is_cuda() && bias->device() == x.device() && bias->scalar_type() == at::kBFloat16,
             "bias must be a bf16 CUDA tensor on x's device");
    RS_CHECK(bias->dim() == 1 && bias->size(0) == rows && bias->is_contiguous(),
             "bias must be contiguous [", rows, "]");
  }
  // up to this many rows run on the CUDA-core kernel (-1: where it serves by default)
  RS_CHECK(cuda_core_rows >= -1 && cuda_core_rows <= fp8_gemv_cc::kMaxRows,
           "cuda_core_rows must be -1 (the default) or 0..", fp8_gemv_cc::kMaxRows, ", got ",
           cuda_core_rows);
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = at::empty({m, n}, x.options());  // [m, n]
  fp8_gemv::Params p;
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.x_stride = x.stride(0);
  p.w = reinterpret_cast<const uint8_t*>(weight.data_ptr());
  p.w_scale = weight_scale.data_ptr<float>();
  p.scale_stride = weight_scale.numel() == 1 && rows != 1 ? 0 : 1;
  p.bias = bias ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  p.out_stride = out.stride(0);
  p.m = static_cast<int>(m);
  p.n = n;
  p.k = k;
  p.pdl = at::cuda::getCurrentDeviceProperties()->major >= 9;
  p.gated = gated;
  const bool cuda_cores = cuda_core_rows < 0 ? fp8_gemv_cc::serves_by_default(p) : m <= cuda_core_rows;
  const cudaError_t err = cuda_cores ? fp8_gemv_cc::launch(p, at::cuda::getCurrentCUDAStream())
                                     : fp8_gemv::launch(p, at::cuda::getCurrentCUDAStream());
  RS_CHECK(err == cudaSuccess, "fp8_skinny_linear launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace radixserve
