// Hopper warpgroup MMA (wgmma) building blocks for the sm_90a attention kernels: shared-memory
// matrix descriptors for the 128-byte-swizzled layout, the fence / commit / wait protocol, and
// the three wgmma shapes the extend kernel issues. Everything here exists only when compiling
// for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); callers guard their use the same way.
//
// Shared-memory layout the descriptors assume ("SW128"): a tile of R rows x C 16-bit elements
// (C a multiple of 64) is stored as C/64 column blocks, each R rows of 128 bytes; 16-byte chunk
// c (0..7) of row r of a block sits at chunk c ^ (r & 7). Every block starts 1024-byte aligned,
// so the XOR pattern is the one the hardware applies to address bits [4,7) from bits [7,10).
//   K-major operand (rows = M or N, columns = the reduction dim K): a k16 step is 32 bytes of
//     one row; the descriptor starts at block (k / 64), byte 2 * (k % 64) of row 0; 8-row groups
//     are 1024 bytes apart (stride byte offset); leading byte offset unused (1).
//   MN-major operand (rows = K, columns = N): a k16 step is 16 rows = 2048 bytes; 8-row groups
//     are 1024 bytes apart (stride byte offset); successive 64-column blocks of N are R * 128
//     bytes apart (leading byte offset).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace radixserve {
namespace attn {
namespace wgmma {

// element offset of (row, 16-byte chunk) in an SW128 tile of `rows` rows
__device__ __forceinline__ int sw128_offset(int rows, int row, int chunk) {
  return (chunk >> 3) * rows * 64 + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// matrix descriptor: start address, leading / stride byte offsets, 128-byte swizzle
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                              uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= (uint64_t)((smem_addr & 0x3FFFF) >> 4);
  d |= (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= (uint64_t)((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= (uint64_t)1 << 62;  // layout type 1: 128-byte swizzle
  return d;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to wgmma's
// operand reads (async proxy) after this fence, issued by the writing thread, plus a barrier.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins registers an in-flight wgmma reads or writes: the compiler may not move their other uses
// across this point (it sees a write), nor reuse them before it (it sees a read).
template <int N>
__device__ __forceinline__ void fence_operand(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_operand(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// D[64 x N] (+)= A[64 x 16] (smem, K-major) * B[16 x N] (smem, K-major); scale_d = 0 overwrites
template <typename T>
__device__ __forceinline__ void wgmma_ss_m64n128k16(float (&d)[64], uint64_t a, uint64_t b, int scale_d);
// D[64 x N] (+)= A[64 x 16] (registers) * B[16 x N] (smem, MN-major: "transposed")
template <typename T>
__device__ __forceinline__ void wgmma_rs_tb_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                       int scale_d);
template <typename T>
__device__ __forceinline__ void wgmma_rs_tb_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                      int scale_d);
// D[64 x 128] (+)= A[64 x 16] (registers) * B[16 x 128] (smem, K-major)
template <typename T>
__device__ __forceinline__ void wgmma_rs_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                    int scale_d);

// ---- operand lists and one specialisation per shape and input type
// the accumulator registers of one thread: 64 (n128) or 32 (n64) fp32 values of d
#define RS_WGMMA_REGS64 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7,"  \
  "%8, %9, %10, %11, %12, %13, %14, %15,"  \
  "%16, %17, %18, %19, %20, %21, %22, %23,"  \
  "%24, %25, %26, %27, %28, %29, %30, %31,"  \
  "%32, %33, %34, %35, %36, %37, %38, %39,"  \
  "%40, %41, %42, %43, %44, %45, %46, %47,"  \
  "%48, %49, %50, %51, %52, %53, %54, %55,"  \
  "%56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define RS_WGMMA_REGS32 \
  "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7,"  \
  "%8, %9, %10, %11, %12, %13, %14, %15,"  \
  "%16, %17, %18, %19, %20, %21, %22, %23,"  \
  "%24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define RS_WGMMA_ACC64(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define RS_WGMMA_ACC32(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])


// One specialisation per shape and input type; CT the C++ element type, TS its PTX name.
// SS, n128: operands %64 = a, %65 = b, %66 = scale_d
#define RS_WGMMA_SS_N128(CT, TS)                                                                  \
  template <>                                                                                    \
  __device__ __forceinline__ void wgmma_ss_m64n128k16<CT>(float (&d)[64], uint64_t a, uint64_t b, \
                                                          int scale_d) {                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TS "." TS " " RS_WGMMA_REGS64     \
                 ", %64, %65, p, 1, 1, 0, 0;\n}\n"                                                \
                 : RS_WGMMA_ACC64(d)                                                             \
                 : "l"(a), "l"(b), "r"(scale_d));                                                \
  }
// RS, n128: %64..%67 = a, %68 = b, %69 = scale_d; TB the imm-trans-b flag ("1": B MN-major,
// "0": B K-major), FN the function it specialises
#define RS_WGMMA_RS_N128(FN, TB, CT, TS)                                                          \
  template <>                                                                                    \
  __device__ __forceinline__ void FN<CT>(float (&d)[64], const uint32_t (&a)[4], uint64_t b,    \
                                         int scale_d) {                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32." TS "." TS " " RS_WGMMA_REGS64     \
                 ", {%64, %65, %66, %67}, %68, p, 1, 1, " TB ";\n}\n"                            \
                 : RS_WGMMA_ACC64(d)                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));            \
  }
// RS, n64, B transposed: %32..%35 = a, %36 = b, %37 = scale_d
#define RS_WGMMA_RS_TB_N64(CT, TS)                                                                \
  template <>                                                                                    \
  __device__ __forceinline__ void wgmma_rs_tb_m64n64k16<CT>(                                     \
      float (&d)[32], const uint32_t (&a)[4], uint64_t b, int scale_d) {                         \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                    \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TS "." TS " " RS_WGMMA_REGS32      \
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"                                  \
                 : RS_WGMMA_ACC32(d)                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));            \
  }

RS_WGMMA_RS_N128(wgmma_rs_m64n128k16, "0", __nv_bfloat16, "bf16")
RS_WGMMA_RS_N128(wgmma_rs_m64n128k16, "0", __half, "f16")
RS_WGMMA_SS_N128(__nv_bfloat16, "bf16")
RS_WGMMA_SS_N128(__half, "f16")
RS_WGMMA_RS_N128(wgmma_rs_tb_m64n128k16, "1", __nv_bfloat16, "bf16")
RS_WGMMA_RS_N128(wgmma_rs_tb_m64n128k16, "1", __half, "f16")
RS_WGMMA_RS_TB_N64(__nv_bfloat16, "bf16")
RS_WGMMA_RS_TB_N64(__half, "f16")

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace wgmma
}  // namespace attn
}  // namespace radixserve
