// bitmask_sample: grammar bitmask + temperature + top-k + top-p + min-p + a counter-based draw,
// one CTA per row, no host synchronisation. Header-only, no torch (csrc/ops/sampling.cu launches
// it for torch tensors; csrc/harness/test_sampling.cu runs it standalone).
//
// Semantics (= reference.filtered_probs / reference.bitmask_sample):
//   x = logits row (fp32 math), allowed(i) = bit i of the bitmask (all allowed without one).
//   logprob(id) = x[id] - logsumexp(x)          (raw logits: before mask and temperature)
//   temperature <= 0: id = first argmax of x over allowed tokens.
//   otherwise e_i = exp(x_i / t - max_allowed(x) / t) on allowed tokens, Z = sum e_i; in the
//   order of decreasing e (ties broken by lower token id) token i is kept iff
//     rank_i < top_k  and  (mass of the tokens before it) < top_p * Z  and  e_i >= min_p,
//   the first token is always kept; id is drawn from the kept tokens in proportion to e_i.
//   A row with no allowed token returns id 0 (the only case a disallowed id can come back).
//
// Random numbers: Philox4x32-10 keyed by the row's 64-bit seed, counter (offset, 0, 0); the
// first two outputs form one uniform double u in [0, 1). The draw is a pure function of
// (seed, offset, logits row, params): no global state, graph-capturable, reproducible.
//
// Algorithm, per row (one CTA of kThreads threads, rows streamed in tiles of kTile elements;
// each thread reads 16 consecutive elements per tile with 16-byte loads when the rows are
// 16-byte aligned):
//   Pass 1 (the only pass over the logits for greedy rows, for 1 <= top_k <= kTopKCap, and for
//   top_p / min_p rows whose kept set the kSpecK best tokens hold):
//     - online (max, sum exp) of the raw logits          -> logsumexp for the logprob
//     - first argmax of the allowed logits                -> greedy id, and M = max allowed
//     - online sum of exp(x/t - running max/t) (allowed)  -> Z (at t = 1 the same exp as the
//       logsumexp's, see kZGapMax)
//     - top-k rows (and top_p / min_p rows without top-k, as k = kSpecK / kSpecKMinP): a candidate buffer in
//       shared memory. A token is appended (warp-aggregated atomics) when its value is >= the
//       value of a threshold key (64-bit: order-preserving float bits << 32 | ~id). The first
//       tile sets the threshold to the k-th largest of the threads' maxima. Rows with
//       k <= kFreeRunTopK then stream without block barriers (an overflowing buffer makes the
//       row collect again the other way); other rows check after every tile: when the buffer
//       could overflow on the next tile, an exact block-wide radix select (8-bit digits over
//       the 64-bit key, early exit once the k-th bin is taken whole) finds the k-th largest
//       key, which becomes the threshold, and the buffer is compacted to exactly k entries.
//       The threshold only rises and is always <= the true k-th largest key of the row so
//       far, so the buffer always holds the row's exact top-k.
//   Top-k rows then finish in shared memory: exact select to k, rank by counting (k <= 1024),
//   one block scan of e in rank order gives the top-p prefix; min-p is a bound on e; the kept
//   set is a prefix of the ranked list, and the draw is an inverse-CDF search of u * mass(kept).
//   A top_p / min_p row whose kept set may reach past its kSpecK buffered tokens falls through:
//   a top_p row (min_p <= 1, no top-k) to the two-pass draw (window_draw): pass 1 has also
//   counted its allowed tokens in log-spaced bins, which place the top-p cut in a window of a
//   few bins; pass 2 sums the mass above the window per tile and collects the window, where the
//   cut is resolved exactly and the draw lands (or in the one tile re-read that holds it). If
//   the bins cannot place the cut (a catch-all bin, an overfull window, a missed estimate), and
//   for the other rows, the streaming path below runs.
//   Plain rows (temperature only) draw without a second pass (thread_order_draw): in the order
//   that takes the tokens thread by thread, pass 1's per-thread sums place the draw in one
//   thread's elements, which its warp re-reads. (A row at temperature 1 whose allowed max lies far below
//   its raw max, see kZGapMax, takes the streaming path.)
//   Other rows (no top-k, or top_k > kTopKCap) stream the row again from L2/HBM:
//     - top-p (or a large top-k): a threshold search over the 32-bit ordered float keys: each
//       pass counts tokens and their mass above kPivots evenly spaced pivot keys inside the
//       current interval (lo, hi] (registers, then one block reduction) and keeps the sub-
//       interval where the keep predicate flips; it stops once the interval holds <= 1 token
//       (typically 4-6 passes). Kept = allowed tokens with key > lo (and e >= min_p).
//     - min-p alone needs no search (a bound on e), plain sampling (the fallback) nothing.
//     - each thread's mass of its kept elements (one pass without block barriers), then the
//       draw in thread order (thread_order_draw): min-p alone takes two passes in all. Where
//       rounding leaves that draw without a token: the mass of the kept set, then block-wide
//       prefix sums over tiles until the running mass passes u * mass.
//   Ties in the top-k/top-p search are broken by token id (the 64-bit key) on the top-k path;
//   the streaming path keeps every token whose value equals the threshold value.
//
// Measured (H200, bench/kernels.py, batch 256 x vocab 128256 fp32, bitmask on every row; one
// read of the logits = logits.sum() = 41.0 us in that run, 38.2 in the one before):
// top_k 50 + top_p 0.9: 74.4 us (1.81x a read; temperature 0.7: 82.5 us); greedy: 49.1 us;
// plain sampling: 56.0 us (one pass, thread_order_draw; 103 us with a second pass); top_k 256: 99.5 us;
// top_k 1000 + top_p: 244 us. On random normal rows (std 3: top_p 0.9 spans ~5000 tokens),
// top_p alone: 148.1 us = 3.61x a read (3.86x against the other run's read; the two-pass draw);
// min_p alone: 115 us; on peaked rows (the buffer holds the kept set) top_p alone 94 us, min_p
// alone 99 us. Peers: torch mask+topk+softmax+multinomial 1181 us, the reference's full sort
// 4860 us; FlashInfer 0.6.18 on its own call's rows (std 3, no mask), same process:
// softmax + top_p_sampling_from_probs 235 us (ours 150 us), top_k_top_p_sampling_from_logits
// (50, 0.9) 246 us (ours 74 us). logs/kernels-h200.txt.
// The plain draw, A/B in one run (logs/sample-sweep-plain-h200.txt, 3 interleaved rounds,
// ranges in us; base = the issue's baseline 7650ca1): plain 98.1-99.5 -> 54.7-54.9, plain at
// t 0.7 103.9-106.0 -> 62.3-62.6; every other configuration of the sweep equal or faster than
// the baseline. Placed after the buffer path, or returning through an int64_t& (kept live
// across the top-k selects), it cost top_k 1000 rows 1-2% (244 against 240 us). The streaming
// rows' thread-order draw (min_p alone on flat rows: two passes, was two and a half) came
// after the kernels.py run above and is not timed yet (the sweep's min_p rows stay inside the
// buffer); the sweep's other configurations stayed equal to or faster than the baseline.
// The two-pass top-p, A/B in one run (bench/variants/sample_sweep.cu; logs/sample-diag-h200.txt
// and logs/sample-sweep-final-*-h200.txt; us, the issue's baseline 7650ca1 -> d61706f -> this
// header): top_p flat rows 651 -> 201 -> 146; peaked 100 -> 115 -> 94; peaked past the
// first tile 100 -> 116 -> 100; top_p 0.95 at t 0.7 594 -> 192 -> 145; min_p flat 100 ->
// 98 -> 97; plain sampling 97 -> 104 -> 103 (until the plain draw). What moved it, by
// removal (d_* variants): pass 1 with a
// 64-token buffer and no bins 76 us, the bins' atomics ~19 us unrolled over the registers (86 us
// as a compare-first loop re-reading the few elements in the span: reverted), pass 2 ~36 us once
// it sorts the tokens under the window out with one compare (bin_floor), ~84 us binning every
// token as before; a 256-token buffer costs pass 1 ~24 us over 64 (100 against 76 us without
// bins). At 64 (peaked rows 89 us) the window estimate of top_p 0.95 at t 0.7 rows missed (384
// us, the streaming search: fewer of the heavy tokens are exact), hence kSpecK 128. A batch
// takes as long as its slowest row: one flat top_p row among 256 used to cost the whole batch
// the streaming search's ~650 us.
// Pass 1 is issue-bound, not memory-bound: a sweep of diagnostic variants (bench/variants, one
// variant per build, same run) split the former 110 us top-k time into pass 1 alone 56 us
// (45 us without the second exp per element), the first-tile select 8 us, the candidate append
// 39 us and the final select/rank 8 us. Hence the lean append (one float compare per element,
// bit-by-bit stores) -> 87 us, and the shared exp at temperature 1 -> 73 us; at temperature 0.7
// the same row takes 80 us. Rows with top_k <= kFreeRunTopK run pass 1 without block barriers.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "radixserve/launch_utils.cuh"

