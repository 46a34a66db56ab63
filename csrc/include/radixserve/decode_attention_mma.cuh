// Paged decode attention on tensor cores (mma.sync m16n8k16, sm_80+), for GQA groups of 4 to 8
// q heads per kv head and batches that fill the device without splitting requests.
//
// Why: the CUDA-core kernel (decode_attention.cuh) spends ~130 instructions per thread per KV
// token on dot products, shuffles and exponentials (16 threads per token row). Under the H200's
// power cap its SM clock drops to ~1.5 GHz in a sustained run, and then that instruction stream,
// not HBM, bounds it: 0.82 of copy bandwidth in the offline run's decode phase against 0.90 in
// a short profile (bench/results/logs/offline-gaps-h200.txt). Here a warp turns 16 KV tokens into
// 32 mma instructions and a few dozen others.
//
// One CTA = (kv head, q-head subgroup, request), 4 warps, the whole request (no split: the
// launcher uses this kernel only where num_splits == 1). Warp w takes the request's 16-token
// tiles w, w + 4, w + 8, ... through a warp-private cp.async pipeline of kStages tiles (K and V
// rows, 16-byte chunks XOR-swizzled by row so ldmatrix reads are conflict-free; each warp reads
// only what its own lanes copied, so a __syncwarp, not a CTA barrier, orders them).
// Per tile, with the subgroup's q heads as the rows of a 16-row A operand (rows >= group zero):
//   S[h, t]  = q[h, :] . K[t, :]            8 (D = 128) k-steps x 2 n-tiles of 8 tokens
//   online softmax of S per row in the log2 domain (fp32, the quad of lanes that holds a row)
//   O[h, :] += P[h, t] V[t, :]             P from S's accumulators in registers (rounded to
//                                          bf16 / fp16, as flash attention does), V through
//                                          ldmatrix.trans; D / 8 n-tiles
// The 4 warps' states are combined in shared memory (decode_combine_parts) and the output row
// written. q is not pre-scaled (it enters the mma as stored); the scale multiplies S in fp32.
#pragma once

#include <cstdint>

#include "radixserve/attention_common.cuh"
#include "radixserve/decode_attention.cuh"
#include "radixserve/pdl.cuh"

