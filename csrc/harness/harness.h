// Tiny helpers shared by the standalone kernel harnesses (no torch): error checks, a seeded RNG,
// device buffers. Each harness exits non-zero on the first mismatch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#define HX_CHECK(call)                                                                      \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call,                 \
                   cudaGetErrorString(e_));                                                 \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

#define HX_EXPECT(cond, ...)                                                                \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                 \
      std::fprintf(stderr, __VA_ARGS__);                                                    \
      std::fprintf(stderr, "\n");                                                           \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace hx {

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t n = 0;
  explicit DeviceBuffer(size_t count) : n(count) { HX_CHECK(cudaMalloc(&ptr, (count ? count : 1) * sizeof(T))); }
  DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) {
    HX_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n);
    HX_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void poison(unsigned char byte = 0xAB) { HX_CHECK(cudaMemset(ptr, byte, n * sizeof(T))); }
};

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device: nothing to run (harness built fine)\n");
    return false;
  }
  return true;
}

// bf16 <-> float on the host (round to nearest even), without cuda_bf16's host intrinsics.
inline uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
inline float bf2f(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp16 <-> float on the host (round to nearest even, subnormals, overflow to inf), likewise
// without cuda_fp16's host intrinsics.
inline uint16_t f2h(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) return sign | (x > 0x7F800000u ? 0x7E00u : 0x7C00u);  // NaN, inf
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds past the largest half
  if (x < 0x38800000u) {                        // below 2^-14: a subnormal half, or zero
    const int shift = 126 - (int)(x >> 23);     // value / 2^-24 = mantissa >> shift
    if (shift > 24) return sign;
    const uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
    uint32_t h = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return sign | (uint16_t)h;
  }
  uint32_t h = (x >> 13) - (112u << 10);  // rebias the exponent from 127 to 15
  const uint32_t rem = x & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return sign | (uint16_t)h;
}
inline float h2f(uint16_t h) {
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  float f;
  if (e == 0) f = std::ldexp((float)m, -24);
  else if (e == 31) f = m ? NAN : INFINITY;
  else f = std::ldexp((float)(m | 0x400), e - 25);
  return (h & 0x8000u) ? -f : f;
}

}  // namespace hx