namespace radixserve {
namespace sampling {

constexpr int kThreads = 512;
constexpr int kElems = 16;                      // elements per thread per tile
constexpr int kTile = kThreads * kElems;        // 8192
constexpr int kTopKCap = 1024;                  // top_k in [1, kTopKCap] runs the buffer path
constexpr int kFreeRunTopK = 256;               // top_k up to this runs pass 1 without barriers
// top_p rows without top_k try this k first (the two-pass draw takes flat rows; see Measured
// for 64 / 128 / 256), min_p-only rows kSpecKMinP (they have no two-pass draw: past the buffer,
// the streaming path)
constexpr int kSpecK = 128;
constexpr int kSpecKMinP = 256;
constexpr int kLooseFactor = 4;                 // other buffer rows select at about this many x k
constexpr int kBufCap = kTopKCap + kTile;       // candidates held in shared memory
constexpr int kItems = (kBufCap + kThreads - 1) / kThreads;
constexpr int kPivots = 8;                      // pivots per threshold-search pass
constexpr int kWarps = kThreads / 32;
// Temperature 1 sums Z relative to the raw max m in pass 1. Allowed terms below m - 87 flush
// to zero there; relative to the allowed max M they weigh < exp(-(87 - (m - M))) each, under
// exp(-35) in all for m - M <= 40 and 2^17 tokens: far below fp32 resolution. A row whose
// allowed max lies more than kZGapMax below its raw max sums Z again (one more read).
constexpr float kZGapMax = 40.f;
// Two-pass top-p (rows with top_p < 1 and no top-k whose kept set the kSpecK buffer misses):
// pass 1 also bins the allowed tokens by x / t in kHistBins bins of 1/kBinsPerNat nat, anchored
// at the first tile's allowed max A: bin 0 holds everything more than kHeadBins / kBinsPerNat
// nats above A, the last bin (not counted) everything more than (kHistBins - 1 - kHeadBins) /
// kBinsPerNat nats below it, -inf and NaN. A bin counts its tokens (integers: the counts do not
// depend on the order of the shared atomics). The span's depth sets pass 1's atomics: 10 nats
// below A holds the top_p 0.9 - 0.95 cut of a Gaussian row of any spread (at most ~6.5 and
// ~7.5 nats under the first tile's max), and 31% of a std-3 row's tokens. A row whose cut lies
// deeper takes the streaming search. See window_draw.
constexpr int kHistBins = 1536;
constexpr int kBinsLog2 = 7;
constexpr int kBinsPerNat = 1 << kBinsLog2;
constexpr int kHeadBins = 2 * kBinsPerNat;
constexpr int kMaxTiles = kHistBins / (kThreads / 32);  // pass 2's per-warp tile masses (floats)

struct SampleParams {
  const void* logits;        // [batch, vocab] float or bf16, row stride logits_stride
  int64_t logits_stride;
  const int32_t* bitmask;    // nullptr or [batch, ceil(vocab/32)], row stride bitmask_stride
  int64_t bitmask_stride;
  const float* temperature;  // [batch]
  const int32_t* top_k;      // [batch]
  const float* top_p;        // [batch]
  const float* min_p;        // [batch]
  const int64_t* seeds;      // [batch]
  const int64_t* offsets;    // [batch]
  int64_t* out_ids;          // [batch]
  float* out_logprobs;       // [batch]
  int64_t batch;
  int64_t vocab;
};

// ----------------------------------------------------------------------------- helpers

__host__ __device__ __forceinline__ uint32_t ordered_key(float v) {
#ifdef __CUDA_ARCH__
  const uint32_t u = __float_as_uint(v);
#else
  uint32_t u;
  __builtin_memcpy(&u, &v, 4);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Philox4x32-10 (Salmon et al., SC'11).
__host__ __device__ inline void philox4x32_10(uint32_t key0, uint32_t key1, uint32_t c[4]) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
    const uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
    const uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    const uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    const uint32_t n0 = hi1 ^ c[1] ^ key0, n2 = hi0 ^ c[3] ^ key1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    key0 += 0x9E3779B9u;
    key1 += 0xBB67AE85u;
  }
}

// The uniform in [0, 1) of a row: 53 random bits from Philox(seed; offset).
__host__ __device__ inline double uniform_from(int64_t seed, int64_t offset) {
  uint32_t c[4] = {(uint32_t)(uint64_t)offset, (uint32_t)((uint64_t)offset >> 32), 0u, 0u};
  philox4x32_10((uint32_t)(uint64_t)seed, (uint32_t)((uint64_t)seed >> 32), c);
  const uint64_t bits = ((uint64_t)(c[0] >> 5) << 26) | (uint64_t)(c[1] >> 6);
  return (double)bits * (1.0 / 9007199254740992.0);
}

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// L2 prefetch of tile `base` of a row (elements [base, base + kTile) clipped to the vocab), issued
// by one thread: the streaming loops below have block barriers in every tile, which drain the
// loads in flight at each tile boundary; with the tile two ahead already on its way to L2, the
// loads after a barrier wait for L2 instead of HBM. sm_90: one bulk prefetch (no registers, no
// shared memory); older GPUs: nothing.
template <typename T>
__device__ __forceinline__ void l2_prefetch_tile(const T* __restrict__ row, int64_t vocab,
                                                 int64_t base) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0 || base >= vocab) return;
  const int64_t end = min(vocab, base + (int64_t)kTile);
  const uintptr_t a0 = reinterpret_cast<uintptr_t>(row + base) & ~(uintptr_t)15;
  const uintptr_t a1 = (reinterpret_cast<uintptr_t>(row + end) + 15) & ~(uintptr_t)15;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(a0), "r"((uint32_t)(a1 - a0))
               : "memory");
#endif
}

// Loads this thread's kElems elements of tile `base`; out-of-range elements read -inf and are
// not allowed. VEC: elements base + tid*16 + j (16-byte loads); else base + j*kThreads + tid.
// load_tile_of: the same for thread `tid`'s elements (the plain draw re-reads one thread's).
template <typename T, bool VEC>
__device__ __forceinline__ void load_tile_of(const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                                             int64_t vocab, int64_t base, int tid, float (&x)[kElems],
                                             uint32_t& allow) {
  allow = 0;
  if constexpr (VEC) {
    const int64_t e0 = base + (int64_t)tid * kElems;
    constexpr int kPer = 16 / (int)sizeof(T);  // elements per 16-byte load
#pragma unroll
    for (int g = 0; g < kElems / kPer; ++g) {
      const int64_t e = e0 + g * kPer;
      if (e < vocab) {  // vocab % kPer == 0 on this path: a load is all in or all out
        const uint4 w = *reinterpret_cast<const uint4*>(row + e);
        if constexpr (sizeof(T) == 4) {
          x[g * 4 + 0] = __uint_as_float(w.x);
          x[g * 4 + 1] = __uint_as_float(w.y);
          x[g * 4 + 2] = __uint_as_float(w.z);
          x[g * 4 + 3] = __uint_as_float(w.w);
        } else {
          x[g * 8 + 0] = bf16_lo(w.x);
          x[g * 8 + 1] = bf16_hi(w.x);
          x[g * 8 + 2] = bf16_lo(w.y);
          x[g * 8 + 3] = bf16_hi(w.y);
          x[g * 8 + 4] = bf16_lo(w.z);
          x[g * 8 + 5] = bf16_hi(w.z);
          x[g * 8 + 6] = bf16_lo(w.w);
          x[g * 8 + 7] = bf16_hi(w.w);
        }
        allow |= ((1u << kPer) - 1u) << (g * kPer);
      } else {
#pragma unroll
        for (int j = 0; j < kPer; ++j) x[g * kPer + j] = -INFINITY;
      }
    }
    if (mask_row != nullptr && allow != 0) {
      const uint32_t word = (uint32_t)mask_row[e0 >> 5];  // 16 elements, 16-aligned: one word
      allow &= (word >> (e0 & 31)) & 0xffffu;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      const int64_t e = base + (int64_t)j * kThreads + tid;
      if (e < vocab) {
        x[j] = load_f(row + e);
        bool ok = true;
        if (mask_row != nullptr) ok = ((uint32_t)mask_row[e >> 5] >> (e & 31)) & 1u;
        allow |= (ok ? 1u : 0u) << j;
      } else {
        x[j] = -INFINITY;
      }
    }
  }
}

template <typename T, bool VEC>
__device__ __forceinline__ void load_tile(const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                                          int64_t vocab, int64_t base, float (&x)[kElems],
                                          uint32_t& allow) {
  load_tile_of<T, VEC>(row, mask_row, vocab, base, (int)threadIdx.x, x, allow);
}

// Streams a row tile by tile, the tile two ahead already on its way to L2 (l2_prefetch_tile):
// fn(x, allow, base) for each tile in order (block-uniform) from the tile at `begin` (a
// multiple of kTile); fn returns false to stop early.
template <typename T, bool VEC, typename F>
__device__ __forceinline__ void stream_row(const T* __restrict__ row,
                                           const int32_t* __restrict__ mask_row, int64_t vocab,
                                           F&& fn, int64_t begin = 0) {
  l2_prefetch_tile<T>(row, vocab, begin + kTile);
  for (int64_t base = begin; base < vocab; base += kTile) {
    l2_prefetch_tile<T>(row, vocab, base + 2 * (int64_t)kTile);
    float x[kElems];
    uint32_t allow;
    load_tile<T, VEC>(row, mask_row, vocab, base, x, allow);
    if (!fn(x, allow, base)) break;
  }
}

template <bool VEC>
__device__ __forceinline__ int64_t elem_index_of(int64_t base, int j, int tid) {
  if constexpr (VEC)
    return base + (int64_t)tid * kElems + j;
  else
    return base + (int64_t)j * kThreads + tid;
}

template <bool VEC>
__device__ __forceinline__ int64_t elem_index(int64_t base, int j) {
  return elem_index_of<VEC>(base, j, (int)threadIdx.x);
}

__device__ __forceinline__ uint64_t cand_key(float v, int32_t id) {
  return ((uint64_t)ordered_key(v) << 32) | (uint64_t)(~(uint32_t)id);
}

// The logit value of a candidate key (-inf for keys at or below -inf's, e.g. theta = 0): every
// candidate with key >= theta has value >= key_value(theta).
__device__ __forceinline__ float key_value(uint64_t key) {
  const uint32_t k = (uint32_t)(key >> 32);
  return k <= 0x007FFFFFu ? -INFINITY : __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// (max, sum exp(x - max)) pairs.
__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) { m = mx; s = 0.f; return; }
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

struct SampleShared {
  float val[kBufCap];     // candidate logits (also scratch on the streaming path)
  int32_t idx[kBufCap];   // candidate token ids
  uint32_t hist[256];
  uint32_t bins[kHistBins];  // two-pass top-p: counts (pass 1), then pass 2's tile masses (floats)
  float red_m[kWarps], red_s[kWarps], red_m2[kWarps], red_s2[kWarps];
  float red_bv[kWarps];
  int32_t red_bi[kWarps];
  float f_scratch[kWarps];
  int32_t i_scratch[kWarps];
  uint64_t theta;
  uint64_t sel_prefix;
  int32_t sel_remaining;
  int32_t sel_done;
  int32_t count;
  int32_t overflow;        // free-running pass 1: a warp's candidates did not fit
  int32_t chosen;
  float row_m_raw, row_s_raw, row_best_v, row_z;
  int32_t row_best_i;
  int32_t z_recompute;     // temperature 1: Z summed again relative to M (see kZGapMax)
  float scan_carry;
  uint32_t lo, hi;
  int32_t stop;
  int32_t win_lo, win_hi, win_tile;  // two-pass top-p: the window's bins, the drawn tile
  float anchor;                      // two-pass top-p: the bins' anchor
  double win_carry;                  // mass of the tiles before win_tile
  double win_target;                 // the draw's target (in the tile, or within the window)
  int32_t seg_owner, seg_pick;       // the plain draw: the thread holding it, the token drawn
  double seg_target;                 // the plain draw: its target within that thread's mass
};

// The kernel's dynamic shared memory (sample_smem_bytes(): one SampleShared).
extern __shared__ __align__(16) unsigned char smem_raw[];

// Block-wide scan of one float per thread. excl of thread i+1 is bit-identical to incl of
// thread i (and total to incl of the last thread), so the intervals [excl, incl) tile exactly.
__device__ __forceinline__ void block_scan(float v, float* warp_tot /* [kWarps] */, float& excl,
                                           float& incl, float& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float x = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, off);
    if (lane >= off) x += y;
  }
  const float prev = __shfl_up_sync(0xffffffffu, x, 1);
  __syncthreads();
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  float before = 0.f, all = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const float t = warp_tot[w];
    if (w < warp) before = before + t;
    all = all + t;
  }
  excl = lane == 0 ? before : before + prev;
  incl = before + x;
  total = all;
}

// Block-wide sum of one value per thread (float or int); scratch: [kWarps] in shared memory.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  V t = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += scratch[w];
  return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = fmaxf(t, scratch[w]);
  return t;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The two-pass top-p bin of x (see kHistBins): floor(f) clipped to [0, kHistBins - 1], where
