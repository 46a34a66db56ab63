// FP8-weight skinny GEMM for decode: out[m, j] = w_scale[j] * sum_k x[m, k] * w[j, k] (+ bias[j])
// for up to 16 bf16 activation rows against an e4m3 weight [n, k] (nn.Linear layout, k
// contiguous) with per-output-channel (or per-tensor) fp32 scales. Header-only, no torch.
//
// Why: at batch 1-16 a decode step streams the weights; with FP8 weights it streams half the
// bytes of bf16, provided the dequantization costs no more than the memory it saves. The math
// stays bf16 x bf16 -> fp32 (issue 35: "FP8 weights, bf16 math"), on the tensor cores:
//
// Swap AB. The weight is the MMA's A operand (16 output columns j per warp tile, the M side of
// m16n8k16) and the activations its B operand (8 batch rows per n-tile; NT = 2 n-tiles cover 16
// rows), so a batch of 1..16 rows costs the same instructions per weight byte: the tensor cores
// do the per-row math that a CUDA-core GEMV repeats per row.
//
// Permuted k. A thread's fragment of m16n8k16 holds, for its group g = lane / 4 and thread
// t = lane % 4, logical k {2t, 2t+1} and {2t+8, 2t+9} of rows g and g + 8. Any bijection
// between logical and physical k gives the same sum as long as A and B use the same one, so
// thread (g, t) loads physical k [16 t, 16 t + 16) of a 64-wide k block with one 16-byte load
// per weight row (rows g and g + 8: 16 e4m3 values each) and two 16-byte loads of x (16 bf16 of
// batch row g), and MMA i (i = 0..3) takes bytes 4i..4i+3 of those: e4m3 bytes q0 q1 q2 q3 become
// the bf16 pairs (q0, q2) -> logical (2t, 2t+1) and (q1, q3) -> logical (2t+8, 2t+9), and x's
// pairs are permuted to match with one byte permute each.
//
// Dequantization is bit placement, no conversion instruction: an e4m3 byte s.eeee.mmm becomes the
// bf16 s.(64 + eeee).mmm0000, which is its value times 2^-56 for every normal e4m3 code (the
// exponent bias 7 against bf16's 127, offset by the 64 OR-ed in); four bytes of a 32-bit word
// give two bf16x2 words in 5 integer ops (3 shifts, 2 three-input logic ops). The 2^56 goes back
// with the channel scale at the end. The codes with exponent 0 (zero and e4m3's subnormals,
// |v| < 2^-6) decode to within 2^-6 of their value (zero to +-2^-7), against a weight range of
// +-448 and a quantization step of 2^-3 at 1.0: below anything the quantization itself resolves
// (tests compare with the dequantize-then-matmul reference at a tolerance of fp8 math).
//
// Split k inside the CTA. A CTA owns 16 output columns; its WARPS warps take interleaved 64-wide
// k blocks (warp w: blocks w, w + WARPS, ...), so they read 64 x WARPS contiguous bytes of each
// weight row per trip, and UNROLL blocks' loads are in flight per warp before their MMAs. The
// partial 16 x 16 tiles are summed through shared memory in a fixed order (deterministic),
// scaled, biased and written by the first 16 x m threads (kPlainWarps, kGatedWarps: below).
// Launched with programmatic dependent launch on sm_90+
// (pdl.cuh): the first trip's weight loads go out before waiting for the kernel that writes x.
//
// GATED (the MLP's gate|up projection fused with silu_and_mul, as gemv.cuh's GATED): w is
// [2 n, k] = [gate | up] rows and the CTA of output columns j..j+15 streams gate rows j.. and up
// rows n + j.. (two A tiles per warp, the same x fragments); each sum is scaled, biased and
// rounded to bf16 as the unfused kernel's output would be, then out = silu(g) * u as
// silu_and_mul computes it. The [m, 2 n] projection is never written. The two forms split k
// over different warp counts (kPlainWarps, kGatedWarps), so their fp32 sums, and so the bf16
// projections, may differ in the last place.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "radixserve/pdl.cuh"

