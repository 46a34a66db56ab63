// Paged decode attention on tensor cores over an FP8 KV pool (--kv-cache-dtype fp8_e4m3 /
// fp8_e5m2): the FP8 counterpart of decode_attention_mma.cuh, with the same grid, the same use
// (GQA subgroups of 4 or 8 q heads, no split) and the same online softmax and combine; the
// products run in fp16 (every FP8 value is an fp16 value; q is rounded to fp16, P to fp16).
//
// Why not the 16-bit kernel's tiles: it gathers K/V rows into shared memory and feeds the mma
// through ldmatrix. FP8 bytes would need converting in shared memory first (a second pass over
// every byte). Here each lane reads from shared memory exactly the bytes that its mma fragments
// hold and converts them in registers (fp8_kv.cuh: bit placement, no conversion instruction); no
// ldmatrix, and the pipeline is the warp's own (no CTA barrier). With row tiles (D = 128, the
// default: kDecodeMmaFp8RowTiles) the warp copies the tile's rows whole and each lane then reads
// its fragments' bytes from them; with lane tiles each lane copies exactly the bytes it reads.
// Both need two permutations, each applied to both operands of a product, which leave the
// products unchanged:
//   S = q K^T, m16n8k16: lane (g, t) (g = lane / 4, t = lane % 4) supplies B's rows (logical
//     k) 2t, 2t+1, 2t+8, 2t+9 of column (token) g, and A's (q's) same columns of row g. Logical
//     k (k-step kk, those four) is physical dim 64 (kk / 4) + 16 t + 4 (kk % 4) + {0, 2, 1, 3}:
//     the lane's K bytes of tokens g and g + 8 are D/64 16-byte pieces, piece i at byte
//     64 i + 16 t of the row, so that one load instruction of piece i reads bytes [64 i,
//     64 i + 64) of each of the warp's 8 rows whole (two 32-byte sectors, each read once; lane
//     t's bytes as one contiguous D/4 run would have split every sector over two instructions,
//     each sector then crossing from L2 twice: 299.9 us against 225.4 at batch 256 x 1k on an
//     H100, bench/results/h100-2026-12-07.md). 32-bit word kk of the pieces, [b3 b2 b1 b0], is
//     the pair (b0, b2) for b0 and (b1, b3) for b1, as fp8_kv.cuh's conversion produces them.
//     q gets the same order (one byte permute per k-step, once per CTA).
//   O += P V: B's rows are tokens (P's columns, as S left them: no permutation), its column g of
//     n-tile nn is physical dim g * D/8 + nn: the lane's V bytes are the D/8 contiguous bytes
//     [g * D/8, (g+1) * D/8) of tokens 2t, 2t+1, 2t+8, 2t+9; a byte permute pairs token 2t's
//     byte nn with token 2t+1's. The accumulator's column c of n-tile nn is then dim
//     c * D/8 + nn, undone when the warps' states go to shared memory.
// Per 16-token tile and lane: D / 2 bytes of K and D / 2 of V. k_scale is in p.scale_log2 and
// v_scale in the combine (decode_combine_parts), as for every kernel over an FP8 pool.
#pragma once

#include <cstdint>

#include "radixserve/attention_common.cuh"
#include "radixserve/decode_attention.cuh"
#include "radixserve/decode_attention_mma.cuh"
#include "radixserve/fp8_kv.cuh"
#include "radixserve/pdl.cuh"

