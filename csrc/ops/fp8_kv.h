// Host helpers of the FP8 KV cache shared by kv.cu, elementwise.cu and attention.cu: which pool
// dtypes are FP8, and the checked fp32 1 / scale that the store kernels multiply by (the value
// ops/reference.py's quantize_fp8 uses: 1 / scale in double, rounded to fp32).
#pragma once

#include <cmath>
#include <string>

#include <ATen/ATen.h>

#include "ops/check.h"

namespace radixserve {

inline bool is_fp8_kv_dtype(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// a k_scale / v_scale of an FP8 cache: finite and > 0
inline void check_fp8_scale(double scale, const char* name) {
  RS_CHECK(std::isfinite(scale) && scale > 0, name, " must be finite and > 0, got ",
           std::to_string(scale));
}

inline float fp8_inv_scale(double scale, const char* name) {
  check_fp8_scale(scale, name);
  return (float)(1.0 / scale);
}

}  // namespace radixserve
