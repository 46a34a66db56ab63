// Paged extend (prefill) attention on tensor cores, FlashAttention-2 style.
//
// One CTA = one tile of kBlockM query rows of one request, one q head. 8 warps, 16 query rows
// each; the Q tile sits in registers (A fragments of mma.sync m16n8k16), K/V tiles of
// kBlockN rows are gathered by slot index into shared memory with cp.async (two stages, the
// next tile's slot indices fetched one tile ahead), softmax runs online in fp32 (log2 domain).
// The softmax weights are rounded to T (the PV product's input type) before they are summed
// into the row's denominator too, so every output row is an exactly normalised combination of
// V rows (measured on the default model: top-1 agreement of the bf16 model with fp32 98.2% when
// the denominator summed the unrounded weights, 99.6% with this, in a CPU emulation).
// Shared-memory rows are D elements; 16-byte chunk c of row r is stored at chunk c ^ (r & 7),
// so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
// Variable lengths in one launch: grid.x covers an upper bound of the number of query tiles
// over all requests (ceil(num_q_tokens / kBlockM) + batch); a CTA finds its request by a warp
// scan over qo_indptr, spare CTAs exit. Tiles are handed out last-first (causal tiles at the
// end of a request carry the most work).
// FP8 pools (KV = __nv_fp8_e4m3 / __nv_fp8_e5m2): the K/V tiles hold fp16 converted from the
// FP8 bytes (exactly, fp8_kv.cuh), and Q (converted from bf16 when T is bf16) and P enter the
// products as fp16. The bytes of tile n + 1 are loaded into registers before tile n's products
// and converted into the other shared-memory stage after them (cp.async cannot convert). k_scale
// is part of scale_log2; v_scale multiplies the output's normalisation.
#pragma once

#include <cstdint>
#include <type_traits>

#include "radixserve/attention_common.cuh"
#include "radixserve/fp8_kv.cuh"