namespace radixserve {
namespace attn {

constexpr int kDecodeMmaFp8Stages = 3;   // tiles per warp in the pipeline (2 in flight)

// KV heads per CTA: 1, or 2 with kDecodeMmaFp8PairHeads (warps 0-1 head 2y, warps 2-3 head
// 2y+1, over the same tiles at the same time, so that a token's two adjacent 128-byte rows of
// the [slot][head][D] pool are read together, as the 16-bit kernel reads its 256-byte rows),
// where the heads pair up and the halved grid still gives every SM two CTAs; a shape property,
// as graphs need. Off: on an H100 pairs were slower at every batch (bench/results/
// h100-2026-12-07.md: batch 256 x 1k 232.5 us against 225.4, batch 128 x 1k 138.6 against
// 119.2), and a head-major pool gave the unpaired kernel nothing (224.2 us): its time follows
// the bytes and sectors it reads, not the rows. Kept for the sweep (gpu_session.sh fp8kvsweep,
// variant "pairs") on other cards.
constexpr bool kDecodeMmaFp8PairHeads = false;

// Row tiles (D = 128): the warp copies a tile's K and V rows whole into shared memory, 8 lanes a
// 128-byte row, so that each copy instruction fills whole lines (4 rows, 16 sectors) and each
// line's data lands in one shared-memory wavefront; the lanes then read their fragments' bytes
// from the shared rows (a __syncwarp after the wait, and one before a stage is refilled). Without
// it (lane tiles, the only form for D = 64) each lane copies exactly the bytes it reads: K then
// touches 8 lines a copy at 64 bytes each, and V's copies land 4-way bank-conflicted, since its
// lanes' 16-byte slots sit 64 bytes apart (Nsight Compute on an H100: 66% of the kernel's shared
// wavefronts and 35% of its global sectors counted excessive, bench/results/h100-2026-12-07-
// fp8gemv.md). On an H100 at batch 256 x 1k: 195.6 us (0.952 of copy bandwidth in the sweep)
// against 220.1 for lane tiles, equal outputs, and no loss at other shapes (bench/results/logs/
// fp8kv-rowtiles-sweep-h100-2026-12-07.txt; gpu_session.sh stage fp8kvrows).
constexpr bool kDecodeMmaFp8RowTiles = true;

// 16-byte chunk c of row r of a row tile ([16 tokens][8 chunks]), swizzled so that the fragment
// reads are conflict-free: a quarter-warp reads K chunks 4i + t of rows g, g + 1 (bit 2 of the
// chunk flips with the row's parity) and V chunks g, g + 1 of rows 2t + b (bits 1-2 flip with
// the row's bits 1-2); a row's 8 chunks stay a permutation of its 128 bytes.
__device__ __forceinline__ int row_tile_chunk(int r, int c) {
  return c ^ ((r & 1) << 2) ^ (((r >> 1) & 3) << 1);
}
inline int decode_mma_fp8_heads(int num_kv_heads, int64_t batch, int num_sub, int sms) {
  return kDecodeMmaFp8PairHeads && num_kv_heads % 2 == 0 &&
                 batch * (num_kv_heads / 2) * num_sub >= 2 * (int64_t)sms
             ? 2
             : 1;
}

// dynamic shared memory: [warps][stages][pieces][32 lanes] 16-byte slots, pieces = 2 * D/64 (K:
// tokens g, g + 8) + 4 (V: tokens 2t, 2t+1, 2t+8, 2t+9; 8 bytes used of a slot when D = 64)
template <int D>
__host__ __device__ constexpr int decode_mma_fp8_smem_bytes() {
  return kDecodeMmaWarps * kDecodeMmaFp8Stages * (2 * (D / 64) + 4) * 32 * 16;
}

template <int N>
__device__ __forceinline__ uint32_t word_of(const uint4 (&v)[N], int w) {
  const uint4 x = v[w / 4];
  const int c = w % 4;
  return c == 0 ? x.x : c == 1 ? x.y : c == 2 ? x.z : x.w;
}

// grid (num_sub, num_kv_heads / kHeads, batch)
template <typename T, typename F8, int D, int kGroupMax, int kHeads>
__global__ void __launch_bounds__(kDecodeMmaThreads)
    paged_decode_mma_fp8_kernel(const DecodeParams p) {
  static_assert(D % 64 == 0, "D / 4 bytes of K per lane: whole 16-byte pieces");
  static_assert(kGroupMax == 4 || kGroupMax == 8, "q heads of a subgroup: rows 0..7 of the mma");
  static_assert(kHeads == 1 || kHeads == 2, "one head or a pair per CTA");
  constexpr int kWarpsPerHead = kDecodeMmaWarps / kHeads;
  pdl_launch_dependents();  // the o projection after attention may start streaming its weights
  constexpr int kKSteps = D / 16;          // mma k-steps of S = q K^T
  constexpr int kNTiles = D / 8;           // mma n-tiles of O
  constexpr int kKPieces = D / 64;         // 16-byte pieces of one token's D/4 K bytes
  constexpr int kVBytes = D / 8;           // one token's V bytes per lane (8 or 16)
  static_assert(kVBytes <= 16, "one 16-byte slot per token of V (D <= 128)");
  constexpr int kPieces = 2 * kKPieces + 4;
  constexpr bool kRows = kDecodeMmaFp8RowTiles && D == 128;
  static_assert(!kRows || kPieces * 32 == 2 * 16 * 8, "a stage holds the K and V row tiles");
  constexpr int kStages = kDecodeMmaFp8Stages;
  using H = TypeTraits<__half>;

  // same name and alignment as the 16-bit mma kernel's (one translation unit holds both)
  extern __shared__ __align__(128) unsigned char decode_mma_smem[];
  __shared__ float sm_m[kDecodeMmaWarps][kGroupMax];
  __shared__ float sm_l[kDecodeMmaWarps][kGroupMax];
  // the warps' accumulators for the combine, rows padded (decode_acc_index): a lane writes its
  // D / 4 contiguous dims 16 bytes at a time, lanes 2 D / 8 floats apart, so that plain rows
  // would put every lane's store on the same 4 banks
  constexpr int kAccRow = D + D / 8;
  static_assert(kDecodeMmaWarps * kGroupMax * kAccRow * 4 <= decode_mma_fp8_smem_bytes<D>(),
                "combine buffer inside the pipeline's");
  auto sm_acc = reinterpret_cast<float (*)[kGroupMax][kAccRow]>(decode_mma_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wl = warp % kWarpsPerHead;  // this warp's place among its head's warps
  const int sg = blockIdx.x;  // q-head subgroup (one split: blockIdx.x < num_sub)
  const int kvh = blockIdx.y * kHeads + warp / kWarpsPerHead;
  const int b = blockIdx.z;
  const int qh0 = kvh * p.group + sg * kGroupMax;
  const int gcount = min(kGroupMax, p.group - sg * kGroupMax);
  const KvRange range = decode_kv_range(p, b);  // the whole KV, or its window
  const int kv_start = range.start;
  const int kv_len = range.len;

  // q as the A operand (row g; rows >= gcount and 8..15 zero), fp16, in the permuted k order:
  // k-step kk takes physical dims 64 (kk / 4) + 16 t + 4 (kk % 4) + {0, 2} (qa[kk][0]) and
  // {1, 3} (qa[kk][1])
  uint32_t qa[kKSteps][2];
  {
    const T* qrow = static_cast<const T*>(p.q) + (int64_t)b * p.q_stride_b +
                    (int64_t)(qh0 + g) * p.q_stride_h + t * 16;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const uint2 w = g < gcount ? *reinterpret_cast<const uint2*>(qrow + (kk / 4) * 64 + (kk % 4) * 4) : make_uint2(0u, 0u);
      const uint32_t h01 = fp8::to_half2_word<T>(w.x), h23 = fp8::to_half2_word<T>(w.y);
      qa[kk][0] = __byte_perm(h01, h23, 0x5410);  // (q0, q2)
      qa[kk][1] = __byte_perm(h01, h23, 0x7632);  // (q1, q3)
    }
  }

  // this warp's tiles: wl, wl + warps per head, ... of the request's ceil(kv_len / 16)
  const int tiles = (kv_len + kDecodeMmaTile - 1) / kDecodeMmaTile;
  const int n_it = tiles > wl ? (tiles - wl + kWarpsPerHead - 1) / kWarpsPerHead : 0;
  const int32_t* idx = p.kv_indices + kv_start;
  const uint8_t* kbase = static_cast<const uint8_t*>(p.k) + (int64_t)kvh * p.kv_stride_h + t * 16;
  const uint8_t* vbase = static_cast<const uint8_t*>(p.v) + (int64_t)kvh * p.kv_stride_h + g * (D / 8);
  uint4* pipe = reinterpret_cast<uint4*>(decode_mma_smem);
  auto piece = [&](int stage, int j) -> uint4* {
    return pipe + ((warp * kStages + stage) * kPieces + j) * 32 + lane;
  };
  auto tile_start = [&](int it) { return (it * kWarpsPerHead + wl) * kDecodeMmaTile; };
  // row tiles: the stage's K tile [16][8] chunks, then its V tile
  auto row_tile = [&](int stage) -> uint4* { return pipe + (warp * kStages + stage) * kPieces * 32; };
  const uint8_t* krow = static_cast<const uint8_t*>(p.k) + (int64_t)kvh * p.kv_stride_h;
  const uint8_t* vrow = static_cast<const uint8_t*>(p.v) + (int64_t)kvh * p.kv_stride_h;

  // lane l < 16 holds the slot of token l of the tile fetched last (0 past the request)
  int slot = 0;
  auto fetch = [&](int it) {
    const int tok = tile_start(it) + lane;
    slot = it < n_it && lane < kDecodeMmaTile && tok < kv_len ? __ldg(idx + tok) : 0;
  };
  // cp.async of this lane's bytes of tile it into stage it % kStages (past the request: zeros)
  auto issue = [&](int it) {
    if (it < n_it) {
      const int t0 = tile_start(it);
      const int stage = it % kStages;
      if constexpr (kRows) {  // rows 4j + lane / 8, chunk lane % 8, of K and of V
        uint4* tile = row_tile(stage);
        const int c = lane & 7;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = 4 * j + (lane >> 3);
          const int s = __shfl_sync(0xffffffffu, slot, r);
          const bool ok = t0 + r < kv_len;
          const int64_t off = ok ? (int64_t)s * p.kv_stride_slot + c * 16 : 0;
          const int at = r * 8 + row_tile_chunk(r, c);
          cp_async_16(smem_u32(tile + at), krow + off, ok);
          cp_async_16(smem_u32(tile + 128 + at), vrow + off, ok);
        }
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // K of tokens g, g + 8
          const int r = g + 8 * h;
          const int s = __shfl_sync(0xffffffffu, slot, r);
          const bool ok = t0 + r < kv_len;
          const int64_t off = ok ? (int64_t)s * p.kv_stride_slot : 0;
#pragma unroll
          for (int i = 0; i < kKPieces; ++i)
            cp_async_16(smem_u32(piece(stage, h * kKPieces + i)), kbase + off + i * 64, ok);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // V of tokens 2t, 2t+1, 2t+8, 2t+9
          const int r = 2 * t + (j & 1) + (j >> 1) * 8;
          const int s = __shfl_sync(0xffffffffu, slot, r);
          const bool ok = t0 + r < kv_len;
          const int64_t off = ok ? (int64_t)s * p.kv_stride_slot : 0;
          if constexpr (kVBytes == 16)
            cp_async_16(smem_u32(piece(stage, 2 * kKPieces + j)), vbase + off, ok);
          else
            cp_async_8(smem_u32(piece(stage, 2 * kKPieces + j)), vbase + off, ok);
        }
      }  // lane tiles
    }  // n_it is warp-uniform: the shuffles above run on every lane or on none
    cp_async_commit();
  };