namespace radixserve {
namespace fp8_gemv {

struct Params {
  const __nv_bfloat16* x;  // [m, k], row stride x_stride elements (rows 16-byte aligned)
  int64_t x_stride;
  const uint8_t* w;        // [n, k] e4m3 bytes, contiguous, 16-byte aligned
  const float* w_scale;    // [n] (scale_stride 1) or [1] (scale_stride 0), fp32
  int64_t scale_stride;
  const __nv_bfloat16* bias;  // [n] or nullptr
  __nv_bfloat16* out;      // [m, n], row stride out_stride elements
  int64_t out_stride;
  int m;                   // 1..kMaxRows
  int64_t n;
  int64_t k;               // a multiple of 16
  bool pdl;
  bool gated = false;      // w is [2 n, k] = [gate | up], out = silu(gate) * up (GATED above)
};

constexpr int kMaxRows = 16;   // two n-tiles of m16n8k16
constexpr int kCols = 16;      // output columns per CTA (the MMA's M)
// Warps per CTA (the in-CTA k split) and k blocks in flight per warp (UNROLL), per form. Same-run
// sweep on the H200 (bench/variants/fp8_gemv_sweep.cu: graphs of 32 launches over 32 weight
// copies, PDL; us at 1 / 8 / 16 rows), the Llama-3.1-8B shapes:
//   plain   8 warps x 4: q|k|v 9.66 / 9.96 / 14.75, o 8.45 / 8.36 / 8.94, down 25.42 / 30.42 / 27.60
//          16 warps x 2: q|k|v 9.63 / 10.70 / 12.34, o 6.24 / 6.60 / 7.74, down 18.66 / 18.14 / 23.68
//   gated   8 warps x 2: 35.52 / 37.76 / 45.90;  16 x 2: 41.31 / 42.01 / 52.76;  4 x 2: 44.48 at 1
// (bench/results/logs/fp8-gemv-sweep-h200.txt). A plain projection of n <= 6144 columns has few
// CTAs (one per 16 columns), so 16 warps put twice the loads in flight per CTA; the gated one
// (1,792 CTAs for 2 x 14,336 rows) already fills the device and does better with smaller CTAs.
constexpr int kPlainWarps = 16, kPlainUnroll = 2;
constexpr int kGatedWarps = 8, kGatedUnroll = 2;
constexpr int kBlockK = 64;    // k per warp per block: 16 bytes of e4m3 per thread per row
constexpr float kDequantScale = 72057594037927936.0f;  // 2^56: see the header comment

// The epilogue both skinny kernels share (this one and fp8_gemv_cc.cuh's). Weight row jr's output
// before any activation: its fp32 sum times the row's dequantization scale, plus its bias,
// rounded step by step (no fma contraction, whichever instantiation the compiler schedules).
__device__ __forceinline__ float scaled_row(const Params& p, int64_t jr, float acc) {
  float v = __fmul_rn(acc, p.w_scale[jr * p.scale_stride] * kDequantScale);
  if (p.bias) v = __fadd_rn(v, __bfloat162float(p.bias[jr]));
  return v;
}
// The gated form's activation: silu(gate) * up, each projection rounded to bf16 first, as the
// unfused path rounds them before silu_and_mul computes in fp32.
__device__ __forceinline__ float gated_silu(float gate, float up) {
  gate = __bfloat162float(__float2bfloat16_rn(gate));
  up = __bfloat162float(__float2bfloat16_rn(up));
  return gate / (1.f + __expf(-gate)) * up;
}

// Two bf16x2 words from four e4m3 bytes v = [q3 q2 q1 q0]: lo = (q0, q2), hi = (q1, q3), each
// the e4m3 value times 2^-56 (header comment).
__device__ __forceinline__ void dequant4(uint32_t v, uint32_t& lo, uint32_t& hi) {
  lo = ((v << 4) & 0x07f007f0u) | ((v << 8) & 0x80008000u) | 0x20002000u;
  hi = ((v >> 4) & 0x07f007f0u) | (v & 0x80008000u) | 0x20002000u;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

// NT n-tiles of 8 batch rows (m <= 8 * NT); UNROLL k blocks' loads in flight per warp; GATED:
// two A tiles (gate rows, up rows) per warp and the activation in the epilogue.
template <int NT, int UNROLL, bool GATED, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) fp8_skinny_kernel(Params p) {
  constexpr int kWarps = WARPS;
  constexpr int TILES = GATED ? 2 : 1;  // A tiles per warp: [gate, up] or the plain rows
  __shared__ float red[kWarps][TILES][kCols][8 * NT];
  pdl_launch_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t col0 = (int64_t)blockIdx.x * kCols;
  // rows g and g + 8 of each tile; past n, re-read the tile's last row (never stored)
  const uint4* w0[TILES];
  const uint4* w1[TILES];
#pragma unroll
  for (int ti = 0; ti < TILES; ++ti) {
    const int64_t base = ti * p.n;  // the up rows follow the n gate rows
    const int64_t r0 = base + min(col0 + g, p.n - 1), r1 = base + min(col0 + g + 8, p.n - 1);
    w0[ti] = reinterpret_cast<const uint4*>(p.w + r0 * p.k);
    w1[ti] = reinterpret_cast<const uint4*>(p.w + r1 * p.k);
  }
  const int64_t chunks = p.k / 16;                 // 16-byte chunks of a weight row
  const int64_t blocks = (chunks + 3) / 4;         // 64-wide k blocks

  float c[TILES][NT][4] = {};
  uint4 wa[TILES][UNROLL], wb[TILES][UNROLL];
  auto load_w = [&](int64_t b0) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t ch = (b0 + (int64_t)u * kWarps) * 4 + t;
      const bool ok = b0 + (int64_t)u * kWarps < blocks && ch < chunks;
#pragma unroll
      for (int ti = 0; ti < TILES; ++ti) {
        wa[ti][u] = ok ? __ldcs(w0[ti] + ch) : make_uint4(0, 0, 0, 0);
        wb[ti][u] = ok ? __ldcs(w1[ti] + ch) : make_uint4(0, 0, 0, 0);
      }
    }
  };
  load_w(warp);
  pdl_wait();  // x (and out) belong to the kernels before this one
  for (int64_t b0 = warp; b0 < blocks; b0 += (int64_t)UNROLL * kWarps) {
    if (b0 != warp) load_w(b0);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t ch = (b0 + (int64_t)u * kWarps) * 4 + t;
      if (b0 + (int64_t)u * kWarps >= blocks) break;
      // x chunk: 16 bf16 of batch row (g + 8 * nt) at physical k [16 ch, 16 ch + 16)
      uint4 xa[NT], xb[NT];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int row = g + 8 * nt;
        if (row < p.m && ch < chunks) {
          const uint4* xr = reinterpret_cast<const uint4*>(p.x + row * p.x_stride) + 2 * ch;
          xa[nt] = __ldg(xr);
          xb[nt] = __ldg(xr + 1);
        } else {
          xa[nt] = xb[nt] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int ti = 0; ti < TILES; ++ti) {
        const uint32_t wav[4] = {wa[ti][u].x, wa[ti][u].y, wa[ti][u].z, wa[ti][u].w};
        const uint32_t wbv[4] = {wb[ti][u].x, wb[ti][u].y, wb[ti][u].z, wb[ti][u].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          uint32_t a0, a2, a1, a3;
          dequant4(wav[i], a0, a2);   // row g:     (q0, q2), (q1, q3)
          dequant4(wbv[i], a1, a3);   // row g + 8
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            // x words of physical k 4i..4i+3 of this chunk: (x0, x1), (x2, x3)
            const uint32_t xw[8] = {xa[nt].x, xa[nt].y, xa[nt].z, xa[nt].w,
                                    xb[nt].x, xb[nt].y, xb[nt].z, xb[nt].w};
            const uint32_t x01 = xw[2 * i], x23 = xw[2 * i + 1];
            const uint32_t b0 = byte_perm(x01, x23, 0x5410);  // (x0, x2)
            const uint32_t b1 = byte_perm(x01, x23, 0x7632);  // (x1, x3)
            mma_bf16(c[ti][nt], a0, a1, a2, a3, b0, b1);
          }
        }
      }
    }
  }
  // c[ti][nt]: (col g, batch 8nt + 2t), (col g, 8nt + 2t + 1), (col g + 8, 8nt + 2t), (col g + 8, ...)