// f = (A - x) * scale + kHeadBins and scale = kBinsPerNat / t. Rounded operations only (no
// contraction into an FMA), so both passes bin every token alike; non-increasing in x, so the
// bins order tokens by value: a lower bin holds only larger values.
__device__ __forceinline__ int hist_bin(float x, float anchor, float scale) {
  const float f = __fadd_rn(__fmul_rn(__fsub_rn(anchor, x), scale), (float)kHeadBins);
  // f < 0 (and x = +inf): bin 0; far below, -inf and NaN: the last bin
  return f < (float)(kHistBins - 1) ? __float2int_rz(fmaxf(f, 0.f)) : kHistBins - 1;
}

// A value under which every x bins past bin b: x <= bin_floor(A, scale, b) implies
// hist_bin(x, A, scale) > b (a bin of margin, and a relative one, for hist_bin's rounding), so
// one compare sorts most of a row's tokens out before any bin is computed. A finite.
__device__ __forceinline__ float bin_floor(float anchor, float scale, int b) {
  const float fl = anchor - (float)(b + 2 - kHeadBins) / scale;
  return fl - (fabsf(anchor) + fabsf(fl)) * 1e-6f;
}

// Bit j set where this thread's element j of the tile is allowed and above fl.
__device__ __forceinline__ uint32_t above_mask(const float (&x)[kElems], uint32_t allow, float fl) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < kElems; ++j) m |= (x[j] > fl ? 1u : 0u) << j;
  return m & allow;
}

// Exact block-wide selection: the k-th largest 64-bit candidate key among sm.val/idx[0, n),
// 1 <= k < n. Returns theta with exactly k candidates having key >= theta (keys are distinct).
__device__ uint64_t select_kth(SampleShared& sm, int n, int k) {
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    sm.sel_prefix = 0;
    sm.sel_remaining = k;
    sm.sel_done = 0;
  }
  for (int round = 0; round < 8; ++round) {
    const int shift = 56 - 8 * round;
    __syncthreads();
    if (tid < 256) sm.hist[tid] = 0;
    __syncthreads();
    const uint64_t prefix = sm.sel_prefix;
    // Warp-aggregated histogram: logits crowd into few digits (the exponent bits), so plain
    // shared atomics would serialise 32-way; one atomic per distinct digit per warp instead.
    for (int i0 = 0; i0 < n; i0 += kThreads) {
      const int i = i0 + tid;
      bool match = false;
      uint32_t digit = 0;
      if (i < n) {
        const uint64_t c = cand_key(sm.val[i], sm.idx[i]);
        match = round == 0 || ((c ^ prefix) >> (shift + 8)) == 0;
        digit = (uint32_t)(c >> shift) & 255u;
      }
      const uint32_t active = __ballot_sync(0xffffffffu, match);
      if (match) {
        const uint32_t peers = __match_any_sync(active, digit);
        if ((__ffs(peers) - 1) == lane) atomicAdd(&sm.hist[digit], (uint32_t)__popc(peers));
      }
    }
    __syncthreads();
    if (tid < 32) {
      const int remaining = sm.sel_remaining;
      // lane l owns bins 8*(31-l) .. 8*(31-l)+7, so the lane order runs from the top bins down
      const int top = 8 * (31 - lane) + 7;
      int own = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) own += (int)sm.hist[top - b];
      int incl = own;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += y;
      }
      const int excl = incl - own;
      if (excl < remaining && remaining <= incl) {
        int acc = excl;
        for (int b = 0; b < 8; ++b) {
          const int h = (int)sm.hist[top - b];
          if (acc + h >= remaining) {
            const int rem2 = remaining - acc;
            sm.sel_prefix = prefix | ((uint64_t)(top - b) << shift);
            sm.sel_remaining = rem2;
            sm.sel_done = (h == rem2) ? 1 : 0;
            break;
          }
          acc += h;
        }
      }
    }
    __syncthreads();
    if (sm.sel_done) break;
  }
  const uint64_t theta = sm.sel_prefix;
  __syncthreads();
  return theta;
}

// Keeps the candidates with key >= theta, packed at the front in their current order (stable,
// so the buffer's content is a deterministic function of the row); returns their number.
__device__ int compact_candidates(SampleShared& sm, int n, uint64_t theta) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int out = 0;
  for (int c0 = 0; c0 < n; c0 += kThreads) {
    const int i = c0 + threadIdx.x;
    float v = 0.f;
    int32_t id = 0;
    bool keep = false;
    if (i < n) {
      v = sm.val[i];
      id = sm.idx[i];
      keep = cand_key(v, id) >= theta;
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    __syncthreads();  // all reads of this chunk (and of i_scratch) done
    if (lane == 0) sm.i_scratch[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, tot = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int t = sm.i_scratch[w];
      before += w < warp ? t : 0;
      tot += t;
    }
    if (keep) {
      const int pos = out + before + __popc(ballot & ((1u << lane) - 1u));  // pos <= i
      sm.val[pos] = v;
      sm.idx[pos] = id;
    }
    out += tot;
  }
  __syncthreads();
  if (threadIdx.x == 0) sm.count = out;
  __syncthreads();
  return out;
}

// Ranks the n <= kTopKCap candidates sm.val/idx[0, n) by key, largest first, into
// sm.val/idx[kTopKCap + rank] (keys are distinct: ranks are a permutation of [0, n)). Ends with
// a barrier.
__device__ void rank_candidates(SampleShared& sm, int n) {
  float* sval = sm.val + kTopKCap;
  int32_t* sidx = sm.idx + kTopKCap;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const float v = sm.val[i];
    const int32_t id = sm.idx[i];
    const uint64_t c = cand_key(v, id);
    int rank = 0;
    for (int j = 0; j < n; ++j) rank += cand_key(sm.val[j], sm.idx[j]) > c ? 1 : 0;
    sval[rank] = v;
    sidx[rank] = id;
  }
  __syncthreads();
}

// The ranked candidates' weights e = exp(v / t - My), each thread owning ranks r0 = 2 tid and
// r1 = 2 tid + 1 (n <= kTopKCap = 2 kThreads), with their exclusive / inclusive prefix masses in
// rank order and the total.
struct RankPair {
  int r0, r1;
  float e0, e1, excl0, incl0, excl1, incl1, total;
};

__device__ RankPair scan_ranked(SampleShared& sm, int n, float inv_t, float My) {
  const float* sval = sm.val + kTopKCap;
  RankPair rp;
  rp.r0 = 2 * threadIdx.x;
  rp.r1 = rp.r0 + 1;
  rp.e0 = rp.r0 < n ? __expf(sval[rp.r0] * inv_t - My) : 0.f;
  rp.e1 = rp.r1 < n ? __expf(sval[rp.r1] * inv_t - My) : 0.f;
  float incl_t;
  block_scan(rp.e0 + rp.e1, sm.f_scratch, rp.excl0, incl_t, rp.total);
  rp.incl0 = rp.excl0 + rp.e0;
  rp.excl1 = rp.incl0;
  rp.incl1 = rp.incl0 + rp.e1;
  return rp;
}

// Kept ranks form a prefix [0, L) (k0 / k1: this thread's ranks are kept). Returns L and, in
// kept_mass, the inclusive mass of rank L - 1 (block-uniform).
__device__ int kept_prefix(SampleShared& sm, const RankPair& rp, bool k0, bool k1, float& kept_mass) {
  const int L = block_sum<int32_t>((k0 ? 1 : 0) + (k1 ? 1 : 0), sm.i_scratch);
  if (threadIdx.x == 0 && L == 0) sm.scan_carry = 0.f;
  if (rp.r0 == L - 1) sm.scan_carry = rp.incl0;
  if (rp.r1 == L - 1) sm.scan_carry = rp.incl1;
  __syncthreads();
  kept_mass = sm.scan_carry;
  __syncthreads();
  return L;
}

// The kept rank whose interval [excl, incl) holds target; the last kept rank L - 1 when
// rounding leaves target past every interval. Block-uniform.
__device__ int pick_rank(SampleShared& sm, const RankPair& rp, bool k0, bool k1, int L, double target) {
  if (threadIdx.x == 0) sm.chosen = INT32_MAX;
  __syncthreads();
  if (k0 && (double)rp.excl0 <= target && target < (double)rp.incl0) atomicMin(&sm.chosen, rp.r0);
  if (k1 && (double)rp.excl1 <= target && target < (double)rp.incl1) atomicMin(&sm.chosen, rp.r1);
  __syncthreads();
  const int rc = sm.chosen == INT32_MAX ? L - 1 : sm.chosen;
  __syncthreads();
  return rc;
}

// One tile of an inverse-CDF draw in token order. e[j]: the weight of this thread's element j
// of the tile at `base` (0: not kept). The thread whose interval [carry + excl, carry + incl)
// holds target claims its element (sm.chosen, atomicMin; sm.chosen = INT32_MAX beforehand);
// last_kept tracks the thread's last kept element. Returns the tile's total weight; ends with a
// barrier, after which sm.chosen says whether a thread claimed.
template <bool VEC>
__device__ __forceinline__ float claim_in_tile(SampleShared& sm, const float (&e)[kElems], int64_t base,
                               double carry, double target, int32_t& last_kept) {
  float tsum = 0.f;
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    tsum += e[j];
    if (e[j] > 0.f) last_kept = max(last_kept, (int32_t)elem_index<VEC>(base, j));
  }
  float excl, incl, total;
  block_scan(tsum, sm.f_scratch, excl, incl, total);
  const double start = carry + (double)excl, end = carry + (double)incl;
  if (start <= target && target < end) {
    double run = start;
    int32_t pick = -1;
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      if (e[j] > 0.f) {
        const double nxt = run + (double)e[j];
        if (pick < 0 && (target < nxt || nxt >= end)) pick = (int32_t)elem_index<VEC>(base, j);
        run = nxt;
      }
    }
    if (pick < 0) {  // rounding inside the thread: its last kept element
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        if (e[j] > 0.f) pick = (int32_t)elem_index<VEC>(base, j);
    }
    if (pick >= 0) atomicMin(&sm.chosen, pick);
  }
  __syncthreads();
  return total;
}

// The block's largest last_kept (-1: none); for a target that rounding left past the mass.
__device__ int32_t block_last_kept(SampleShared& sm, int32_t last_kept) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    last_kept = max(last_kept, __shfl_xor_sync(0xffffffffu, last_kept, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sm.i_scratch[threadIdx.x >> 5] = last_kept;
  __syncthreads();
  int32_t lk = -1;
  for (int w = 0; w < kWarps; ++w) lk = max(lk, sm.i_scratch[w]);
  return lk;
}

// Appends this thread's elements `mine` (bit j: element j of the tile at base) to the candidate
// buffer, warp-aggregated (one shared atomic per warp with a candidate), re-reading each value
// from the row (just loaded by this thread: an L1 hit) rather than indexing registers
// dynamically. guard: a warp whose candidates would not fit raises sm.overflow instead of
// writing. Called by whole warps.
template <typename T, bool VEC>
__device__ __forceinline__ void append_bits(SampleShared& sm, const T* __restrict__ row, uint32_t mine,
                                            int64_t base, bool guard) {
  const int lane = threadIdx.x & 31;
  if (!__any_sync(0xffffffffu, mine != 0u)) return;
  const int cnt = __popc(mine);
  int incl = cnt;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += y;
  }
  int wbase = 0;
  if (lane == 31 && incl > 0) wbase = atomicAdd(&sm.count, incl);  // lane 31: the warp total
  wbase = __shfl_sync(0xffffffffu, wbase, 31);
  if (guard && wbase + __shfl_sync(0xffffffffu, incl, 31) > kBufCap) {
    if (lane == 0) sm.overflow = 1;
    return;
  }
  int pos = wbase + incl - cnt;
  while (mine != 0u) {
    const int j = __ffs(mine) - 1;
    mine &= mine - 1u;
    const int64_t id = elem_index<VEC>(base, j);
    sm.val[pos] = load_f(row + id);
    sm.idx[pos] = (int32_t)id;
    ++pos;
  }
}