  float m = -INFINITY, l = 0.f;          // row g's running max (log2 domain) and this lane's
                                         // share of its sum
  float acc[kNTiles][4];                 // O: [n-tile][c0..c3]; c2, c3 are rows 8..15 (zero)
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) {
    fetch(st);
    issue(st);
  }
  fetch(kStages - 1);

  for (int it = 0; it < n_it; ++it) {
    // the stage issue() refills is the one read in the last iteration: lane tiles, this lane's
    // own copies, read into registers before use (no barrier); row tiles, every lane's reads of
    // it come before the refill
    if constexpr (kRows) __syncwarp();
    issue(it + kStages - 1);
    fetch(it + kStages);
    cp_async_wait<kStages - 1>();
    if constexpr (kRows) __syncwarp();  // the other lanes' copies of this stage are visible
    const int stage = it % kStages;
    const int t0 = tile_start(it);

    // S = q K^T: n-tile 0 = tokens 0..7 (column g: token g), n-tile 1 = tokens 8..15
    uint4 k0[kKPieces], k1[kKPieces];
#pragma unroll
    for (int i = 0; i < kKPieces; ++i) {
      if constexpr (kRows) {  // row g (g + 8), bytes 64 i + 16 t: chunk 4 i + t
        const uint4* tile = row_tile(stage);
        k0[i] = tile[g * 8 + row_tile_chunk(g, 4 * i + t)];
        k1[i] = tile[(g + 8) * 8 + row_tile_chunk(g + 8, 4 * i + t)];
      } else {
        k0[i] = *piece(stage, i);
        k1[i] = *piece(stage, kKPieces + i);
      }
    }
    float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t b0, b1, c0, c1;
      fp8::Traits<F8>::to_half2x2(word_of(k0, kk), b0, b1);
      fp8::Traits<F8>::to_half2x2(word_of(k1, kk), c0, c1);
      const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
      mma_16816<__half>(s0, a, b0, b1);
      mma_16816<__half>(s1, a, c0, c1);
    }

    // online softmax of row g over this tile's tokens 2t, 2t+1 (s0) and 8 + 2t, 9 + 2t (s1)
    const int tq = t0 + t * 2;
    float x[4] = {s0[0] * p.scale_log2, s0[1] * p.scale_log2, s1[0] * p.scale_log2,
                  s1[1] * p.scale_log2};
    x[0] = tq < kv_len ? x[0] : -INFINITY;
    x[1] = tq + 1 < kv_len ? x[1] : -INFINITY;
    x[2] = tq + 8 < kv_len ? x[2] : -INFINITY;
    x[3] = tq + 9 < kv_len ? x[3] : -INFINITY;
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // no token yet: nothing is inf - inf
    const float alpha = fast_exp2(m - base);
    float pr[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) pr[i] = fast_exp2(x[i] - base);  // -inf -> 0
    l = l * alpha + ((pr[0] + pr[1]) + (pr[2] + pr[3]));
    m = m_new;
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      acc[n][0] *= alpha;
      acc[n][1] *= alpha;
    }

    // O += P V: P's A fragment (k = tokens 2t, 2t+1 | 2t+8, 2t+9), V's B fragments from the
    // lane's bytes of those tokens, token 2t's byte nn paired with token 2t+1's
    const uint32_t pa[4] = {H::pack(pr[0], pr[1]), 0u, H::pack(pr[2], pr[3]), 0u};
    uint4 va[1], vb[1], vc[1], vd[1];
    if constexpr (kRows) {  // V rows 2t, 2t+1, 2t+8, 2t+9, chunk g
      const uint4* vt = row_tile(stage) + 128;
      va[0] = vt[(2 * t) * 8 + row_tile_chunk(2 * t, g)];
      vb[0] = vt[(2 * t + 1) * 8 + row_tile_chunk(2 * t + 1, g)];
      vc[0] = vt[(2 * t + 8) * 8 + row_tile_chunk(2 * t + 8, g)];
      vd[0] = vt[(2 * t + 9) * 8 + row_tile_chunk(2 * t + 9, g)];
    } else {
      va[0] = *piece(stage, 2 * kKPieces + 0);
      vb[0] = *piece(stage, 2 * kKPieces + 1);
      vc[0] = *piece(stage, 2 * kKPieces + 2);
      vd[0] = *piece(stage, 2 * kKPieces + 3);
    }
