// FP8 KV-cache pages (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): the conversions the store and
// attention kernels share. Header-only, no torch.
//
// Store: x (bf16 / fp16 / fp32) -> fp8(fp32(x) * fp32(1 / scale)), saturated to the format's
// largest finite value (a NaN stays NaN), rounded to nearest even: cvt.rn.satfinite (cuda_fp8.h),
// which is what the torch reference (ops/reference.py quantize_fp8) computes, so the bytes agree.
//
// Load: FP8 -> fp16, exactly, by bit placement (no conversion instruction):
//   e5m2 is the upper byte of an fp16 (same exponent width and bias): byte << 8.
//   e4m3 s.eeee.mmm placed as the fp16 s.0eeee.mmm0000000 is its value times 2^-8 for every
//   code, subnormals included (e4m3's exponent-0 codes land on fp16's exponent-0 codes, whose
//   scale is 2^-14 = 2^-6 * 2^-8), so one fp16 multiply by 2^8 (exact; fp16 arithmetic keeps
//   subnormals) gives the value. Every e4m3 and e5m2 value is an fp16 value.
// Four bytes v = [b3 b2 b1 b0] give two f16x2 words lo = (b0, b2), hi = (b1, b3) (low half
// first): the mma kernels pair them with k or token permutations that match (see the kernels);
// to_half8 / to_float8 reorder them into natural order.
// The attention kernels never multiply by the scales per element: k_scale is folded into the
// softmax scale and v_scale into the output's normalisation (DecodeParams / ExtendParams).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace radixserve {
namespace fp8 {

template <typename KV>
struct Traits {
  static constexpr bool kIsFp8 = false;
};

template <>
struct Traits<__nv_fp8_e4m3> {
  static constexpr bool kIsFp8 = true;
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E4M3;
  static __device__ __forceinline__ void to_half2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
    const uint32_t l = ((v << 7) & 0x3f803f80u) | ((v << 8) & 0x80008000u);
    const uint32_t h = ((v >> 1) & 0x3f803f80u) | (v & 0x80008000u);
    const __half2 k256 = __half2half2(__ushort_as_half((unsigned short)0x5c00));  // 2^8
    __half2 a = __hmul2(*reinterpret_cast<const __half2*>(&l), k256);
    __half2 b = __hmul2(*reinterpret_cast<const __half2*>(&h), k256);
    lo = *reinterpret_cast<uint32_t*>(&a);
    hi = *reinterpret_cast<uint32_t*>(&b);
  }
};

template <>
struct Traits<__nv_fp8_e5m2> {
  static constexpr bool kIsFp8 = true;
  static constexpr __nv_fp8_interpretation_t kInterp = __NV_E5M2;
  static __device__ __forceinline__ void to_half2x2(uint32_t v, uint32_t& lo, uint32_t& hi) {
    lo = (v << 8) & 0xff00ff00u;
    hi = v & 0xff00ff00u;
  }
};

template <typename KV>
__host__ __device__ constexpr bool is_fp8() {
  return Traits<KV>::kIsFp8;
}

// 8 FP8 values (bytes 0..7 of w) -> 8 fp16 in natural order (one 16-byte vector)
template <typename F8>
__device__ __forceinline__ uint4 to_half8(uint2 w) {
  // [b3 b2 b1 b0] -> [b3 b1 b2 b0], so that lo = (b0, b1) and hi = (b2, b3)
  const uint32_t x = __byte_perm(w.x, 0u, 0x3120);
  const uint32_t y = __byte_perm(w.y, 0u, 0x3120);
  uint4 r;
  Traits<F8>::to_half2x2(x, r.x, r.y);
  Traits<F8>::to_half2x2(y, r.z, r.w);
  return r;
}

// 8 FP8 values (bytes 0..7 of w) -> fp32, natural order
template <typename F8>
__device__ __forceinline__ void to_float8(uint2 w, float (&f)[8]) {
  const uint4 h = to_half8<F8>(w);
  const uint32_t words[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// bf16x2 / f16x2 word -> f16x2 (bf16: rounded to nearest; q values of a model are far inside
// fp16's range)
template <typename T>
__device__ __forceinline__ uint32_t to_half2_word(uint32_t x) {
  if constexpr (std::is_same<T, __half>::value) {
    return x;
  } else {
    const float lo = __uint_as_float(x << 16), hi = __uint_as_float(x & 0xffff0000u);
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// --------------------------------------------------------------------------- store

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  if constexpr (std::is_same<T, float>::value) return x;
  else if constexpr (std::is_same<T, __half>::value) return __half2float(x);
  else return __bfloat162float(x);
}

template <typename F8>
__device__ __forceinline__ uint8_t quantize(float x, float inv_scale) {
  return (uint8_t)__nv_cvt_float_to_fp8(x * inv_scale, __NV_SATFINITE, Traits<F8>::kInterp);
}

// 8 values of T (16 or 32 bytes at src, 16-byte aligned) -> 8 FP8 bytes
template <typename T, typename F8>
__device__ __forceinline__ uint2 quantize8(const T* src, float inv_scale) {
  float f[8];
  if constexpr (sizeof(T) == 4) {
    const float4 a = reinterpret_cast<const float4*>(src)[0];
    const float4 b = reinterpret_cast<const float4*>(src)[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(src);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
  }
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = __nv_cvt_float2_to_fp8x2(make_float2(f[2 * i] * inv_scale, f[2 * i + 1] * inv_scale),
                                    __NV_SATFINITE, Traits<F8>::kInterp);
  return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// One token's k row and v row (row_elems values of T each) quantized into FP8 pool rows kd / vd,
// thread threadIdx.x of blockDim.x taking every blockDim.x-th group of 8 (vec8: row_elems % 8 == 0,
// k / v rows 16-byte aligned, pool rows 8-byte aligned) or element. The FP8 counterpart of
// kv::copy_kv_row, shared by store_kv and rotary_embedding_store_kv.
template <typename T, typename F8>
__device__ __forceinline__ void quantize_kv_row(uint8_t* kd, uint8_t* vd, const T* ks, const T* vs,
                                                int64_t row_elems, float k_inv, float v_inv,
                                                bool vec8) {
  if (vec8) {
    const int64_t groups = row_elems / 8;
    for (int64_t i = threadIdx.x; i < groups; i += blockDim.x) {
      const uint2 a = quantize8<T, F8>(ks + i * 8, k_inv);
      const uint2 b = quantize8<T, F8>(vs + i * 8, v_inv);
      reinterpret_cast<uint2*>(kd)[i] = a;
      reinterpret_cast<uint2*>(vd)[i] = b;
    }
  } else {
    for (int64_t i = threadIdx.x; i < row_elems; i += blockDim.x) {
      kd[i] = quantize<F8>(to_float(ks[i]), k_inv);
      vd[i] = quantize<F8>(to_float(vs[i]), v_inv);
    }
  }
}

}  // namespace fp8
}  // namespace radixserve
