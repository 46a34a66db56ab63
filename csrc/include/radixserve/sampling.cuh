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
//     - top-k rows (and top_p / min_p rows without top-k, as k = kSpecK): a candidate buffer in
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
//   A top_p / min_p row whose kept set may reach past its kSpecK buffered tokens falls through
//   to the streaming path below.
//   Other rows (no top-k, or top_k > kTopKCap) stream the row again from L2/HBM:
//     - top-p (or a large top-k): a threshold search over the 32-bit ordered float keys: each
//       pass counts tokens and their mass above kPivots evenly spaced pivot keys inside the
//       current interval (lo, hi] (registers, then one block reduction) and keeps the sub-
//       interval where the keep predicate flips; it stops once the interval holds <= 1 token
//       (typically 4-6 passes). Kept = allowed tokens with key > lo (and e >= min_p).
//     - min-p alone needs no search (a bound on e), plain sampling needs nothing.
//     - the mass of the kept set (one pass when not already known), then one sampling pass:
//       block-wide prefix sums over tiles until the running mass passes u * mass.
//   Ties in the top-k/top-p search are broken by token id (the 64-bit key) on the top-k path;
//   the streaming path keeps every token whose value equals the threshold value.
//
// Measured (H200, bench/kernels.py, batch 256 x vocab 128256 fp32, bitmask on every row; one read
// of the logits = logits.sum() = 39.1 us in that run): top_k 50 + top_p 0.9: 75.7 us (1.94x a
// read; temperature 0.7: 82.7 us); greedy: 48.7 us; plain sampling: 98.8 us (two passes);
// top_k 256: 100.7 us; top_k 1000 + top_p: 244 us (303 us selecting after every tile). top_p alone / min_p
// alone: 100.6 us on peaked rows (the buffer holds the kept set), 648 / 116 us on random normal
// rows (top_p 0.9 spans ~5000 tokens there: the streaming search). Peers: torch mask+topk+
// softmax+multinomial 1098 us, the reference's full sort 4856 us.
// Pass 1 is issue-bound, not memory-bound: a sweep of diagnostic variants (bench/variants, one
// variant per build, same run) split the former 110 us top-k time into pass 1 alone 56 us
// (45 us without the second exp per element), the first-tile select 8 us, the candidate append
// 39 us and the final select/rank 8 us. Hence the lean append (one float compare per element,
// bit-by-bit stores) -> 87 us, and the shared exp at temperature 1 -> 73 us; at temperature 0.7
// the same row takes 80 us. Rows with top_k <= kFreeRunTopK run pass 1 without block barriers.
#pragma once