namespace radixserve {
namespace attn {

struct ExtendParams {
  const void* q;   // [num_q_tokens, num_q_heads, D], last dim contiguous
  const void* k;   // [num_slots, num_kv_heads, D]
  const void* v;
  void* out;       // [num_q_tokens, num_q_heads, D] contiguous
  const int32_t* qo_indptr;   // [batch + 1]
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [nnz]
  int64_t q_stride_t, q_stride_h;
  int64_t kv_stride_slot, kv_stride_h;
  int batch, num_q_heads, group;
  float scale_log2;
  // the sm_90a kernel's queue of work items: 2 int32, zero before the launch and left zero by it
  // (the last CTA resets them); unused by the mma.sync kernel
  int* work_counters;
  int64_t num_slots;   // rows of the K/V pools (the sm_90a kernel's TMA maps span them)
  int num_sms;         // multiprocessors of the device (the sm_90a kernel's persistent grid)
  // multiplies the output's normalisation: an FP8 pool's v_scale (mma.sync kernel), else 1
  float v_scale = 1.f;
  // a sliding window (mma.sync kernel only): > 0, the query at position p attends KV positions
  // (p - window, p]; 0 causal over the whole KV. The tiles wholly before a tile's window are
  // never loaded (ExtendTile::first_tile) and the band's lower edge is masked.
  int window = 0;
};

// Variable lengths in one launch: query tile `tile_id` of the concatenation of all requests'
// tiles of bm tokens. One warp scans qo_indptr; every lane gets the request (-1 past the last
// tile) and the tile within it.
__device__ __forceinline__ void locate_extend_tile(const ExtendParams& p, int lane, int tile_id,
                                                   int bm, int& req, int& tile) {
  int seen = 0;
  req = -1;
  tile = 0;
  for (int base = 0; base < p.batch; base += 32) {
    const int bb = base + lane;
    int n = 0;
    if (bb < p.batch) n = (p.qo_indptr[bb + 1] - p.qo_indptr[bb] + bm - 1) / bm;
    int incl = n;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    const int excl = incl - n;
    const bool mine = n > 0 && tile_id >= seen + excl && tile_id < seen + incl;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (ballot) {
      const int src = __ffs(ballot) - 1;
      req = base + src;
      tile = tile_id - seen - __shfl_sync(0xffffffffu, excl, src);
      break;
    }
    seen += __shfl_sync(0xffffffffu, incl, 31);
    if (seen > tile_id) break;
  }
}
// the same over tiles of a compile-time BM (the mma.sync kernel's)
template <int BM>
__device__ __forceinline__ void locate_extend_tile(const ExtendParams& p, int lane, int tile_id,
                                                   int& req, int& tile) {
  locate_extend_tile(p, lane, tile_id, BM, req, tile);
}

// One CTA per query tile: CTA blockIdx.x takes tile (gridDim.x - 1 - blockIdx.x), last-first
// (causal tiles at the end of a request carry the most work); lane 0 writes the request (-1 for
// a spare CTA) and the tile within it.
template <int BM>
__device__ __forceinline__ void find_extend_tile(const ExtendParams& p, int lane, int* s_req,
                                                 int* s_tile) {
  int req, tile;
  locate_extend_tile<BM>(p, lane, (int)gridDim.x - 1 - (int)blockIdx.x, req, tile);
  if (lane == 0) {
    *s_req = req;
    *s_tile = tile;
  }
}

// Where a query tile sits: its request's query and KV ranges (the request's queries are the
// last qo_len of its kv_len positions), the KV tiles of BN rows the tile's causal window needs
// (its last query, at prefix + m0 + rows_here - 1, sees KV positions up to itself), and the
// first KV tile where the causal / length mask can cut. With a sliding window (p.window > 0):
// first_tile, the first KV tile that holds a position of the tile's first query's window (the
// tiles before it hold none of any row's: never loaded), and low_masked_end, the first KV tile
// whose positions are all inside the last query's window (the tiles before it need the band's
// lower mask). Without one, both 0.
struct ExtendTile {
  int qo_start, qo_len, kv_start, kv_len, prefix, m0, rows_here, n_tiles, first_masked;
  int first_tile, low_masked_end;
};

// Tile `tile` of bm tokens of request b.
template <int BN>
__device__ __forceinline__ ExtendTile extend_tile(const ExtendParams& p, int b, int tile, int bm) {
  ExtendTile t;
  t.m0 = tile * bm;
  t.qo_start = p.qo_indptr[b];
  t.qo_len = p.qo_indptr[b + 1] - t.qo_start;
  t.kv_start = p.kv_indptr[b];
  t.kv_len = p.kv_indptr[b + 1] - t.kv_start;
  t.prefix = t.kv_len - t.qo_len;
  t.rows_here = min(bm, t.qo_len - t.m0);
  t.n_tiles = (t.prefix + t.m0 + t.rows_here + BN - 1) / BN;
  t.first_masked = (t.prefix + t.m0) / BN;
  t.first_tile = t.low_masked_end = 0;
  if (p.window > 0) {
    // row r (query position prefix + m0 + r) attends positions >= prefix + m0 + r - window + 1
    const int lo = t.prefix + t.m0 - p.window + 1;              // row 0's lowest
    const int hi = t.prefix + t.m0 + t.rows_here - p.window;    // the last row's lowest
    t.first_tile = lo > 0 ? lo / BN : 0;
    t.low_masked_end = hi > 0 ? (hi + BN - 1) / BN : 0;
  }
  return t;
}
// the same with a compile-time BM (the mma.sync kernel's)
template <int BM, int BN>
__device__ __forceinline__ ExtendTile extend_tile(const ExtendParams& p, int b, int tile) {
  return extend_tile<BN>(p, b, tile, BM);
}

constexpr int kExtendBlockM = 128;
constexpr int kExtendBlockN = 64;
constexpr int kExtendWarps = 8;
constexpr int kExtendThreads = kExtendWarps * 32;

template <int D>
constexpr int extend_smem_bytes() {
  // Q tile + 2 stages of K + 2 stages of V, 2-byte elements
  return (kExtendBlockM * D + 4 * kExtendBlockN * D) * 2;
}

template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

template <typename T, int D, typename KV = T>
__global__ void __launch_bounds__(kExtendThreads, 1)
    paged_extend_kernel(const ExtendParams p) {
  constexpr bool kFp8 = fp8::is_fp8<KV>();
  using M = typename std::conditional<kFp8, __half, T>::type;   // K/V tiles, Q and P in the mma
  using KvElem = typename std::conditional<kFp8, uint8_t, T>::type;
  constexpr int BM = kExtendBlockM;
  constexpr int BN = kExtendBlockN;
  constexpr int kChunks = D / 8;                          // 16-byte chunks per row
  constexpr int kKvRowsPerPass = kExtendThreads / kChunks;  // rows one pass of loads covers
  constexpr int kKvPasses = BN / kKvRowsPerPass;
  constexpr int kQPasses = BM / kKvRowsPerPass;
  constexpr int kNT = BN / 8;   // S n-tiles per warp
  constexpr int kDT = D / 8;    // O n-tiles per warp
  constexpr int kKS = D / 16;   // k-steps of Q K^T

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  M* sK = reinterpret_cast<M*>(sQ + BM * D);   // [2][BN][D]
  M* sV = sK + 2 * BN * D;                     // [2][BN][D]

  __shared__ int s_req, s_tile;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int qh = blockIdx.y;
  const int kvh = qh / p.group;

  // ---- which request and which of its tiles is this CTA's
  if (warp == 0) find_extend_tile<BM>(p, lane, &s_req, &s_tile);
  __syncthreads();
  const int b = s_req;
  if (b < 0) return;
  const ExtendTile tl = extend_tile<BM, BN>(p, b, s_tile);
  const int m0 = tl.m0, qo_start = tl.qo_start, qo_len = tl.qo_len, kv_start = tl.kv_start;
  const int kv_len = tl.kv_len, prefix = tl.prefix, n_tiles = tl.n_tiles;
  const int first_masked = tl.first_masked;
  const int n0 = tl.first_tile, low_masked_end = tl.low_masked_end;   // 0, 0 without a window

  const T* qg = static_cast<const T*>(p.q);
  const KvElem* kg = static_cast<const KvElem*>(p.k) + (int64_t)kvh * p.kv_stride_h;
  const KvElem* vg = static_cast<const KvElem*>(p.v) + (int64_t)kvh * p.kv_stride_h;
  const int32_t* idx = p.kv_indices + kv_start;

  const int ld_chunk = tid % kChunks;
  const int ld_row = tid / kChunks;

  // ---- Q tile -> shared memory (zero rows past the request's queries)
#pragma unroll
  for (int i = 0; i < kQPasses; ++i) {
    const int r = ld_row + i * kKvRowsPerPass;
    const bool ok = m0 + r < qo_len;
    const T* src = qg + (ok ? ((int64_t)(qo_start + m0 + r) * p.q_stride_t +
                               (int64_t)qh * p.q_stride_h + ld_chunk * 8)
                            : 0);
    cp_async_16(smem_u32(sQ + swz<D>(r, ld_chunk)), src, ok);
  }

  int slots[kKvPasses];
  auto fetch_slots = [&](int tile_n) {
#pragma unroll
    for (int i = 0; i < kKvPasses; ++i) {
      const int pos = tile_n * BN + ld_row + i * kKvRowsPerPass;
      slots[i] = pos < kv_len ? __ldg(idx + pos) : -1;
    }
  };
  auto load_kv = [&](int stage) {
    M* dk = sK + stage * BN * D;
    M* dv = sV + stage * BN * D;
#pragma unroll
    for (int i = 0; i < kKvPasses; ++i) {
      const int r = ld_row + i * kKvRowsPerPass;
      const bool ok = slots[i] >= 0;
      const int64_t off = ok ? (int64_t)slots[i] * p.kv_stride_slot + ld_chunk * 8 : 0;
      cp_async_16(smem_u32(dk + swz<D>(r, ld_chunk)), kg + off, ok);
      cp_async_16(smem_u32(dv + swz<D>(r, ld_chunk)), vg + off, ok);
    }
  };
  // FP8: a thread's 8-value pieces (8 bytes) of the next tile in registers, then converted into
  // a stage (zeros for rows past the request)
  uint2 kreg[kKvPasses], vreg[kKvPasses];
  auto load_kv_regs = [&]() {
#pragma unroll
    for (int i = 0; i < kKvPasses; ++i) {
      const bool ok = slots[i] >= 0;
      const int64_t off = (int64_t)slots[i] * p.kv_stride_slot + ld_chunk * 8;
      kreg[i] = ok ? __ldg(reinterpret_cast<const uint2*>(kg + off)) : make_uint2(0u, 0u);
      vreg[i] = ok ? __ldg(reinterpret_cast<const uint2*>(vg + off)) : make_uint2(0u, 0u);
    }
  };
  auto store_kv_regs = [&](int stage) {
    if constexpr (kFp8) {
      M* dk = sK + stage * BN * D;
      M* dv = sV + stage * BN * D;
#pragma unroll
      for (int i = 0; i < kKvPasses; ++i) {
        const int r = ld_row + i * kKvRowsPerPass;
        *reinterpret_cast<uint4*>(dk + swz<D>(r, ld_chunk)) = fp8::to_half8<KV>(kreg[i]);
        *reinterpret_cast<uint4*>(dv + swz<D>(r, ld_chunk)) = fp8::to_half8<KV>(vreg[i]);
      }
    }
  };

  // KV tiles n0 .. n_tiles - 1 (n0 > 0 only with a window), tile n in stage (n - n0) & 1
  fetch_slots(n0);
  if constexpr (kFp8) {
    load_kv_regs();
    store_kv_regs(0);   // visible to all after the first iteration's barrier
  } else {
    load_kv(0);
  }
  cp_async_commit();
  if (n0 + 1 < n_tiles) fetch_slots(n0 + 1);

  uint32_t qf[kKS][4];
  float o[kDT][4];
#pragma unroll
  for (int j = 0; j < kDT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_m[2] = {-INFINITY, -INFINITY};
  float row_l[2] = {0.f, 0.f};

  const int g4 = lane / 4;   // row within the 8-row half of the mma tile
  const int t4 = lane % 4;   // column pair
  const int q_row0 = warp * 16 + g4;                   // tile-local rows q_row0, q_row0 + 8
  const int qpos0 = prefix + m0 + q_row0;               // kv position of those queries
  const float sl2 = p.scale_log2;

  for (int n = n0; n < n_tiles; ++n) {
    const int stage = (n - n0) & 1;
    if constexpr (kFp8) {
      if (n + 1 < n_tiles) {
        load_kv_regs();   // tile n + 1, in flight under this tile's products
        if (n + 2 < n_tiles) fetch_slots(n + 2);
      }
      cp_async_wait_then_barrier<0>();   // the Q tile (first iteration)
    } else if (n + 1 < n_tiles) {
      load_kv(stage ^ 1);
      cp_async_commit();
      if (n + 2 < n_tiles) fetch_slots(n + 2);
      cp_async_wait_then_barrier<1>();
    } else {
      cp_async_wait_then_barrier<0>();
    }
    __syncthreads();

    if (n == n0) {
#pragma unroll
      for (int kk = 0; kk < kKS; ++kk) {
        const int r = warp * 16 + (lane & 15);
        const int c = 2 * kk + (lane >> 4);
        ldmatrix_x4(smem_u32(sQ + swz<D>(r, c)), qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3]);
        if constexpr (kFp8) {
#pragma unroll
          for (int j = 0; j < 4; ++j) qf[kk][j] = fp8::to_half2_word<T>(qf[kk][j]);
        }
      }
    }

    const M* k_s = sK + stage * BN * D;
    const M* v_s = sV + stage * BN * D;

    // ---- S = Q K^T  (16 x BN per warp)
    float s[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
#pragma unroll
      for (int pr = 0; pr < kNT / 2; ++pr) {
        const int r = pr * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int c = 2 * kk + ((lane >> 3) & 1);
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4(smem_u32(k_s + swz<D>(r, c)), b0, b1, b2, b3);
        mma_16816<M>(s[2 * pr], qf[kk], b0, b1);
        mma_16816<M>(s[2 * pr + 1], qf[kk], b2, b3);
      }
    }

    // ---- mask (causal and kv length; a window's lower edge), only on tiles that can need it
    if (n >= first_masked || n < low_masked_end) {
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kpos = n * BN + j * 8 + 2 * t4 + (e & 1);
          const int qpos = qpos0 + (e >> 1) * 8;
          if (kpos > qpos || kpos >= kv_len || (p.window > 0 && kpos <= qpos - p.window))
            s[j][e] = -INFINITY;
        }
      }
    }