// ----------------------------------------------------------------------------- two-pass top-p
//
// For a top_p row (no top-k, min_p <= 1) whose nucleus the kSpecK buffer does not hold (flat
// rows). Pass 1 has counted the allowed tokens per bin (hist_bin, anchor A = the first tile's
// allowed max) and found M and Z. Then:
//   1. find_window: the bin where the mass from the top (exact over the buffer's kSpecK tokens,
//      every other token weighed at its bin's centre) reaches top_p * Z, widened by a bin each
//      side while the window's tokens fit the rank buffer (kTopKCap).
//   2. window_pass (pass 2): the tokens above the window are kept by top-p: their weights are
//      summed (all, for the top-p cut; and those with e >= min_p per tile, for the draw); the
//      window's tokens go to the candidate buffer.
//   3. the window is ranked (ties by token id, as on the top-k path) and the exact cut is taken
//      there: rank r is kept iff mass(above) + mass(ranks before r) < top_p * Z (and e >= min_p).
//      If the cut is not inside the window (the estimate missed, by rounding or a catch-all bin)
//      the row returns to the streaming search: the estimate never decides the kept set, only
//      which exact method computes it (the streaming search keeps every tie at its threshold).
//   4. the draw, target = u * mass(kept), over the kept tokens in the order (above the window,
//      by token id) then (the window's ranks): in the ranks, or in the one tile (tile masses
//      from pass 2) that holds the target, re-read once.
// Two passes over the logits and a tile, instead of pass 1 + ~5 search passes + 2.

struct TopPRow {  // a two-pass top-p row's block-uniform values
  float anchor, inv_t, My, p_mass, min_p;
  bool use_minp;
  int n_spec;       // the buffer's ranked tokens (sm.val[kTopKCap + r], r < n_spec): the row's best
  float spec_mass;  // and their mass (< p_mass: the buffer missed the nucleus)
  double u;
};

// Step 1 (see above); sets sm.win_lo / win_hi. The mass from the top is exact over the
// buffer's n_spec ranked tokens (the row's best: the last of them lies in bin b_last, and the bins
// above b_last hold buffer tokens only) and estimated below them, each token at its bin's centre,
// w_b = exp((centre of b - M) / t): the heavy tokens, whose rounding to a centre would move the
// estimate most, are the exact ones. False (sm.win_lo = -1): no usable window (bin 0 holds tokens
// beyond the buffer, the buffer reaches the bottom catch-all, the cut falls there, an overfull
// bin): the streaming search takes the row. Block-uniform; the bins are read until the caller's
// next barrier.
__device__ bool find_window(SampleShared& sm, const TopPRow& r) {
  constexpr int kPer = kHistBins / kThreads;  // bins per thread, consecutive
  const int tid = threadIdx.x, b0 = tid * kPer;
  const float scale = kBinsPerNat * r.inv_t;
  const float c0 = r.anchor * r.inv_t - r.My;  // (A - M) / t <= 0
  const float* sval = sm.val + kTopKCap;
  const int b_last = hist_bin(sval[r.n_spec - 1], r.anchor, scale);
  const bool last_is_mine = tid < r.n_spec && hist_bin(sval[tid], r.anchor, scale) == b_last;
  const uint32_t in_last = (uint32_t)block_sum<int32_t>(last_is_mine ? 1 : 0, sm.i_scratch);
  float mb[kPer], mine = 0.f;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int b = b0 + q;
    const uint32_t c = sm.bins[b];
    const uint32_t rest = b < b_last ? 0u : b == b_last ? (c > in_last ? c - in_last : 0u) : c;
    const float w = __expf(c0 - ((float)(b - kHeadBins) + 0.5f) * (1.f / kBinsPerNat));
    mb[q] = w * (float)rest + (b == b_last ? r.spec_mass : 0.f);
    mine += mb[q];
  }
  if (tid == 0) sm.win_lo = -1;
  float excl, incl, total;
  block_scan(mine, sm.f_scratch, excl, incl, total);
  const bool usable = b_last < kHistBins - 1 && !(b_last == 0 && sm.bins[0] > in_last);
  if (usable && excl < r.p_mass && r.p_mass <= incl) {  // one thread: the intervals tile exactly
    float acc = excl;
    int bs = -1;
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      if (bs >= 0 && acc >= r.p_mass) break;
      if (mb[q] == 0.f && sm.bins[b0 + q] == 0u) continue;
      bs = b0 + q;
      acc += mb[q];
    }
    const uint32_t c = sm.bins[bs];
    if (bs > 0 && bs < kHistBins - 1 && c <= (uint32_t)kTopKCap) {
      int lo = bs, hi = bs;
      if (bs > 1 && bs < kHistBins - 2 && sm.bins[bs - 1] + c + sm.bins[bs + 1] <= (uint32_t)kTopKCap) {
        lo = bs - 1;
        hi = bs + 1;
      }
      sm.win_lo = lo;
      sm.win_hi = hi;
    }
  }
  __syncthreads();
  return sm.win_lo >= 0;
}

// Step 2, the second pass (no block barriers): per warp and tile, the weights of the kept
// tokens above the window (bins < lo, e >= min_p) into sm.bins as floats [tile][warp]; above /
// n_above: this thread's weight and count of all tokens above the window; n_below: its allowed
// tokens under it; the window's tokens (bins lo..hi) appended to the candidate buffer (sm.count
// reset by the caller; pass 1 counted them, and the guarded append would raise sm.overflow if
// they did not fit).
template <typename T, bool VEC>
__device__ void window_pass(SampleShared& sm, const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                            int64_t vocab, const TopPRow& r, int lo, int hi, float& above,
                            int& n_above, int& n_below) {
  const float scale = kBinsPerNat * r.inv_t;
  const float fl = bin_floor(r.anchor, scale, hi);   // x <= fl: under the window
  float* part = reinterpret_cast<float*>(sm.bins);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t base) {
    float kept = 0.f;
    uint32_t cand = 0;
    uint32_t near = above_mask(x, allow, fl);
    n_below += __popc(allow & ~near);
    while (near != 0u) {   // the few tokens above fl, their values again from L1
      const int j = __ffs(near) - 1;
      near &= near - 1u;
      const float xv = load_f(row + elem_index<VEC>(base, j));
      const int b = hist_bin(xv, r.anchor, scale);
      if (b < lo) {
        const float e = __expf(xv * r.inv_t - r.My);
        above += e;
        ++n_above;
        kept += (!r.use_minp || e >= r.min_p) ? e : 0.f;
      } else if (b <= hi) {
        cand |= 1u << j;
      } else {
        ++n_below;
      }
    }
    kept = warp_sum(kept);
    if (lane == 0) part[(int)(base / kTile) * kWarps + warp] = kept;
    append_bits<T, VEC>(sm, row, cand, base, true);
    return true;
  });
}

// Step 4 for a target among the tokens above the window: thread 0 finds the tile (sm.win_tile,
// sm.win_carry = the mass of the tiles before it); the tile is read again and claimed in token
// order. Returns the token id, or -1 (nothing kept in the tile: not expected). Block-uniform.
template <typename T, bool VEC>
__device__ int32_t draw_in_tile(SampleShared& sm, const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                                int64_t vocab, const TopPRow& r, int lo) {
  const int64_t base = (int64_t)sm.win_tile * kTile;
  const double carry = sm.win_carry, target = sm.win_target;
  const float scale = kBinsPerNat * r.inv_t;
  float x[kElems], e[kElems];
  uint32_t allow;
  load_tile<T, VEC>(row, mask_row, vocab, base, x, allow);
#pragma unroll
  for (int j = 0; j < kElems; ++j) {
    e[j] = 0.f;
    if (((allow >> j) & 1u) && hist_bin(x[j], r.anchor, scale) < lo) {
      const float ev = __expf(x[j] * r.inv_t - r.My);
      if (!r.use_minp || ev >= r.min_p) e[j] = ev;
    }
  }
  int32_t last_kept = -1;
  claim_in_tile<VEC>(sm, e, base, carry, target, last_kept);  // sm.chosen reset by thread 0
  const int32_t found = sm.chosen;
  return found != INT32_MAX ? found : block_last_kept(sm, last_kept);
}

// Steps 1-4 (see above). Returns false, having drawn nothing, when the row needs the streaming
// search; else sets chosen. Block-uniform.
template <typename T, bool VEC>
__device__ __noinline__ bool window_draw(SampleShared& sm, const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                            int64_t vocab, const TopPRow& r, int64_t& chosen) {
  const int tid = threadIdx.x;
  if (!find_window(sm, r)) return false;
  const int lo = sm.win_lo, hi = sm.win_hi;
  if (tid == 0) sm.count = 0;
  __syncthreads();  // the bins are read: pass 2 reuses them
  float above = 0.f;
  int n_above = 0, n_below = 0;
  window_pass<T, VEC>(sm, row, mask_row, vocab, r, lo, hi, above, n_above, n_below);
  const float mass_above = block_sum<float>(above, sm.f_scratch);  // after every append landed
  const int na = block_sum<int32_t>(n_above, sm.i_scratch);
  const int nb = block_sum<int32_t>(n_below, sm.i_scratch);
  const int n = sm.count;
  if (n == 0 || n > kTopKCap || sm.overflow) return false;  // (not expected: pass 1 counted them)

  // 3. the exact cut inside the window
  rank_candidates(sm, n);
  const RankPair rp = scan_ranked(sm, n, r.inv_t, r.My);
  const float e_last = __expf(sm.val[kTopKCap + n - 1] * r.inv_t - r.My);
  const bool cut_above = na > 0 && !(mass_above < r.p_mass);
  const bool cut_below = nb > 0 && mass_above + rp.total < r.p_mass && !(r.use_minp && !(e_last >= r.min_p));
  if (cut_above || cut_below) return false;
  auto keep = [&](int rk, float excl, float e) {
    if (rk >= n) return false;
    if (rk == 0 && na == 0) return true;  // the row's first token
    return mass_above + excl < r.p_mass && (!r.use_minp || e >= r.min_p);
  };
  const bool k0 = keep(rp.r0, rp.excl0, rp.e0), k1 = keep(rp.r1, rp.excl1, rp.e1);
  float window_kept;
  const int L = kept_prefix(sm, rp, k0, k1, window_kept);

  // 4. the draw: the tiles' kept masses (pass 2's warp partials), then target = u * mass(kept)
  const int ntiles = (int)((vocab + kTile - 1) / kTile);
  float* tile_mass = sm.val + 2 * kTopKCap;
  const float* part = reinterpret_cast<const float*>(sm.bins);
  for (int t = tid; t < ntiles; t += kThreads) {
    float m = 0.f;
    for (int w = 0; w < kWarps; ++w) m += part[t * kWarps + w];
    tile_mass[t] = m;
  }
  __syncthreads();
  if (tid == 0) {
    double K = 0.0;
    for (int t = 0; t < ntiles; ++t) K += (double)tile_mass[t];
    const double target = r.u * (K + (double)window_kept);
    sm.win_tile = -1;
    sm.win_target = target - K;
    sm.chosen = INT32_MAX;
    if (target < K) {  // among the tokens above the window: the tile holding it
      double cum = 0.0;
      for (int t = 0; t < ntiles; ++t) {
        if (tile_mass[t] > 0.f) {
          sm.win_tile = t;  // the last tile with mass, if rounding passes them all
          sm.win_carry = cum;
          if (target < cum + (double)tile_mass[t]) break;
        }
        cum += (double)tile_mass[t];
      }
      sm.win_target = target;
    }
  }
  __syncthreads();
  if (sm.win_tile >= 0) {
    const int32_t id = draw_in_tile<T, VEC>(sm, row, mask_row, vocab, r, lo);
    if (id < 0) return false;
    chosen = id;
    return true;
  }
  if (L == 0) return false;
  chosen = sm.idx[kTopKCap + pick_rank(sm, rp, k0, k1, L, sm.win_target)];
  return true;
}