namespace radixserve {
namespace attn {

constexpr int kDecodeMmaWarps = 4;
constexpr int kDecodeMmaThreads = kDecodeMmaWarps * 32;
static_assert(kDecodeMmaThreads == kDecodeThreads, "decode_combine_parts strides by kDecodeThreads");
constexpr int kDecodeMmaTile = 16;    // KV tokens per warp per step
constexpr int kDecodeMmaStages = 3;   // tiles per warp in the pipeline (2 in flight)

// dynamic shared memory: [warps][stages][k|v][16 tokens][D] elements of 2 bytes
template <int D>
__host__ __device__ constexpr int decode_mma_smem_bytes() {
  return kDecodeMmaWarps * kDecodeMmaStages * 2 * kDecodeMmaTile * D * 2;
}

// Byte offset of 16-byte chunk c of token row r inside one [16][D] tile: chunks XOR-swizzled by
// the row's low 3 bits, so the 8 rows an ldmatrix reads at one chunk column hit 8 bank groups.
template <int D>
__device__ __forceinline__ uint32_t decode_mma_chunk(int r, int c) {
  return (uint32_t)(r * D * 2 + ((c ^ (r & 7)) << 4));
}

template <typename T, int D, int kGroupMax>
__global__ void __launch_bounds__(kDecodeMmaThreads)
    paged_decode_mma_kernel(const DecodeParams p) {
  static_assert(D % 64 == 0, "D / 8 chunks per row, at least 8 for the swizzle");
  static_assert(kGroupMax == 4 || kGroupMax == 8, "q heads of a subgroup: rows 0..7 of the mma");
  pdl_launch_dependents();  // the o projection after attention may start streaming its weights
  constexpr int kChunks = D / 8;                       // 16-byte chunks per K / V row
  constexpr int kKSteps = D / 16;                      // mma k-steps of S = q K^T
  constexpr int kNTiles = D / 8;                       // mma n-tiles of O
  constexpr int kTileBytes = kDecodeMmaTile * D * 2;   // one K (or V) tile
  constexpr int kPerLane = kDecodeMmaTile * kChunks / 32;  // chunks a lane copies per tile

  extern __shared__ __align__(128) unsigned char decode_mma_smem[];
  __shared__ float sm_m[kDecodeMmaWarps][kGroupMax];
  __shared__ float sm_l[kDecodeMmaWarps][kGroupMax];
  static_assert(kDecodeMmaWarps * kGroupMax * D * 4 <= decode_mma_smem_bytes<D>(),
                "combine buffer inside the pipeline's");
  auto sm_acc = reinterpret_cast<float (*)[kGroupMax][D]>(decode_mma_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sg = blockIdx.x;  // q-head subgroup (one split: blockIdx.x < num_sub)
  const int kvh = blockIdx.y;
  const int b = blockIdx.z;
  const int qh0 = kvh * p.group + sg * kGroupMax;
  const int gcount = min(kGroupMax, p.group - sg * kGroupMax);
  const KvRange range = decode_kv_range(p, b);  // the whole KV, or its window
  const int kv_start = range.start;
  const int kv_len = range.len;

  // q as the A operand: row h = lane / 4 (rows >= gcount and 8..15 are zero), per k-step the
  // two registers of columns (lane % 4) * 2 and + 8
  const int row = lane >> 2, quad = lane & 3;
  uint32_t qa[kKSteps][2];
  {
    const T* qrow = static_cast<const T*>(p.q) + (int64_t)b * p.q_stride_b +
                    (int64_t)(qh0 + row) * p.q_stride_h + quad * 2;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      qa[kk][0] = row < gcount ? *reinterpret_cast<const uint32_t*>(qrow + kk * 16) : 0u;
      qa[kk][1] = row < gcount ? *reinterpret_cast<const uint32_t*>(qrow + kk * 16 + 8) : 0u;
    }
  }

  // this warp's tiles: w, w + warps, ... of the request's ceil(kv_len / 16)
  const int tiles = (kv_len + kDecodeMmaTile - 1) / kDecodeMmaTile;
  const int n_it = tiles > warp ? (tiles - warp + kDecodeMmaWarps - 1) / kDecodeMmaWarps : 0;
  const int32_t* idx = p.kv_indices + kv_start;
  const T* kbase = static_cast<const T*>(p.k) + (int64_t)kvh * p.kv_stride_h;
  const T* vbase = static_cast<const T*>(p.v) + (int64_t)kvh * p.kv_stride_h;
  unsigned char* wsmem = decode_mma_smem + warp * kDecodeMmaStages * 2 * kTileBytes;
  const uint32_t wsmem_u32 = smem_u32(wsmem);
  auto tile_start = [&](int it) { return (it * kDecodeMmaWarps + warp) * kDecodeMmaTile; };

  // lane l < 16 holds the slot of token l of the tile fetched last (0 past the request)
  int slot = 0;
  auto fetch = [&](int it) {
    const int t = tile_start(it) + lane;
    slot = it < n_it && lane < kDecodeMmaTile && t < kv_len ? __ldg(idx + t) : 0;
  };
  // cp.async of tile it's K and V rows into stage it % kStages (rows past the request zero-filled)
  auto issue = [&](int it) {
    if (it < n_it) {
      const int t0 = tile_start(it);
      const uint32_t kdst = wsmem_u32 + (it % kDecodeMmaStages) * 2 * kTileBytes;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int j = lane + 32 * i;
        const int r = j / kChunks, c = j % kChunks;
        const int s = __shfl_sync(0xffffffffu, slot, r);
        const bool ok = t0 + r < kv_len;
        const int64_t off = ok ? (int64_t)s * p.kv_stride_slot + c * 8 : 0;
        const uint32_t at = decode_mma_chunk<D>(r, c);
        cp_async_16(kdst + at, kbase + off, ok);
        cp_async_16(kdst + kTileBytes + at, vbase + off, ok);
      }
    }  // n_it is warp-uniform: the shuffles above run on every lane or on none
    cp_async_commit();
  };