    // ---- online softmax, rows q_row0 (e = 0, 1) and q_row0 + 8 (e = 2, 3)
    float alpha[2];
    uint32_t pk[kNT][2];   // P rounded to T and packed: n-tile j, rows q_row0 + 8 h
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(row_m[h], mx * sl2);
      const float base = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = fast_exp2(row_m[h] - base);
      row_m[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        // rounded to T once, here: the PV product and row_l use the same weights
        const float e0 = fast_exp2(fmaf(s[j][2 * h], sl2, -base));
        const float e1 = fast_exp2(fmaf(s[j][2 * h + 1], sl2, -base));
        pk[j][h] = TypeTraits<M>::pack(e0, e1);
        const float2 r = TypeTraits<M>::to_float2(pk[j][h]);
        sum += r.x + r.y;
      }
      row_l[h] = row_l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int j = 0; j < kDT; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }

    // ---- O += P V
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
#pragma unroll
      for (int jp = 0; jp < kDT / 2; ++jp) {
        const int r = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int c = 2 * jp + (lane >> 4);
        uint32_t b0, b1, b2, b3;
        ldmatrix_x4_trans(smem_u32(v_s + swz<D>(r, c)), b0, b1, b2, b3);
        mma_16816<M>(o[2 * jp], a, b0, b1);
        mma_16816<M>(o[2 * jp + 1], a, b2, b3);
      }
    }
    // FP8: tile n + 1 into the other stage, which every warp left at the last barrier
    if constexpr (kFp8) {
      if (n + 1 < n_tiles) store_kv_regs(stage ^ 1);
    }
    __syncthreads();  // this stage is overwritten by the next iteration's loads
  }

  // ---- normalise, stage through this warp's rows of sQ, 16-byte stores
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l * p.v_scale : 0.f;
  }
#pragma unroll
  for (int j = 0; j < kDT; ++j) {
    const int c = j;  // 8 columns = one chunk
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = q_row0 + h * 8;
      uint32_t v = TypeTraits<T>::pack(o[j][2 * h] * inv[h], o[j][2 * h + 1] * inv[h]);
      *reinterpret_cast<uint32_t*>(sQ + swz<D>(r, c) + 2 * t4) = v;
    }
  }
  __syncwarp();
  T* og = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 16 * kChunks / 32; ++i) {
    const int e = lane + i * 32;
    const int r = warp * 16 + e / kChunks;
    const int c = e % kChunks;
    if (m0 + r < qo_len) {
      const uint4 v = *reinterpret_cast<const uint4*>(sQ + swz<D>(r, c));
      *reinterpret_cast<uint4*>(og + ((int64_t)(qo_start + m0 + r) * p.num_q_heads + qh) * D +
                                c * 8) = v;
    }
  }
}

}  // namespace attn
}  // namespace radixserve