// Which tokens a streaming draw keeps, and their weight e (relative to M / t): allowed, key
// above lo (0: none cut), and e >= min_p where min-p is on. Block-uniform values.
struct KeptRule {
  float inv_t, My, min_p;
  uint32_t lo;
  bool use_minp;
  __device__ __forceinline__ float weight(float x, bool allowed) const {
    if (!allowed || ordered_key(x) <= lo) return 0.f;
    const float e = __expf(x * inv_t - My);
    return (use_minp && !(e >= min_p)) ? 0.f : e;
  }
};

// The draw in thread order, without a pass of its own. Order the row's tokens thread by thread
// (thread 0's elements of tile 0, 1, ..., then thread 1's): given each thread's mass of its own
// kept elements, w (relative to M / t), a block scan of w places u * (sum of w) in one
// thread's elements. That thread's warp re-reads them, one tile per lane: a warp scan of the
// lanes' masses names the tile, and the lane walks its elements. Any fixed order of the tokens
// draws from the same distribution. Plain rows (temperature only) take w from pass 1, so they
// draw in one pass; the streaming rows sum w in one pass once their kept set is known. Returns
// the token drawn, or -1 where rounding leaves the target outside every recomputed interval or
// the masses are not finite (the block-synchronised draw then runs). Block-uniform.
template <typename T, bool VEC>
__device__ __noinline__ int32_t thread_order_draw(SampleShared& sm, const T* __restrict__ row,
                                                  const int32_t* __restrict__ mask_row,
                                                  int64_t vocab, float w, KeptRule rule, double u) {
  const int tid = threadIdx.x, lane = tid & 31;
  float excl, incl, total;
  block_scan(w, sm.f_scratch, excl, incl, total);
  if (!(total > 0.f && total < INFINITY)) return -1;      // uniform: block_scan's total
  const double target = u * (double)total;                // u < 1: below total
  if (tid == 0) {
    sm.seg_owner = -1;
    sm.seg_pick = -1;
  }
  __syncthreads();
  // the intervals [excl, incl) tile [0, total) exactly (block_scan): one thread holds target
  if (w > 0.f && (double)excl <= target && target < (double)incl) {
    sm.seg_owner = tid;
    sm.seg_target = target - (double)excl;
  }
  __syncthreads();
  const int owner = sm.seg_owner;
  if (owner < 0) return -1;
  if ((tid >> 5) == (owner >> 5)) {
    // the owner's warp: lane L reads the owner's elements of tile c + L, 32 tiles at a time
    const double rel = sm.seg_target;
    double carry = 0.0;
    int32_t last = -1;                 // the owner's last element with mass (rounding)
    int32_t pick = -1;
    const int64_t ntiles = (vocab + kTile - 1) / kTile;
    for (int64_t c = 0; c < ntiles && pick < 0; c += 32) {
      const int64_t base = (c + lane) * kTile;
      float e[kElems];
      float lsum = 0.f;
#pragma unroll
      for (int j = 0; j < kElems; ++j) e[j] = 0.f;
      if (base < vocab) {
        float x[kElems];
        uint32_t allow;
        load_tile_of<T, VEC>(row, mask_row, vocab, base, owner, x, allow);
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          e[j] = rule.weight(x[j], (allow >> j) & 1u);
          lsum += e[j];
          if (e[j] > 0.f) last = max(last, (int32_t)elem_index_of<VEC>(base, j, owner));
        }
      }
      float sc = lsum;                 // inclusive warp scan of the lanes' masses
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float y = __shfl_up_sync(0xffffffffu, sc, off);
        if (lane >= off) sc += y;
      }
      const float before = __shfl_up_sync(0xffffffffu, sc, 1);
      const double start = carry + (lane == 0 ? 0.0 : (double)before), end = carry + (double)sc;
      int32_t mine = -1;
      if (lsum > 0.f && start <= rel && rel < end) {
        double run = start;
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          if (e[j] > 0.f) {
            const double nxt = run + (double)e[j];
            if (mine < 0 && (rel < nxt || nxt >= end)) mine = (int32_t)elem_index_of<VEC>(base, j, owner);
            run = nxt;
          }
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mine = max(mine, __shfl_xor_sync(0xffffffffu, mine, off));
      pick = mine;                     // one lane at most claims (its interval holds rel)
      carry += (double)__shfl_sync(0xffffffffu, sc, 31);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, off));
    if (lane == 0) sm.seg_pick = pick >= 0 ? pick : last;
  }
  __syncthreads();
  return sm.seg_pick;
}

// ----------------------------------------------------------------------------- the kernel's phases
//
// bitmask_sample_kernel is the sequence of the phases below, one CTA per row; "block-uniform" as
// for the helpers above, shared memory is SampleShared's, the fields named in each phase's
// comment. Each phase is __forceinline__ and keeps the one-body kernel's arithmetic, barriers
// and statement order (cd951ae), and the split is held to that kernel's machine code: for
// sm_80, sm_90a, sm_100a and sm_120 the cubin of all four instantiations (float / bf16, VEC or
// not) is identical to it, so the split can be neither slower nor draw differently. The
// compiler optimizes each function on its own before inlining it, which can change the kernel
// even through __forceinline__ (an earlier split, 7fc86b4, spilled 16 bytes more in two fp32
// instantiations and measured 0.3-3.4% slower on an H100, bench/results/h100-2026-12-06.md).
// The interfaces below are the ones that keep the machine code identical; "(SASS)" marks each
// choice where a more natural interface did not. To check a change: build the kernels (e.g.
// bench/variants/sample_sweep.cu, csrc/harness/test_sampling.cu) with nvcc -cubin against this
// header and against cd951ae's and compare the two files.
//   row_params             the row's sampling parameters (registers)
//   (kernel)               the paths they select: spec, k_buf, buffer_path, plain, hist_row
//   init_row_shared        the candidate buffer's counters, the two-pass bins
//   pass1                  the one pass every row takes -> Pass1State per thread, the candidate
//                          buffer (append_candidates, settle_candidates), the two-pass bins
//   recollect_candidates   buffer rows whose guarded appends overflowed collect again
//   reduce_row_stats       warp shuffles of the pass-1 state -> sm.red_*
//   (kernel)               thread 0's combine -> sm.row_*, sm.z_recompute
//   sum_z_again            Z again (temperature 1, allowed max far below the raw max)
//   the draw (sampled rows with an allowed token), each only where none before drew:
//     plain_draw             temperature only: the thread-order draw on pass 1's masses
//     buffer_draw            top-k rows, and top_p / min_p rows whose kept set the buffer holds
//     window_draw            the two-pass top-p (above)
//     threshold_search, streaming_draw    the streaming path
//     kept_mass, (kernel) stream_row over fallback_tile    the block-synchronised draw
//   write_out              id and logprob
// Left in the kernel body (SASS): the path selectors and thread 0's combine (as functions,
// the compiler folded their && chains into selects where the one-body kernel branches), and
// the block-synchronised draw's sampling pass (its stream_row over fallback_tile): in a
// function of its own the loop set last_kept's -1 elsewhere on sm_100a / sm_120, and with the
// sm.chosen reset or the block_last_kept call inside, it turned thread 0's combine into
// selects on sm_90a too.

// The row's sampling parameters (block-uniform, registers).
struct RowParams {
  bool greedy;     // temperature <= 0: the first allowed argmax
  float inv_t;     // 1 / temperature (temperature clamped to 1e-6)
  bool t1;         // temperature 1: one exp per element serves the logsumexp and Z
  int64_t k_eff;   // top-k, 0: off
  float top_p;
  bool use_p;      // top_p < 1
  float min_p;
  bool use_minp;   // min_p > 0
};

// Phase: reads the row's temperature, top_k, top_p and min_p (global). No shared memory.
__device__ __forceinline__ RowParams row_params(const SampleParams& p, int64_t row_id) {
  const int64_t vocab = p.vocab;
  const float temp = p.temperature[row_id];
  const bool greedy = !(temp > 0.f);
  const float inv_t = 1.f / fmaxf(temp, 1e-6f);
  // Temperature 1: e = exp(x - m) serves both the logsumexp and Z (one exp per element, not
  // two; pass 1 is issue-bound). Z is then summed relative to the raw max m instead of the
  // allowed max M; see kZGapMax for when it is recomputed.
  const bool t1 = temp == 1.f;
  const int64_t k_raw = p.top_k[row_id];
  const int64_t k_eff = (k_raw <= 0 || k_raw >= vocab) ? 0 : k_raw;  // 0: top-k off
  const float top_p = p.top_p[row_id];
  const bool use_p = top_p < 1.f;
  const float min_p = p.min_p[row_id];
  const bool use_minp = min_p > 0.f;
  return RowParams{greedy, inv_t, t1, k_eff, top_p, use_p, min_p, use_minp};
}

// Phase: thread 0 empties the candidate buffer (sm.count, sm.overflow, sm.theta); a hist_row
// row zeroes the two-pass bins (sm.bins). Ends with a barrier.
__device__ __forceinline__ void init_row_shared(SampleShared& sm, bool hist_row) {
  const int tid = threadIdx.x;
  if (tid == 0) {
    sm.count = 0;
    sm.overflow = 0;
    sm.theta = 0;
  }
  if (hist_row)
    for (int i = tid; i < kHistBins; i += kThreads) sm.bins[i] = 0u;
  __syncthreads();
}

