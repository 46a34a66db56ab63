// Paged extend (prefill) attention for Hopper (sm_90a) on warpgroup MMA (wgmma).
//
// Same contract and grid as paged_extend_kernel (extend_attention.cuh): one CTA = one tile of
// kBM query rows of one request and one q head; tiles handed out last-first by
// find_extend_tile. Differences:
//   * 2 warpgroups of 4 warps; warpgroup w owns query rows [64 w, 64 w + 64) of the tile.
//   * S = Q K^T is one wgmma chain per KV tile: A = Q and B = K straight from shared memory
//     (K-major descriptors), m64 n128 k16, fp32 accumulators in registers (64 per thread).
//   * P = softmax numerators stay in registers, repacked as the A operand of O += P V (the
//     accumulator and A-fragment layouts match), B = V from shared memory read MN-major. P is
//     rounded to T before it enters the row sum as well (see the softmax).
//   * Q, K and V tiles use the SW128 layout of wgmma.cuh; K/V rows are gathered by slot index
//     with cp.async (zero-filled past the request's KV), two stages, the next tile's slot
//     indices fetched one tile ahead, exactly as the mma.sync kernel does.
// Per KV tile: barrier (tile n landed, tile n - 1 fully consumed) -> issue loads of tile n + 1
// -> S wgmmas -> mask + online softmax (fp32, log2 domain) -> PV wgmmas -> wait, with the two
// warpgroups taking turns on the tensor cores (ping-pong, named barriers 1 and 2) so that one's
// softmax runs under the other's products.
// Measured (H200, 4k causal, 32 heads, d128, bench/variants sweep in one run): lockstep 330 TFLOP/s,
// ping-pong 344, + skipping the O rescale when no row max moved 350. ncu at 344: tensor pipe
// 37% busy, 2 warps per scheduler, 37% of warp stalls at barriers (turns and the per-tile
// __syncthreads) and 17% on fixed-latency dependencies: the softmax of one warp per scheduler
// is latency-bound. The next step is a producer warp and an S(n + 1) / softmax(n) overlap inside
// each warpgroup (FA3), which needs registers freed by setmaxnreg.
#pragma once

#include <cstdint>

#include "radixserve/attention_common.cuh"
#include "radixserve/extend_attention.cuh"
#include "radixserve/wgmma.cuh"

namespace radixserve {
namespace attn {
namespace sm90 {

constexpr int kBM = 128;       // query rows per CTA: 2 warpgroups x 64
constexpr int kBN = 128;       // KV rows per tile
constexpr int kThreads = 256;
// Named barriers 1 and 2 (0 is __syncthreads) hand the tensor cores from one warpgroup to the
// other: barrier 1 + w is warpgroup w's turn. One warpgroup arrives, the other syncs.
template <int kId>
__device__ __forceinline__ void bar_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId>
__device__ __forceinline__ void bar_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
__device__ __forceinline__ void turn_wait(int wg) {   // until it is warpgroup wg's turn
  if (wg == 0) bar_sync<1>(); else bar_sync<2>();
}
__device__ __forceinline__ void turn_pass(int wg) {   // to the other warpgroup
  if (wg == 0) bar_arrive<2>(); else bar_arrive<1>();
}

template <int D>
constexpr int extend_smem_bytes() {
  // Q tile + 2 stages of K + 2 stages of V, 2-byte elements, + slack to align to 1024 bytes
  return (kBM * D + 4 * kBN * D) * 2 + 1024;
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) paged_extend_kernel(const ExtendParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  constexpr int BM = kBM;
  constexpr int BN = kBN;
  constexpr int kChunks = D / 8;                       // 16-byte chunks per row
  constexpr int kRowsPerPass = kThreads / kChunks;     // rows one pass of loads covers
  constexpr int kKvPasses = BN / kRowsPerPass;
  constexpr int kQPasses = BM / kRowsPerPass;
  constexpr int kSN = BN / 2;                          // S accumulators per thread (m64 nBN)
  constexpr int kON = D / 2;                           // O accumulators per thread (m64 nD)
  constexpr int kTileBytesK = BN * D * 2;

  extern __shared__ unsigned char smem_raw[];
  // 1024-byte alignment: the swizzle pattern of every tile starts on a 1024-byte boundary
  const uint32_t raw_addr = smem_u32(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr));
  T* sK = sQ + BM * D;          // [2][BN rows, SW128]
  T* sV = sK + 2 * BN * D;      // [2][BN rows, SW128]