#pragma unroll
    for (int w = 0; w < kVBytes / 4; ++w) {
      const uint32_t a = word_of(va, w), bw = word_of(vb, w);
      const uint32_t c = word_of(vc, w), d = word_of(vd, w);
      uint32_t lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3;
      fp8::Traits<F8>::to_half2x2(__byte_perm(a, bw, 0x5410), lo0, hi0);  // dims 4w, 4w+1
      fp8::Traits<F8>::to_half2x2(__byte_perm(a, bw, 0x7632), lo1, hi1);  // dims 4w+2, 4w+3
      fp8::Traits<F8>::to_half2x2(__byte_perm(c, d, 0x5410), lo2, hi2);
      fp8::Traits<F8>::to_half2x2(__byte_perm(c, d, 0x7632), lo3, hi3);
      mma_16816<__half>(acc[4 * w + 0], pa, lo0, lo2);
      mma_16816<__half>(acc[4 * w + 1], pa, hi0, hi2);
      mma_16816<__half>(acc[4 * w + 2], pa, lo1, lo3);
      mma_16816<__half>(acc[4 * w + 3], pa, hi1, hi3);
    }
  }
  cp_async_wait<0>();

  // the row's sum over the quad's lanes; the warps' states into shared memory (accumulator
  // column c of n-tile nn is dim c * D/8 + nn), then combined
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with the pipeline buffer the combine reuses
  if (g < kGroupMax) {
    if (t == 0) {
      sm_m[warp][g] = m;
      sm_l[warp][g] = l;
    }
    // dims (2t) D/8 + n (acc[n][0]) and (2t + 1) D/8 + n (acc[n][1]): D / 4 contiguous dims
    float* row = sm_acc[warp][g];
    const int d0 = 2 * t * (D / 8);
#pragma unroll
    for (int c = 0; c < 2; ++c) {
#pragma unroll
      for (int k = 0; k < kNTiles / 4; ++k) {
        const int d = d0 + c * (D / 8) + 4 * k;  // a multiple of 4 inside one 32-float block
        *reinterpret_cast<float4*>(row + decode_acc_index<D, kAccRow>(d)) =
            make_float4(acc[4 * k][c], acc[4 * k + 1][c], acc[4 * k + 2][c], acc[4 * k + 3][c]);
      }
    }
  }
  __syncthreads();
  // head h of the CTA: warps h * kWarpsPerHead .. (h + 1) * kWarpsPerHead - 1
#pragma unroll
  for (int h = 0; h < kHeads; ++h) {
    const int o = h * kWarpsPerHead;
    decode_combine_parts<T, D, kGroupMax, kWarpsPerHead, kAccRow>(
        p, b, (blockIdx.y * kHeads + h) * p.group + sg * kGroupMax, gcount, 0, false, sm_m + o,
        sm_l + o, sm_acc + o);
  }
}

}  // namespace attn
}  // namespace radixserve