// Appends this thread's allowed elements of the tile x (at base) whose value is >= theta's
// value: a superset of the keys >= theta (ties on the value), which the exact selects trim.
// Pass 1 is issue-bound, so this is lean: one compare per element, and only a warp with a
// candidate goes on (append_bits: sm.val / idx / count, sm.overflow). guard (free-running):
// see append_bits.
template <typename T, bool VEC>
__device__ __forceinline__ void append_candidates(SampleShared& sm, const T* __restrict__ row,
                                                  uint64_t theta, const float (&x)[kElems],
                                                  uint32_t allow, int64_t base, bool guard) {
  const float theta_f = key_value(theta);
  uint32_t mine = 0;
#pragma unroll
  for (int j = 0; j < kElems; ++j) mine |= (x[j] >= theta_f ? 1u : 0u) << j;
  append_bits<T, VEC>(sm, row, mine & allow, base, guard);
}

// Block-synchronised, after a tile: raise theta to the k_buf-th largest key and compact once
// the buffer holds more than `limit` candidates. strict (limit kBufCap - kTile; also while
// theta is unset): the next tile cannot overflow. Loose (loose_limit: kLooseFactor k, at most
// kBufCap - 2 k): fewer selects for large k (strict selects after every tile at k = 1000), and
// a tile that would overflow raises sm.overflow through the guarded append instead; from then
// on nothing is selected (the buffer misses candidates) and the row collects again, strictly,
// after pass 1 (recollect_candidates). Shared: sm.count, sm.overflow, and select_kth /
// compact_candidates's. k_buf and loose_limit by reference (SASS): by value, sm_100a
// sign-extended the count where the one-body kernel zero-extends it.
__device__ __forceinline__ void settle_candidates(SampleShared& sm, uint64_t& theta,
                                                  const int64_t& k_buf, const int& loose_limit,
                                                  bool strict) {
  __syncthreads();
  const int n = sm.count;
  const bool overflowed = sm.overflow != 0;
  __syncthreads();  // every thread has read count before the next tile appends
  const int limit = (strict || theta == 0) ? kBufCap - kTile : loose_limit;
  if (!overflowed && n > limit && n > k_buf) {
    theta = select_kth(sm, n, (int)k_buf);
    compact_candidates(sm, n, theta);
  }
}

// Pass 1's per-thread state (registers), reduced over the block by reduce_row_stats. The field
// order is not the reading order (SASS): it sets the order of the pass-1 loop's phi copies,
// and this is the order that reproduces the one-body kernel's.
struct Pass1State {
  uint64_t theta = 0;           // buffer rows: the candidate threshold key (0: unset)
  int32_t best_i = INT32_MAX;   // first argmax of the allowed logits
  bool hist_on = false;         // the row bins (hist_row, and its first tile gave a finite anchor)
  // Rows with top_k <= kFreeRunTopK run pass 1 without block barriers once theta is set from
  // the first tile: warps append with one atomic each, and a warp whose candidates would not
  // fit raises sm.overflow instead of writing; the candidates are then collected again
  // (recollect_candidates; rare: the first tile's theta keeps about k candidates per tile).
  // Other buffer rows settle after every tile; they too may overflow and collect again.
  bool free_run = false;
  float best_v = -INFINITY;     // allowed max
  float s_y = 0.f;              // sum exp(x/t - best_v/t) over allowed (t1: exp(x - m_raw))
  float s_raw = 0.f;            // online (max, sum exp) of the raw logits, all tokens
  float m_raw = -INFINITY;
};

// Phase: pass 1 from the tile at `begin` into st, compiled twice: with the two-pass top-p bins
// (kHist) and without, so that rows without them keep pass 1's registers. Per tile: the online
// (max, sum exp) of the raw logits, the first allowed argmax, the online sum of the allowed
// exp(x/t - running max/t) (at t = 1 the logsumexp's exp, see kZGapMax). kHist: the bins
// (sm.bins, anchored at the first tile's allowed max, sm.anchor; sm.f_scratch); st.hist_on is
// set at the first tile, and a row that does not bin stops here (the caller goes on without
// kHist). Buffer rows: theta from the first tile (sm.val / idx[0, kThreads), select_kth's),
// then the candidates appended (and settled unless free-running).
template <typename T, bool VEC, bool kHist>
__device__ __forceinline__ void pass1(SampleShared& sm, const T* __restrict__ row,
                                      const int32_t* __restrict__ mask_row, int64_t vocab,
                                      bool greedy, bool t1, float inv_t, bool buffer_path,
                                      int64_t k_buf, int loose_limit, Pass1State& st,
                                      int64_t begin) {
  const int tid = threadIdx.x;
  stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t base) {
    float vm = -INFINITY, bm = -INFINITY;
    int jb = -1;
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      vm = fmaxf(vm, x[j]);
      if (((allow >> j) & 1u) && x[j] > bm) {
        bm = x[j];
        jb = j;
      }
    }
    if (vm > st.m_raw) {
      const float c = __expf(st.m_raw - vm);
      st.s_raw *= c;
      if (t1) st.s_y *= c;
      st.m_raw = vm;
    }
    if (st.m_raw != -INFINITY) {
      if (t1) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          const float e = __expf(x[j] - st.m_raw);
          st.s_raw += e;
          st.s_y += ((allow >> j) & 1u) ? e : 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kElems; ++j) st.s_raw += __expf(x[j] - st.m_raw);
      }
    }
    if (bm > st.best_v) {
      if (!greedy && !t1) st.s_y *= __expf((st.best_v - bm) * inv_t);
      st.best_v = bm;
      st.best_i = (int32_t)elem_index<VEC>(base, jb);
    }
    if (!greedy && !t1 && st.best_v != -INFINITY) {
      const float my = st.best_v * inv_t;
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        if ((allow >> j) & 1u) st.s_y += __expf(x[j] * inv_t - my);
    }
    if constexpr (kHist) {
      // the anchor lives in shared memory (pass 1 is short of registers), read after the
      // first tile's __syncthreads_count below
      float a;
      if (base == 0) {
        a = block_max(bm, sm.f_scratch);
        if (tid == 0) sm.anchor = a;
        st.hist_on = a > -INFINITY && a < INFINITY;   // pass 2's bin_floor needs a finite anchor
      } else {
        a = sm.anchor;
      }
      const float sc = kBinsPerNat * inv_t;
      // bins are monotone in x: a thread whose allowed max falls under the span skips the
      // tile. Unrolled over the registers, every element binned and counted under a
      // predicate: measured against a compare-first loop over the few elements in the span
      // (values again from L1), which cost a flat row 86 us here instead of ~19.
      if (st.hist_on && hist_bin(bm, a, sc) < kHistBins - 1) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          const int b = hist_bin(x[j], a, sc);
          if (((allow >> j) & 1u) && b < kHistBins - 1) atomicAdd(&sm.bins[b], 1u);
        }
      }
    }
    if (buffer_path && base == 0 && k_buf <= kThreads) {
      // First tile: theta starts at the k-th largest of the threads' best keys (the k elements
      // behind them are >= it, so theta stays <= the row's k-th largest key); the tile then
      // appends about k candidates instead of all kTile, and the select over kTile keys it
      // used to trigger becomes one over kThreads keys. Threads without a finite allowed
      // element offer the smallest key; with fewer than k such threads theta stays 0.
      if (__syncthreads_count(jb >= 0) >= k_buf) {
        sm.val[tid] = jb >= 0 ? bm : -INFINITY;
        sm.idx[tid] = jb >= 0 ? (int32_t)elem_index<VEC>(base, jb) : INT32_MAX;
        st.theta = select_kth(sm, kThreads, (int)k_buf);  // starts and ends with a barrier
        st.free_run = k_buf <= kFreeRunTopK;
      }
    }
    if (buffer_path) {
      append_candidates<T, VEC>(sm, row, st.theta, x, allow, base, true);
      if (!st.free_run) settle_candidates(sm, st.theta, k_buf, loose_limit, false);
    }
    return !kHist || st.hist_on;  // a top_p row that does not bin goes on without kHist
  }, begin);
}

// Phase (buffer rows), after pass 1: once every append landed (a barrier), a row whose guarded
// append raised sm.overflow collects its candidates again from the start (sm.count reset),
// block-synchronised and settled strictly after every tile. theta is still a lower bound of
// the row's k-th largest key (set from complete buffers). Block-uniform.
template <typename T, bool VEC>
__device__ __forceinline__ void recollect_candidates(SampleShared& sm, const T* __restrict__ row,
                                                     const int32_t* __restrict__ mask_row,
                                                     int64_t vocab, int64_t k_buf, int loose_limit,
                                                     uint64_t& theta) {
  __syncthreads();  // every append landed, sm.overflow final
  if (sm.overflow) {
    __syncthreads();  // every thread read the flag
    if (threadIdx.x == 0) {
      sm.count = 0;
      sm.overflow = 0;
    }
    for (int64_t base = 0; base < vocab; base += kTile) {
      __syncthreads();
      float x[kElems];
      uint32_t allow;
      load_tile<T, VEC>(row, mask_row, vocab, base, x, allow);
      append_candidates<T, VEC>(sm, row, theta, x, allow, base, false);
      settle_candidates(sm, theta, k_buf, loose_limit, true);
    }
  }
}

// Phase: the warp-level reduction of every thread's pass-1 state (st, a copy): lse_combine of
// (m_raw, s_raw), of (sy_ref, s_y) unless greedy, the first argmax (best_v, best_i); lane 0's
// results in sm.red_m / red_s / red_bv / red_bi / red_m2 / red_s2 [warp]. sy_ref: s_y's
// reference, the thread's m_raw at temperature 1, else its best_v / t (the kernel's own_ref,
// which the plain draw reads too; the parameter itself is the running value (SASS): a local
// copy of it reordered the shuffles). Ends with a barrier; thread 0's combine in the kernel
// reads sm.red_*.
__device__ __forceinline__ void reduce_row_stats(SampleShared& sm, bool greedy, float sy_ref,
                                                 Pass1State st) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, st.m_raw, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, st.s_raw, off);
    lse_combine(st.m_raw, st.s_raw, m2, s2);
    const float bv2 = __shfl_xor_sync(0xffffffffu, st.best_v, off);
    const int32_t bi2 = __shfl_xor_sync(0xffffffffu, st.best_i, off);
    const float r2 = __shfl_xor_sync(0xffffffffu, sy_ref, off);
    const float y2 = __shfl_xor_sync(0xffffffffu, st.s_y, off);
    if (!greedy) lse_combine(sy_ref, st.s_y, r2, y2);
    if (bv2 > st.best_v || (bv2 == st.best_v && bi2 < st.best_i)) {
      st.best_v = bv2;
      st.best_i = bi2;
    }
  }
  if (lane == 0) {
    sm.red_m[warp] = st.m_raw;
    sm.red_s[warp] = st.s_raw;
    sm.red_bv[warp] = st.best_v;
    sm.red_bi[warp] = st.best_i;
    sm.red_m2[warp] = sy_ref;
    sm.red_s2[warp] = st.s_y;
  }
  __syncthreads();
}