  __shared__ int s_req, s_tile;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg = warp / 4;          // warpgroup: query rows [64 wg, 64 wg + 64)
  const int qh = blockIdx.y;
  const int kvh = qh / p.group;

  if (warp == 0) find_extend_tile<BM>(p, lane, &s_req, &s_tile);
  __syncthreads();
  const int b = s_req;
  if (b < 0) return;
  const ExtendTile tl = extend_tile<BM, BN>(p, b, s_tile);
  const int m0 = tl.m0, qo_start = tl.qo_start, qo_len = tl.qo_len, kv_start = tl.kv_start;
  const int kv_len = tl.kv_len, prefix = tl.prefix, n_tiles = tl.n_tiles;
  const int first_masked = tl.first_masked;

  const T* qg = static_cast<const T*>(p.q);
  const T* kg = static_cast<const T*>(p.k) + (int64_t)kvh * p.kv_stride_h;
  const T* vg = static_cast<const T*>(p.v) + (int64_t)kvh * p.kv_stride_h;
  const int32_t* idx = p.kv_indices + kv_start;

  const int ld_chunk = tid % kChunks;
  const int ld_row = tid / kChunks;

  // ---- Q tile -> shared memory (rows past the request's queries are zero)
#pragma unroll
  for (int i = 0; i < kQPasses; ++i) {
    const int r = ld_row + i * kRowsPerPass;
    const bool ok = m0 + r < qo_len;
    const T* src = qg + (ok ? ((int64_t)(qo_start + m0 + r) * p.q_stride_t +
                               (int64_t)qh * p.q_stride_h + ld_chunk * 8)
                            : 0);
    cp_async_16(smem_u32(sQ + wgmma::sw128_offset(BM, r, ld_chunk)), src, ok);
  }

  int slots[kKvPasses];
  auto fetch_slots = [&](int tile_n) {
#pragma unroll
    for (int i = 0; i < kKvPasses; ++i) {
      const int pos = tile_n * BN + ld_row + i * kRowsPerPass;
      slots[i] = pos < kv_len ? __ldg(idx + pos) : -1;
    }
  };
  auto load_kv = [&](int stage) {
    T* dk = sK + stage * BN * D;
    T* dv = sV + stage * BN * D;
#pragma unroll
    for (int i = 0; i < kKvPasses; ++i) {
      const int r = ld_row + i * kRowsPerPass;
      const bool ok = slots[i] >= 0;
      const int64_t off = ok ? (int64_t)slots[i] * p.kv_stride_slot + ld_chunk * 8 : 0;
      const int so = wgmma::sw128_offset(BN, r, ld_chunk);
      cp_async_16(smem_u32(dk + so), kg + off, ok);
      cp_async_16(smem_u32(dv + so), vg + off, ok);
    }
  };

  fetch_slots(0);
  load_kv(0);
  cp_async_commit();
  if (n_tiles > 1) fetch_slots(1);

  float o[kON];
#pragma unroll
  for (int j = 0; j < kON; ++j) o[j] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY};
  float row_l[2] = {0.f, 0.f};

  // accumulator layout (per warp, as mma.sync m16n8): element 4 i + e holds
  // row 16 (warp % 4) + g4 + 8 (e >> 1), column 8 i + 2 t4 + (e & 1)
  const int g4 = lane / 4;
  const int t4 = lane % 4;
  const int q_row0 = wg * 64 + (warp % 4) * 16 + g4;    // tile-local rows q_row0, q_row0 + 8
  const int qpos0 = prefix + m0 + q_row0;
  const float sl2 = p.scale_log2;

  const uint32_t sQ_addr = smem_u32(sQ) + wg * 64 * 128;   // this warpgroup's 64 rows
  const uint32_t sK_addr = smem_u32(sK);
  const uint32_t sV_addr = smem_u32(sV);