#include <cstdint>

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
constexpr int kSpecK = 256;                     // top_p / min_p rows without top_k try this k first
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
template <typename T, bool VEC>
__device__ __forceinline__ void load_tile(const T* __restrict__ row, const int32_t* __restrict__ mask_row,
                                          int64_t vocab, int64_t base, float (&x)[kElems],
                                          uint32_t& allow) {
  const int tid = threadIdx.x;
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

// Streams a row tile by tile, the tile two ahead already on its way to L2 (l2_prefetch_tile):
// fn(x, allow, base) for each tile in order (block-uniform); fn returns false to stop early.
template <typename T, bool VEC, typename F>
__device__ __forceinline__ void stream_row(const T* __restrict__ row,
                                           const int32_t* __restrict__ mask_row, int64_t vocab,
                                           F&& fn) {
  l2_prefetch_tile<T>(row, vocab, kTile);
  for (int64_t base = 0; base < vocab; base += kTile) {
    l2_prefetch_tile<T>(row, vocab, base + 2 * (int64_t)kTile);
    float x[kElems];
    uint32_t allow;
    load_tile<T, VEC>(row, mask_row, vocab, base, x, allow);
    if (!fn(x, allow, base)) break;
  }
}

template <bool VEC>
__device__ __forceinline__ int64_t elem_index(int64_t base, int j) {
  if constexpr (VEC)
    return base + (int64_t)threadIdx.x * kElems + j;
  else
    return base + (int64_t)j * kThreads + threadIdx.x;
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
};

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

// ----------------------------------------------------------------------------- the kernel

template <typename T, bool VEC>
__global__ void __launch_bounds__(kThreads, 2) bitmask_sample_kernel(SampleParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SampleShared& sm = *reinterpret_cast<SampleShared*>(smem_raw);
  const int64_t row_id = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* __restrict__ row = static_cast<const T*>(p.logits) + row_id * p.logits_stride;
  const int32_t* mask_row = p.bitmask ? p.bitmask + row_id * p.bitmask_stride : nullptr;
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
  // Top-p / min-p rows without top-k first run the buffer path with k = kSpecK (spec): their
  // kept set is a prefix of the ranked tokens, and when the kSpecK best tokens already hold
  // top_p of the mass (or the last of them falls below min_p) it lies inside the buffer and
  // the row needs one pass. Otherwise (flat rows) the streaming threshold search runs.
  const bool spec = !greedy && k_eff == 0 && (use_p || use_minp);
  const int64_t k_buf = spec ? kSpecK : k_eff;  // candidates the buffer path keeps
  const bool buffer_path = !greedy && ((k_eff > 0 && k_eff <= kTopKCap) || spec);

  if (tid == 0) {
    sm.count = 0;
    sm.overflow = 0;
    sm.theta = 0;
  }
  __syncthreads();

  // ---------------------------------------------------------------- pass 1
  float m_raw = -INFINITY, s_raw = 0.f;     // raw logits, all tokens
  float best_v = -INFINITY;                 // allowed max (first argmax)
  int32_t best_i = INT32_MAX;
  float s_y = 0.f;                          // sum exp(x/t - best_v/t) over allowed
  uint64_t theta = 0;
  // Top-k candidates. Rows with top_k <= kFreeRunTopK run pass 1 without block barriers once
  // theta is initialised from the first tile (free_run): warps append with one atomic each,
  // and a warp whose candidates would not fit raises sm.overflow instead of writing; then the
  // candidates are collected again below with the block-synchronised append (rare: the first
  // tile's theta keeps about k candidates per tile). Other top-k rows settle after every tile
  // (below); they too may overflow and collect again.
  bool free_run = false;
  // Appends this thread's allowed elements of the tile whose value is >= theta's value: a
  // superset of the keys >= theta (ties on the value), which the exact selects trim. Pass 1 is
  // issue-bound, so this is lean: one compare per element, and only a warp with a candidate
  // goes on (one scan, one shared atomic); a thread stores its few candidates bit by bit,
  // re-reading each value (just loaded by this thread: an L1 hit) rather than indexing x[]
  // dynamically. guard (free-running): a warp whose candidates would not fit raises
  // sm.overflow instead of writing.
  auto append = [&](const float (&x)[kElems], uint32_t allow, int64_t base, bool guard) {
    const float theta_f = key_value(theta);
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < kElems; ++j) mine |= (x[j] >= theta_f ? 1u : 0u) << j;
    mine &= allow;
    if (!__any_sync(0xffffffffu, mine != 0u)) return;
    const int cnt = __popc(mine);
    int incl = cnt;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += y;
    }
    int wbase = 0;
    if (lane == 31 && incl > 0) wbase = atomicAdd(&sm.count, incl);   // lane 31: warp total
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
  };
  // Block-synchronised, after a tile: raise theta to the k-th largest key and compact once the
  // buffer holds more than `limit` candidates. strict (limit kBufCap - kTile; also while theta
  // is unset): the next tile cannot overflow. Loose (kLooseFactor k, at most kBufCap - 2 k):
  // fewer selects for large k (strict selects after every tile at k = 1000), and a tile that
  // would overflow raises sm.overflow through the guarded append instead; from then on nothing
  // is selected (the buffer misses candidates) and the row collects again, strictly, after
  // pass 1.
  const int loose_limit =
      max(kBufCap - kTile, min(kLooseFactor * (int)k_buf, kBufCap - 2 * (int)k_buf));
  auto settle = [&](bool strict) {
    __syncthreads();
    const int n = sm.count;
    const bool overflowed = sm.overflow != 0;
    __syncthreads();  // every thread has read count before the next tile appends
    const int limit = (strict || theta == 0) ? kBufCap - kTile : loose_limit;
    if (!overflowed && n > limit && n > k_buf) {
      theta = select_kth(sm, n, (int)k_buf);
      compact_candidates(sm, n, theta);
    }
  };
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
    if (vm > m_raw) {
      const float c = __expf(m_raw - vm);
      s_raw *= c;
      if (t1) s_y *= c;
      m_raw = vm;
    }
    if (m_raw != -INFINITY) {
      if (t1) {
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          const float e = __expf(x[j] - m_raw);
          s_raw += e;
          s_y += ((allow >> j) & 1u) ? e : 0.f;
        }
      } else {
#pragma unroll
        for (int j = 0; j < kElems; ++j) s_raw += __expf(x[j] - m_raw);
      }
    }
    if (bm > best_v) {
      if (!greedy && !t1) s_y *= __expf((best_v - bm) * inv_t);
      best_v = bm;
      best_i = (int32_t)elem_index<VEC>(base, jb);
    }
    if (!greedy && !t1 && best_v != -INFINITY) {
      const float my = best_v * inv_t;
#pragma unroll
      for (int j = 0; j < kElems; ++j)
        if ((allow >> j) & 1u) s_y += __expf(x[j] * inv_t - my);
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
        theta = select_kth(sm, kThreads, (int)k_buf);  // starts and ends with a barrier
        free_run = k_buf <= kFreeRunTopK;
      }
    }
    if (buffer_path) {
      append(x, allow, base, true);
      if (!free_run) settle(false);
    }
    return true;
  });
  if (buffer_path) {
    __syncthreads();  // every append landed, sm.overflow final
    if (sm.overflow) {
      // theta is still a lower bound of the row's k-th largest key (set from complete buffers)
      __syncthreads();  // every thread read the flag
      if (tid == 0) {
        sm.count = 0;
        sm.overflow = 0;
      }
      for (int64_t base = 0; base < vocab; base += kTile) {
        __syncthreads();
        float x[kElems];
        uint32_t allow;
        load_tile<T, VEC>(row, mask_row, vocab, base, x, allow);
        append(x, allow, base, false);
        settle(true);
      }
    }
  }

  // ---------------------------------------------------------------- row statistics
  {
    // s_y is relative to sy_ref: the thread's m_raw at temperature 1, else its best_v / t
    float sy_ref = t1 ? m_raw : (best_v == -INFINITY ? -INFINITY : best_v * inv_t);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m_raw, off);
      const float s2 = __shfl_xor_sync(0xffffffffu, s_raw, off);
      lse_combine(m_raw, s_raw, m2, s2);
      const float bv2 = __shfl_xor_sync(0xffffffffu, best_v, off);
      const int32_t bi2 = __shfl_xor_sync(0xffffffffu, best_i, off);
      const float r2 = __shfl_xor_sync(0xffffffffu, sy_ref, off);
      const float y2 = __shfl_xor_sync(0xffffffffu, s_y, off);
      if (!greedy) lse_combine(sy_ref, s_y, r2, y2);
      if (bv2 > best_v || (bv2 == best_v && bi2 < best_i)) {
        best_v = bv2;
        best_i = bi2;
      }
    }
    if (lane == 0) {
      sm.red_m[warp] = m_raw;
      sm.red_s[warp] = s_raw;
      sm.red_bv[warp] = best_v;
      sm.red_bi[warp] = best_i;
      sm.red_m2[warp] = sy_ref;
      sm.red_s2[warp] = s_y;
    }
    __syncthreads();
    if (tid == 0) {
      float m = -INFINITY, s = 0.f, my = -INFINITY, sy = 0.f, bv = -INFINITY;
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
  }
  const float M = sm.row_best_v;  // max allowed logit
  const float My = M * inv_t;
  // one streaming pass: the block-wide sum over the row of f(x, allowed)
  auto row_sum = [&](auto f) {
    float acc = 0.f;
    stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t) {
#pragma unroll
      for (int j = 0; j < kElems; ++j) acc += f(x[j], (allow >> j) & 1u);
      return true;
    });
    return block_sum<float>(acc, sm.f_scratch);
  };
  float Z = sm.row_z;
  if (sm.z_recompute) {
    // temperature 1 and the allowed max far below the raw max: allowed terms that underflowed
    // relative to m may matter relative to M. Sum Z = sum exp(x - M) over allowed again.
    Z = row_sum([&](float xv, uint32_t allowed) { return allowed ? __expf(xv - M) : 0.f; });
  }
  int64_t chosen = sm.row_best_i == INT32_MAX ? 0 : sm.row_best_i;  // greedy / fallback
  const bool any_allowed = sm.row_best_i != INT32_MAX;

  if (!greedy && any_allowed) {
    const double u = uniform_from(p.seeds[row_id], p.offsets[row_id]);
    bool drawn = false;
    if (buffer_path) {
      // ------------------------------------------------ top-k path, all in shared memory
      int n = sm.count;
      if (n > k_buf) {
        const uint64_t th = select_kth(sm, n, (int)k_buf);
        n = compact_candidates(sm, n, th);
      }
      // rank by counting: keys are distinct, ranks are a permutation of [0, n)
      float* sval = sm.val + kTopKCap;
      int32_t* sidx = sm.idx + kTopKCap;
      for (int i = tid; i < n; i += kThreads) {
        const float v = sm.val[i];
        const int32_t id = sm.idx[i];
        const uint64_t c = cand_key(v, id);
        int rank = 0;
        for (int j = 0; j < n; ++j) rank += cand_key(sm.val[j], sm.idx[j]) > c ? 1 : 0;
        sval[rank] = v;
        sidx[rank] = id;
      }
      __syncthreads();
      // each thread owns ranks 2*tid, 2*tid+1 (n <= kTopKCap = 2 * kThreads)
      const int r0 = 2 * tid, r1 = 2 * tid + 1;
      const float e0 = r0 < n ? __expf(sval[r0] * inv_t - My) : 0.f;
      const float e1 = r1 < n ? __expf(sval[r1] * inv_t - My) : 0.f;
      float excl0, incl_t, total;
      block_scan(e0 + e1, sm.f_scratch, excl0, incl_t, total);
      const float incl0 = excl0 + e0, excl1 = incl0, incl1 = incl0 + e1;
      const float p_mass = top_p * Z;
      // spec: the buffer holds the kept set when the row has fewer than k_buf allowed tokens,
      // or the next token (rank n) would not be kept (uniform: block-wide values only)
      const bool covered = !spec || n < k_buf || (use_p && !(total < p_mass)) ||
                           (use_minp && !(__expf(sval[n - 1] * inv_t - My) >= min_p));
      if (covered) {
        auto keep = [&](int r, float excl, float e) {
          if (r >= n) return false;
          if (r == 0) return true;
          return (!use_p || excl < p_mass) && (!use_minp || e >= min_p);
        };
        const bool k0 = keep(r0, excl0, e0), k1 = keep(r1, excl1, e1);
        const int L = block_sum<int32_t>((k0 ? 1 : 0) + (k1 ? 1 : 0), sm.i_scratch);  // kept prefix
        if (tid == 0) sm.chosen = INT32_MAX;
        if (r0 == L - 1) sm.scan_carry = incl0;
        if (r1 == L - 1) sm.scan_carry = incl1;
        __syncthreads();
        const double target = u * (double)sm.scan_carry;
        if (k0 && (double)excl0 <= target && target < (double)incl0) atomicMin(&sm.chosen, r0);
        if (k1 && (double)excl1 <= target && target < (double)incl1) atomicMin(&sm.chosen, r1);
        __syncthreads();
        const int rc = sm.chosen == INT32_MAX ? L - 1 : sm.chosen;
        chosen = sidx[rc];
        drawn = true;
      }
    }
    if (!drawn) {
      // ------------------------------------------------ streaming path
      uint32_t lo = 0;
      const bool need_search = k_eff > 0 || use_p;
      if (need_search) {
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
          uint32_t piv[kPivots];
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
            int c[kPivots + 1];
            float ms[kPivots + 1];
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
      }
      auto kept_e = [&](float xv, uint32_t allowed) -> float {
        if (!allowed || ordered_key(xv) <= lo) return 0.f;
        const float e = __expf(xv * inv_t - My);
        return (use_minp && !(e >= min_p)) ? 0.f : e;
      };
      // mass of the kept set
      const float S = (need_search || use_minp) ? row_sum(kept_e) : Z;
      const double target = u * (double)S;
      // sampling pass: prefix sums over tiles until the running mass passes target. Thread
      // intervals [carry + excl, carry + incl) tile the line exactly, so one thread claims.
      if (tid == 0) sm.chosen = INT32_MAX;
      __syncthreads();
      double carry = 0.0;
      int32_t last_kept = -1;
      stream_row<T, VEC>(row, mask_row, vocab, [&](const float (&x)[kElems], uint32_t allow, int64_t base) {
        float e[kElems];
        float tsum = 0.f;
#pragma unroll
        for (int j = 0; j < kElems; ++j) {
          e[j] = kept_e(x[j], (allow >> j) & 1u);
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
        carry += (double)total;
        __syncthreads();
        return sm.chosen == INT32_MAX;   // stop once a thread claimed the draw
      });
      int32_t found = sm.chosen == INT32_MAX ? -1 : sm.chosen;
      if (found < 0) {
        // target beyond the scanned mass (rounding): the last kept token
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
          last_kept = max(last_kept, __shfl_xor_sync(0xffffffffu, last_kept, off));
        __syncthreads();
        if (lane == 0) sm.i_scratch[warp] = last_kept;
        __syncthreads();
        int32_t lk = -1;
        for (int w = 0; w < kWarps; ++w) lk = max(lk, sm.i_scratch[w]);
        found = lk;
      }
      if (found >= 0) chosen = found;
    }
  }

  if (tid == 0) {
    p.out_ids[row_id] = chosen;
    const float lse = sm.row_m_raw + logf(sm.row_s_raw);
    p.out_logprobs[row_id] = load_f(row + chosen) - lse;
  }
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