// One streaming pass: the block-wide sum over the row of f(x, allowed) (block_sum:
// sm.f_scratch). Block-uniform.
template <typename T, bool VEC, typename F>
__device__ __forceinline__ float row_sum(SampleShared& sm, const T* __restrict__ row,
                                         const int32_t* __restrict__ mask_row, int64_t vocab, F f) {
  float acc = 0.f;
  stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t) {
#pragma unroll
    for (int j = 0; j < kElems; ++j) acc += f(x[j], (allow >> j) & 1u);
    return true;
  });
  return block_sum<float>(acc, sm.f_scratch);
}

// Phase (sm.z_recompute rows): temperature 1 and the allowed max M far below the raw max:
// allowed terms that underflowed relative to m may matter relative to M. Returns Z = sum
// exp(x - M) over allowed, summed again (row_sum). Block-uniform.
template <typename T, bool VEC>
__device__ __forceinline__ float sum_z_again(SampleShared& sm, const T* __restrict__ row,
                                             const int32_t* __restrict__ mask_row, int64_t vocab,
                                             float M) {
  return row_sum<T, VEC>(sm, row, mask_row, vocab,
                         [&](float xv, uint32_t allowed) { return allowed ? __expf(xv - M) : 0.f; });
}

// Phase (plain rows: temperature only, Z not summed again): the draw without a second pass.
// w: this thread's pass-1 mass of its allowed elements (own_s, relative to own_ref) relative to
// M / t; thread_order_draw places u * (sum of w) (its shared memory: sm.f_scratch, sm.seg_*).
// Returns the id, -1 where it drew none (the fallback draws). Block-uniform.
template <typename T, bool VEC>
__device__ __forceinline__ int32_t plain_draw(SampleShared& sm, const T* __restrict__ row,
                                              const int32_t* __restrict__ mask_row, int64_t vocab,
                                              float own_ref, float own_s, float inv_t, float My,
                                              double u) {
  const float w = (own_s > 0.f && own_ref > -INFINITY) ? own_s * __expf(own_ref - My) : 0.f;
  return thread_order_draw<T, VEC>(sm, row, mask_row, vocab, w, KeptRule{inv_t, My, 0.f, 0u, false}, u);
}

// Phase (buffer rows): the top-k path, all in shared memory. The candidates sm.val / idx[0,
// sm.count) are selected down to k_buf, ranked into sm.val / idx[kTopKCap + rank] and scanned
// in rank order (spec_n, spec_mass: how many and their mass, for window_draw). Where the kept
// set lies in the buffer (top-k rows; spec rows where it is covered) it is the ranks' prefix
// that top_p / min_p keep: chosen is drawn from it at u * mass(kept) and drawn set.
// Block-uniform. (SASS) drawn set here as in the one-body kernel (a returned flag swapped a
// predicate's operands) and k_buf by reference (by value, sm_100a ordered the covered test's
// predicates differently).
__device__ __forceinline__ void buffer_draw(SampleShared& sm, const int64_t& k_buf, bool spec,
                                            bool use_p, bool use_minp, float top_p, float min_p,
                                            float inv_t,
                                            float Z, float My, double u, int64_t& chosen,
                                            bool& drawn, int& spec_n, float& spec_mass) {
  int n = sm.count;
  if (n > k_buf) {
    const uint64_t th = select_kth(sm, n, (int)k_buf);
    n = compact_candidates(sm, n, th);
  }
  rank_candidates(sm, n);
  spec_n = n;
  const RankPair rp = scan_ranked(sm, n, inv_t, My);
  spec_mass = rp.total;
  const float p_mass = top_p * Z;
  // spec: the buffer holds the kept set when the row has fewer than k_buf allowed tokens,
  // or the next token (rank n) would not be kept (uniform: block-wide values only)
  const bool covered = !spec || n < k_buf || (use_p && !(rp.total < p_mass)) ||
                       (use_minp && !(__expf(sm.val[kTopKCap + n - 1] * inv_t - My) >= min_p));
  if (covered) {
    auto keep = [&](int r, float excl, float e) {
      if (r >= n) return false;
      if (r == 0) return true;
      return (!use_p || excl < p_mass) && (!use_minp || e >= min_p);
    };
    const bool k0 = keep(rp.r0, rp.excl0, rp.e0), k1 = keep(rp.r1, rp.excl1, rp.e1);
    float kept_mass;
    const int L = kept_prefix(sm, rp, k0, k1, kept_mass);
    chosen = sm.idx[kTopKCap + pick_rank(sm, rp, k0, k1, L, u * (double)kept_mass)];
    drawn = true;
  }
}

// Phase (streaming rows with top-p or a top-k): the threshold search over the 32-bit ordered
// float keys (see the top of the file), kPivots pivots a pass, one streaming pass each. Returns
// lo: the kept tokens are the allowed ones with key > lo. Shared: sm.idx / val[0, kWarps *
// kPivots) (the warps' counts and masses), sm.lo / hi / stop / count / scan_carry.
// Block-uniform. (SASS) It takes the kernel's tid / lane / warp and the arrays that live in
// local memory (piv [kPivots]: this pass's pivots; c, ms [kPivots + 1]: thread 0's counts and
// masses above each pivot) from the kernel, and the shared memory from smem_raw rather than
// as a reference (through which the warps' stores took an extra address add each).
template <typename T, bool VEC>
__device__ __forceinline__ uint32_t threshold_search(const T* __restrict__ row,
                                                     const int32_t* __restrict__ mask_row,
                                                     int64_t vocab, int64_t k_eff, bool use_p,
                                                     float top_p, float inv_t, float M, float My,
                                                     float Z, int tid, int lane, int warp,
                                                     uint32_t (&piv)[kPivots],
                                                     int (&c)[kPivots + 1],
                                                     float (&ms)[kPivots + 1]) {
  SampleShared& sm = *reinterpret_cast<SampleShared*>(smem_raw);
  uint32_t lo = 0;
  uint32_t hi = ordered_key(M);
  int cnt_hi = 0;       // tokens with key > hi
  float mass_hi = 0.f;  // their mass
  if (k_eff == 0) {
    // top-p only: tokens 104 temperatures below the max have e == 0 and never enter it
    const float lo_v = M - 104.f / inv_t;
    if (lo_v > -INFINITY) lo = ordered_key(lo_v);
    if (lo >= hi) lo = hi - 1;
  }
  const float p_mass = top_p * Z;
  for (int pass = 0; pass < 40 && hi - lo > 1; ++pass) {
#pragma unroll
    for (int j = 0; j < kPivots; ++j)
      piv[j] = lo + (uint32_t)(((uint64_t)(hi - lo) * (uint64_t)j) / kPivots);
    int cnt[kPivots];
    float mass[kPivots];
#pragma unroll
    for (int j = 0; j < kPivots; ++j) {
      cnt[j] = 0;
      mass[j] = 0.f;
    }
    stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t) {
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const uint32_t key = ordered_key(x[j]);
        if (((allow >> j) & 1u) && key > lo && key <= hi) {
          const float e = __expf(x[j] * inv_t - My);
#pragma unroll
          for (int q = 0; q < kPivots; ++q) {
            const bool gt = key > piv[q];
            cnt[q] += gt ? 1 : 0;
            mass[q] += gt ? e : 0.f;
          }
        }
      }
      return true;
    });
    // block reduction of the 2 * kPivots accumulators (scratch: the candidate arrays)
#pragma unroll
    for (int q = 0; q < kPivots; ++q) {
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        cnt[q] += __shfl_xor_sync(0xffffffffu, cnt[q], off);
        mass[q] += __shfl_xor_sync(0xffffffffu, mass[q], off);
      }
    }
    __syncthreads();
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < kPivots; ++q) {
        sm.idx[warp * kPivots + q] = cnt[q];
        sm.val[warp * kPivots + q] = mass[q];
      }
    }
    __syncthreads();
    if (tid == 0) {
      for (int q = 0; q < kPivots; ++q) {
        c[q] = 0;
        ms[q] = 0.f;
        for (int w = 0; w < kWarps; ++w) {
          c[q] += sm.idx[w * kPivots + q];
          ms[q] += sm.val[w * kPivots + q];
        }
      }
      c[kPivots] = 0;
      ms[kPivots] = 0.f;
      // keep'(c) = fewer than k tokens above it and their mass below top_p * Z;
      // monotone in c: find the first pivot where it holds.
      int J = kPivots;  // kPivots: only hi itself
      for (int q = 0; q < kPivots; ++q) {
        const int cg = cnt_hi + c[q];
        const float mg = mass_hi + ms[q];
        if ((k_eff == 0 || cg < k_eff) && (!use_p || mg < p_mass)) {
          J = q;
          break;
        }
      }
      int stop = 0;
      uint32_t nlo = lo, nhi = hi;
      int inside;
      if (J == 0) {
        stop = 1;  // keep'(lo) already holds: everything above lo is kept
        inside = 0;
      } else {
        nlo = piv[J - 1];
        nhi = J < kPivots ? piv[J] : hi;
        inside = c[J - 1] - c[J];
        cnt_hi += c[J];
        mass_hi += ms[J];
      }
      if (inside <= 1) stop = 1;
      sm.lo = nlo;
      sm.hi = nhi;
      sm.stop = stop;
      sm.count = cnt_hi;
      sm.scan_carry = mass_hi;
    }
    __syncthreads();
    lo = sm.lo;
    hi = sm.hi;
    cnt_hi = sm.count;
    mass_hi = sm.scan_carry;
    const int stop = sm.stop;
    __syncthreads();
    if (stop) break;
  }
  return lo;
}

// Phase (streaming rows with a search or min-p): each thread's mass of its kept elements (rule;
// one pass without block barriers), then the draw in thread order (thread_order_draw:
// sm.f_scratch, sm.seg_*): with min-p alone the row's second and last pass. Returns the id, -1
// where it drew none (the fallback draws). Block-uniform.
template <typename T, bool VEC>
__device__ __forceinline__ int32_t streaming_draw(SampleShared& sm, const T* __restrict__ row,
                                                  const int32_t* __restrict__ mask_row,
                                                  int64_t vocab, KeptRule rule, double u) {
  auto kept_e = [&](float xv, uint32_t allowed) -> float { return rule.weight(xv, allowed); };
  float w = 0.f;
  stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t) {
#pragma unroll
    for (int j = 0; j < kElems; ++j) w += kept_e(x[j], (allow >> j) & 1u);
    return true;
  });
  return thread_order_draw<T, VEC>(sm, row, mask_row, vocab, w, rule, u);
}

// Phase (the block-synchronised draw, first half): the mass of the kept set, a row_sum of
// rule's weights where the streaming path ran (streamed: a search or min-p; sm.f_scratch),
// else (plain rows) Z. Block-uniform.
template <typename T, bool VEC>
__device__ __forceinline__ float kept_mass(SampleShared& sm, const T* __restrict__ row,
                                           const int32_t* __restrict__ mask_row, int64_t vocab,
                                           bool streamed, KeptRule rule, float Z) {
  auto kept_e = [&](float xv, uint32_t allowed) -> float { return rule.weight(xv, allowed); };
  return streamed ? row_sum<T, VEC>(sm, row, mask_row, vocab, kept_e) : Z;
}