  for (int n = 0; n < n_tiles; ++n) {
    const int stage = n & 1;
    cp_async_wait<0>();
    wgmma::fence_proxy_async();
    __syncthreads();   // tile n landed for everyone; everyone finished tile n - 1 (other stage)
    if (n + 1 < n_tiles) {
      load_kv(stage ^ 1);
      cp_async_commit();
      if (n + 2 < n_tiles) fetch_slots(n + 2);
    }

    // Ping-pong: the tensor cores run S(wg 0), S(wg 1), PV(wg 0), PV(wg 1) in turn, so each
    // warpgroup's softmax overlaps the other's products. A turn passes when a product has
    // finished: warpgroup 1 waits before both of its products, warpgroup 0 before its PV.
    if (wg == 1) turn_wait(1);

    // ---- S = Q K^T: D / 16 k-steps, each 32 bytes into a 128-byte row of one column block
    float s[kSN];
    const uint32_t k_addr = sK_addr + stage * kTileBytesK;
    wgmma::fence_operand(s);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t blk = (kk / 4), in_row = (kk % 4) * 32;
      const uint64_t da = wgmma::make_desc(sQ_addr + blk * (BM * 128) + in_row, 16, 1024);
      const uint64_t db = wgmma::make_desc(k_addr + blk * (BN * 128) + in_row, 16, 1024);
      wgmma::wgmma_ss_m64n128k16<T>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operand(s);
    turn_pass(wg);

    // ---- mask (causal and kv length), only on tiles that can need it
    if (n >= first_masked) {
#pragma unroll
      for (int i = 0; i < kSN / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kpos = n * BN + i * 8 + 2 * t4 + (e & 1);
          const int qpos = qpos0 + (e >> 1) * 8;
          if (kpos > qpos || kpos >= kv_len) s[4 * i + e] = -INFINITY;
        }
      }
    }

    // ---- online softmax, rows q_row0 (e = 0, 1) and q_row0 + 8 (e = 2, 3)
    float alpha[2];
    uint32_t pa[BN / 16][4];   // P as the A operand of O += P V, k-step kk = KV rows 16 kk..
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < kSN / 4; ++i) mx = fmaxf(mx, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_m[h], mx * sl2);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(row_m[h] - base);
      row_m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < kSN / 4; ++i) {
        // P is rounded to T once, here: the PV product's A operand and the row sum both use
        // the rounded weights, so the output row is an exactly normalised combination of V rows
        const float e0 = fast_exp2(fmaf(s[4 * i + 2 * h], sl2, -base));
        const float e1 = fast_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -base));
        const uint32_t pk = TypeTraits<T>::pack(e0, e1);
        const float2 r = TypeTraits<T>::to_float2(pk);
        pa[i / 2][(i % 2) * 2 + h] = pk;   // A fragment: k-step i / 2, rows g4 + 8 h
        sum += r.x + r.y;
      }
      row_l[h] = row_l[h] * alpha[h] + sum;
    }
    // Rescale O only where a row's max moved (alpha != 1; after the first tiles rarely): the
    // softmax is on the critical path, and multiplying by 1 is exact, so skipping changes nothing.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < kON / 4; ++j) {
        o[4 * j + 0] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }

    // ---- O += P V: BN / 16 k-steps of 16 KV rows (2048 bytes of the MN-major V tile)
    turn_wait(wg);
    const uint32_t v_addr = sV_addr + stage * kTileBytesK;
    wgmma::fence_operand(o);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t db = wgmma::make_desc(v_addr + kk * 2048, BN * 128, 1024);
      if constexpr (D == 128) {
        wgmma::wgmma_rs_tb_m64n128k16<T>(o, pa[kk], db, 1);
      } else {
        wgmma::wgmma_rs_tb_m64n64k16<T>(o, pa[kk], db, 1);
      }
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_operand(o);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma::fence_operand(pa[kk]);
    if (wg == 0) turn_pass(0);   // warpgroup 1's PV
  }

  // ---- normalise, stage through this warp's own rows of sQ, 16-byte stores
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kON / 4; ++j) {   // 8 output columns = one 16-byte chunk
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = q_row0 + h * 8;
      const uint32_t v = TypeTraits<T>::pack(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      *reinterpret_cast<uint32_t*>(sQ + wgmma::sw128_offset(BM, r, j) + 2 * t4) = v;
    }
  }
  __syncwarp();
  T* og = static_cast<T*>(p.out);
  const int warp_row0 = wg * 64 + (warp % 4) * 16;
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int e = lane + i * 32;
    const int r = warp_row0 + e / kChunks;
    const int c = e % kChunks;
    if (m0 + r < qo_len) {
      const uint4 v = *reinterpret_cast<const uint4*>(sQ + wgmma::sw128_offset(BM, r, c));
      *reinterpret_cast<uint4*>(og + ((int64_t)(qo_start + m0 + r) * p.num_q_heads + qh) * D +
                                c * 8) = v;
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this kernel then
#endif
}

}  // namespace sm90
}  // namespace attn
}  // namespace radixserve