#pragma unroll
  for (int ti = 0; ti < TILES; ++ti)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      red[warp][ti][g][8 * nt + 2 * t] = c[ti][nt][0];
      red[warp][ti][g][8 * nt + 2 * t + 1] = c[ti][nt][1];
      red[warp][ti][g + 8][8 * nt + 2 * t] = c[ti][nt][2];
      red[warp][ti][g + 8][8 * nt + 2 * t + 1] = c[ti][nt][3];
    }
  __syncthreads();
  const int tid = threadIdx.x;
  if (tid >= kCols * p.m) return;
  const int col = tid % kCols, row = tid / kCols;
  const int64_t j = col0 + col;
  if (j >= p.n) return;
  float v[TILES];
#pragma unroll
  for (int ti = 0; ti < TILES; ++ti) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w][ti][col][row];
    v[ti] = scaled_row(p, ti * p.n + j, s);  // the weight row (GATED: gate j, up n + j)
  }
  if constexpr (GATED) v[0] = gated_silu(v[0], v[1]);
  p.out[row * p.out_stride + j] = __float2bfloat16_rn(v[0]);
}

inline cudaError_t launch(const Params& p, cudaStream_t stream) {
  if (p.m == 0 || p.n == 0) return cudaSuccess;
  if (p.m < 1 || p.m > kMaxRows || p.k % 16 != 0) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)((p.n + kCols - 1) / kCols));
  constexpr int GW = kGatedWarps, GU = kGatedUnroll, PW = kPlainWarps, PU = kPlainUnroll;
  if (p.gated) {
    const dim3 block(GW * 32);
    if (p.m <= 8) return launch_with_pdl(p.pdl, fp8_skinny_kernel<1, GU, true, GW>, grid, block, 0, stream, p);
    return launch_with_pdl(p.pdl, fp8_skinny_kernel<2, GU, true, GW>, grid, block, 0, stream, p);
  }
  const dim3 block(PW * 32);
  if (p.m <= 8) return launch_with_pdl(p.pdl, fp8_skinny_kernel<1, PU, false, PW>, grid, block, 0, stream, p);
  return launch_with_pdl(p.pdl, fp8_skinny_kernel<2, PU, false, PW>, grid, block, 0, stream, p);
}

}  // namespace fp8_gemv
}  // namespace radixserve