// Phase (the block-synchronised draw's sampling pass, one tile; the kernel streams the row
// through it after setting sm.chosen = INT32_MAX behind a barrier): the prefix sums of rule's
// weights go on from carry (the mass of the tiles before base) until the running mass passes
// target. Thread intervals [carry + excl, carry + incl) tile the line exactly, so one thread
// claims (claim_in_tile: sm.f_scratch, sm.chosen); last_kept: this thread's last kept token so
// far (-1: none), for block_last_kept where target lies beyond the scanned mass (rounding).
// Returns whether the stream goes on (nothing claimed yet).
template <bool VEC>
__device__ __forceinline__ bool fallback_tile(SampleShared& sm, const KeptRule& rule,
                                              const float (&x)[kElems], uint32_t allow,
                                              int64_t base, double& carry, double target,
                                              int32_t& last_kept) {
  float e[kElems];
#pragma unroll
  for (int j = 0; j < kElems; ++j) e[j] = rule.weight(x[j], (allow >> j) & 1u);
  carry += (double)claim_in_tile<VEC>(sm, e, base, carry, target, last_kept);
  return sm.chosen == INT32_MAX;   // stop once a thread claimed the draw
}

// Phase: thread 0 writes the id and its logprob, x[id] - logsumexp of the raw logits
// (sm.row_m_raw / row_s_raw; x[id] read from the row again). chosen by reference (SASS): by
// value, its load from the stack moved above the branch, which changed sm_100a's code.
template <typename T>
__device__ __forceinline__ void write_out(const SampleParams& p, int64_t row_id,
                                          const T* __restrict__ row, const SampleShared& sm,
                                          const int64_t& chosen) {
  if (threadIdx.x == 0) {
    p.out_ids[row_id] = chosen;
    const float lse = sm.row_m_raw + logf(sm.row_s_raw);
    p.out_logprobs[row_id] = load_f(row + chosen) - lse;
  }
}

// ----------------------------------------------------------------------------- the kernel

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads, 2) bitmask_sample_kernel(SampleParams p) {
  SampleShared& sm = *reinterpret_cast<SampleShared*>(smem_raw);
  const int64_t row_id = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* __restrict__ row = static_cast<const T*>(p.logits) + row_id * p.logits_stride;
  const int32_t* mask_row = p.bitmask ? p.bitmask + row_id * p.bitmask_stride : nullptr;
  const int64_t vocab = p.vocab;

  const auto [greedy, inv_t, t1, k_eff, top_p, use_p, min_p, use_minp] = row_params(p, row_id);
  // Top-p / min-p rows without top-k first run the buffer path (spec) with k = kSpecK (min_p
  // alone: kSpecKMinP): their kept set is a prefix of the ranked tokens, and when the k best
  // tokens already hold top_p of the mass (or the last of them falls below min_p) it lies inside
  // the buffer and the row needs one pass. Otherwise (flat rows) the two-pass draw or the
  // streaming threshold search runs.
  const bool spec = !greedy && k_eff == 0 && (use_p || use_minp);
  const int64_t k_buf = spec ? (use_p ? kSpecK : kSpecKMinP) : k_eff;  // the buffer path keeps
  const bool buffer_path = !greedy && ((k_eff > 0 && k_eff <= kTopKCap) || spec);
  const bool plain = !greedy && k_eff == 0 && !use_p && !use_minp;  // temperature only
  // Spec top_p rows also bin their allowed tokens in pass 1, for the two-pass draw should the
  // buffer miss the nucleus (window_draw); anchor: the first tile's allowed max.
  const bool hist_row = spec && use_p && !(min_p > 1.f) && vocab <= (int64_t)kMaxTiles * kTile;

  init_row_shared(sm, hist_row);

  // ---------------------------------------------------------------- pass 1
  Pass1State st;
  // the buffer size past which a loose settle selects (settle_candidates)
  const int loose_limit =
      max(kBufCap - kTile, min(kLooseFactor * (int)k_buf, kBufCap - 2 * (int)k_buf));
  // A top_p row (hist_row) bins (st.hist_on) once its first tile gave the anchor; with no finite
  // allowed token there, the rest of the row runs without.
  if (hist_row)
    pass1<T, VEC, true>(sm, row, mask_row, vocab, greedy, t1, inv_t, buffer_path, k_buf,
                        loose_limit, st, 0);
  if (!st.hist_on) pass1<T, VEC, false>(sm, row, mask_row, vocab, greedy, t1, inv_t, buffer_path,
                                        k_buf, loose_limit, st, hist_row ? kTile : 0);
  if (buffer_path)
    recollect_candidates<T, VEC>(sm, row, mask_row, vocab, k_buf, loose_limit, st.theta);

  // ---------------------------------------------------------------- row statistics
  // the thread's own (reference, sum of allowed e) before the reduction: the plain draw's w
  const float own_ref = t1 ? st.m_raw : (st.best_v == -INFINITY ? -INFINITY : st.best_v * inv_t);
  const float own_s = st.s_y;
  reduce_row_stats(sm, greedy, own_ref, st);
  // thread 0's combine of the warps' sm.red_*, in the kernel body (SASS, see the phase list);
  // the order of its declarations is the one that reproduces the one-body kernel's phis
  if (tid == 0) {
    float sy = 0.f, my = -INFINITY, s = 0.f, m = -INFINITY, bv = -INFINITY;
    int32_t bi = INT32_MAX;
    for (int w = 0; w < kWarps; ++w) {
      lse_combine(m, s, sm.red_m[w], sm.red_s[w]);
      if (!greedy) lse_combine(my, sy, sm.red_m2[w], sm.red_s2[w]);
      if (sm.red_bv[w] > bv || (sm.red_bv[w] == bv && sm.red_bi[w] < bi)) {
        bv = sm.red_bv[w];
        bi = sm.red_bi[w];
      }
    }
    // Z relative to the row max M/t (my == bv * inv_t up to the per-thread rounding, or
    // the raw max m >= M at temperature 1)
    sm.z_recompute = t1 && bv != -INFINITY && !(my - bv <= kZGapMax);
    if (!greedy && bv != -INFINITY) sy *= __expf(my - bv * inv_t);
    sm.row_m_raw = m;
    sm.row_s_raw = s;
    sm.row_best_v = bv;
    sm.row_best_i = bi;
    sm.row_z = sy;
  }
  __syncthreads();
  const float M = sm.row_best_v;  // max allowed logit
  const float My = M * inv_t;
  float Z = sm.row_z;
  if (sm.z_recompute) Z = sum_z_again<T, VEC>(sm, row, mask_row, vocab, M);
  int64_t chosen = sm.row_best_i == INT32_MAX ? 0 : sm.row_best_i;  // greedy / fallback
  const bool any_allowed = sm.row_best_i != INT32_MAX;

  // ---------------------------------------------------------------- the draw
  if (!greedy && any_allowed) {
    const double u = uniform_from(p.seeds[row_id], p.offsets[row_id]);
    bool drawn = false;
    int spec_n = 0;          // the buffer's ranked tokens and their mass (the two-pass top-p
    float spec_mass = 0.f;   // reads them)
    // plain rows first (own_ref / own_s are dead in the buffer path's selects), the id
    // returned rather than written through a reference: see Measured, top_k 1000 rows ran 1-2%
    // slower with the draw placed after the buffer path, and still 1% with the reference
    if (plain && !sm.z_recompute) {
      const int32_t id = plain_draw<T, VEC>(sm, row, mask_row, vocab, own_ref, own_s, inv_t, My, u);
      if (id >= 0) {
        chosen = id;
        drawn = true;
      }
    }
    if (buffer_path)
      buffer_draw(sm, k_buf, spec, use_p, use_minp, top_p, min_p, inv_t, Z, My, u, chosen, drawn,
                  spec_n, spec_mass);
    if (!drawn && st.hist_on && spec_n > 0 && M > -INFINITY) {
      // two-pass top-p (flat rows)
      const TopPRow r{sm.anchor, inv_t, My, top_p * Z, min_p, use_minp, spec_n, spec_mass, u};
      drawn = window_draw<T, VEC>(sm, row, mask_row, vocab, r, chosen);
    }
    uint32_t stream_lo = 0;   // the streaming search's threshold key, for the fallback below
    if (!drawn) {
      // the streaming path: the threshold search where top-p or a top-k cuts, then the
      // thread-order draw over the kept tokens
      uint32_t lo = 0;
      const bool need_search = k_eff > 0 || use_p;
      uint32_t piv[kPivots];   // threshold_search's local-memory arrays (SASS)
      int c[kPivots + 1];
      float ms[kPivots + 1];
      if (need_search)
        lo = threshold_search<T, VEC>(row, mask_row, vocab, k_eff, use_p, top_p, inv_t, M, My, Z,
                                      tid, lane, warp, piv, c, ms);
      stream_lo = lo;
      if (need_search || use_minp) {
        const KeptRule rule{inv_t, My, min_p, lo, use_minp};
        const int32_t id = streaming_draw<T, VEC>(sm, row, mask_row, vocab, rule, u);
        if (id >= 0) {
          chosen = id;
          drawn = true;
        }
      }
    }
    if (!drawn) {
      // the block-synchronised draw: rounding left the thread-order draw without a token, or a
      // plain row at temperature 1 whose Z was summed again (kZGapMax)
      const bool need_search = k_eff > 0 || use_p;
      const KeptRule rule{inv_t, My, min_p, stream_lo, use_minp};
      const float S = kept_mass<T, VEC>(sm, row, mask_row, vocab, need_search || use_minp, rule, Z);
      const double target = u * (double)S;
      if (tid == 0) sm.chosen = INT32_MAX;
      __syncthreads();
      double carry = 0.0;
      int32_t last_kept = -1;
      stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t base) {
        return fallback_tile<VEC>(sm, rule, x, allow, base, carry, target, last_kept);
      });
      // target beyond the scanned mass (rounding): the last kept token
      const int32_t found = sm.chosen != INT32_MAX ? sm.chosen : block_last_kept(sm, last_kept);
      if (found >= 0) chosen = found;
    }
  }

  write_out<T>(p, row_id, row, sm, chosen);
}

inline size_t sample_smem_bytes() { return sizeof(SampleShared); }

// vec: every row start 16-byte aligned and vocab a multiple of 16 bytes / sizeof(T).
template <typename T>
cudaError_t launch_bitmask_sample(const SampleParams& p, bool vec, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  const size_t smem = sample_smem_bytes();
  cudaError_t err;
  if (vec) {
    err = set_max_dynamic_smem<bitmask_sample_kernel<T, true>>((int)smem);
    if (err != cudaSuccess) return err;
    bitmask_sample_kernel<T, true><<<(unsigned)p.batch, kThreads, smem, stream>>>(p);
  } else {
    err = set_max_dynamic_smem<bitmask_sample_kernel<T, false>>((int)smem);
    if (err != cudaSuccess) return err;
    bitmask_sample_kernel<T, false><<<(unsigned)p.batch, kThreads, smem, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace sampling
}  // namespace radixserve