  float m = -INFINITY, l = 0.f;          // row `row`'s running max (log2 domain) and this
                                         // lane's share of its sum
  float acc[kNTiles][4];                 // O: [n-tile][c0..c3]; c2, c3 are rows 8..15 (zero)
#pragma unroll
  for (int n = 0; n < kNTiles; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

#pragma unroll
  for (int st = 0; st < kDecodeMmaStages - 1; ++st) {
    fetch(st);
    issue(st);
  }
  fetch(kDecodeMmaStages - 1);

  for (int it = 0; it < n_it; ++it) {
    __syncwarp();                         // every lane's reads of the stage issue() refills
    issue(it + kDecodeMmaStages - 1);
    fetch(it + kDecodeMmaStages);
    cp_async_wait<kDecodeMmaStages - 1>();
    __syncwarp();                         // all lanes' copies of tile it visible to the warp
    const uint32_t ks = wsmem_u32 + (it % kDecodeMmaStages) * 2 * kTileBytes;
    const uint32_t vs = ks + kTileBytes;
    const int t0 = tile_start(it);

    // S = q K^T: n-tile 0 = tokens 0..7, n-tile 1 = tokens 8..15. ldmatrix x4 matrices: (tokens
    // 0-7, chunk 2kk), (0-7, 2kk + 1), (8-15, 2kk), (8-15, 2kk + 1); lane gives matrix lane / 8's
    // row lane % 8
    float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
    const int lr = (lane & 7) + ((lane >> 4) << 3);  // token row of this lane's address
    const int lc = (lane >> 3) & 1;                  // chunk offset within the k-step
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(ks + decode_mma_chunk<D>(lr, 2 * kk + lc), b0, b1, b2, b3);
      const uint32_t a[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
      mma_16816<T>(s0, a, b0, b1);
      mma_16816<T>(s1, a, b2, b3);
    }

    // online softmax of row `row` over this tile's tokens quad*2, +1 (s0) and 8 + quad*2, +1 (s1)
    const int tq = t0 + quad * 2;
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

    // O += P V: P's A fragment from S's accumulators (k = tokens), V's B fragments through
    // ldmatrix.trans, matrices (tokens 0-7, chunk 2dd), (8-15, 2dd), (0-7, 2dd + 1), (8-15, 2dd + 1)
    const uint32_t pa[4] = {TypeTraits<T>::pack(pr[0], pr[1]), 0u,
                            TypeTraits<T>::pack(pr[2], pr[3]), 0u};
    const int vr = (lane & 7) + (((lane >> 3) & 1) << 3);
    const int vc = lane >> 4;
#pragma unroll
    for (int dd = 0; dd < kNTiles / 2; ++dd) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(vs + decode_mma_chunk<D>(vr, 2 * dd + vc), b0, b1, b2, b3);
      mma_16816<T>(acc[2 * dd], pa, b0, b1);
      mma_16816<T>(acc[2 * dd + 1], pa, b2, b3);
    }
  }
  cp_async_wait<0>();

  // the row's sum over the quad's lanes; the warps' states into shared memory, then combined
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  __syncthreads();  // every warp is done with the pipeline buffer the combine reuses
  if (row < kGroupMax) {
    if (quad == 0) {
      sm_m[warp][row] = m;
      sm_l[warp][row] = l;
    }
#pragma unroll
    for (int n = 0; n < kNTiles; ++n) {
      sm_acc[warp][row][n * 8 + quad * 2] = acc[n][0];
      sm_acc[warp][row][n * 8 + quad * 2 + 1] = acc[n][1];
    }
  }
  __syncthreads();
  decode_combine_parts<T, D, kGroupMax, kDecodeMmaWarps>(p, b, qh0, gcount, 0, false, sm_m, sm_l,
                                                         sm_acc);
}

}  // namespace attn
}  // namespace radixserve
