// Paged extend (prefill) attention for Hopper (sm_90a): warp-specialised, on warpgroup MMA.
//
// Same contract as paged_extend_kernel (extend_attention.cuh). A work item is one tile of kBM = 128
// query rows of one request: `pack` q heads of one GQA group (pack = the largest power of two
// dividing the group, up to 8; 1 without kPackGqa) x kBM / pack consecutive tokens, row r = token
// m0 + r / pack, q head hb * pack + r % pack for the item's head block hb. Every K/V tile it loads
// serves the pack heads at once (with pack 1, a group's heads are separate items reading the same
// K/V through L2), and a short chunk over a long prefix fills the rows rather than padding them.
// Items are numbered last token tile first (causal tiles at the end of a request carry the most
// work), the head blocks of one tile side by side. The grid is persistent, one CTA per
// multiprocessor: the producer takes the next item from a global counter
// (ExtendParams::work_counters) as soon as it has issued the current one's loads and hands it to
// the consumers through shared memory, so the next item's Q and first K/V tiles load under the
// consumers' last products and epilogue, and the CTAs balance themselves the way the hardware's
// block scheduler would (a static round-robin of items left them 12% apart at 4k).
// Three warpgroups, in FlashAttention-3's structure:
//   * warpgroup 0, the producer (setmaxnreg down to kProducerRegs): loads the Q tile and then
//     K and V tiles of kBN rows into a ring of kStages shared-memory stages. A tile whose rows
//     all lie in the request and sit in consecutive slots (a fresh pool hands out runs) comes
//     by TMA: D / 64 boxes of the pool's tensor map (KvMaps), armed with their byte count on
//     the stage's "full" mbarrier. Any other tile is gathered by slot index (page size 1) with
//     cp.async, zero-filled past the request's KV: each producer warp owns 32 rows, lane l
//     reads the slot of row l once per tile and the rows' loads take it by shuffle, and
//     completion arrives on the full mbarrier (cp.async.mbarrier.arrive). A stage is refilled
//     once both consumers have arrived on its "empty" mbarrier. K and V have rings of their
//     own: K(n) is free when S(n) is done, V(n) only after P(n) V(n).
//     Measured (H200, 4k causal, d128, bench/variants, logs/extend-*-h200.txt): with every row
//     by cp.async the kernel ran at 399 TFLOP/s, and at 575 when the loads were cut out (a
//     diagnostic): the gather's 4,096 16-byte copies per tile were the limit. With TMA for
//     consecutive tiles: 545 (ping-pong off 527, one CTA per item 526, 3 stages 548, Q from
//     registers 553). Session 14 (logs/extend-sweep-pack-h200.txt, same run): with Q from
//     registers and GQA packing, 551 TFLOP/s at 4k (32 heads), 558 at 4k with 8 kv heads (566
//     unpacked), 570 on 32 requests of 64 new tokens over 4,032 cached with 8 kv heads (320
//     unpacked: the 64-token chunks padded each 128-row tile half empty); 3 stages 560 / 570 /
//     571, same checksums, hence kStages 3.
//   * warpgroups 1 and 2, the consumers (setmaxnreg up to kConsumerRegs): 64 query rows each.
//     KV tiles are visited from the last (the causal diagonal, masked) to the first, so the
//     masked tiles come first and the rest run unmasked. Per tile n (after the first):
//       issue S(n) = Q K(n)^T -> issue O += P(n+1) V(n+1) -> wait for S(n) -> mask, online
//       softmax of S(n) (under the P V product) -> wait for P V -> P(n) to T, rescale O.
//     so each warpgroup's softmax overlaps its own tensor-core work. S is m64 n128 k16 from
//     shared memory (K-major), P V takes P from registers (the accumulator and A-fragment
//     layouts match) and V MN-major. P is rounded to T before it enters the row sum too.
//     With kPingPong the two consumers also take turns issuing their products (named barriers
//     1 and 2), so that one's softmax runs under the other's products.
//   * Q, K and V tiles use the SW128 layout of wgmma.cuh.
#pragma once

#include <cstdint>

#include <cuda.h>   // CUtensorMap

#include "radixserve/attention_common.cuh"
#include "radixserve/extend_attention.cuh"
#include "radixserve/mbarrier.cuh"
#include "radixserve/wgmma.cuh"

namespace radixserve {
namespace attn {
namespace sm90 {

constexpr int kBM = 128;         // query rows per CTA: 2 consumer warpgroups x 64
constexpr int kBN = 128;         // KV rows per tile
constexpr int kStages = 3;       // ring depth, for K and for V each (2: -1.5 to -2% in the sweep)
constexpr int kConsumers = 2;    // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;   // 128 x 40 + 256 x 232 <= 65,536
constexpr bool kPingPong = true;
// Q as the A operand of S from registers (else from smem): 553 against 545 TFLOP/s in the
// session-13 sweep, same checksum; its smem slot is released as soon as the fragments load
constexpr bool kQInRegs = true;
constexpr bool kPersistent = true;   // one CTA per SM looping over items (else one per item)
// a tile's rows hold the q heads of one GQA group (up to 8) x kBM / pack tokens, so each K/V tile
// serves them all; else (pack 1) one q head x kBM tokens
constexpr bool kPackGqa = true;
static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= 65536, "register file");

// log2 of the q heads per tile (`pack`) for a GQA group: the largest power of two dividing it,
// up to 8 (a power of two dividing 8 keeps rows r and r + 8 on tokens r / pack and r / pack +
// 8 / pack). The launcher sizes the tile grid and the kernel reads its tiles with the same one.
__host__ __device__ constexpr int extend_pack_log2(int group) {
  return !kPackGqa ? 0 : group % 8 == 0 ? 3 : group % 4 == 0 ? 2 : group % 2 == 0 ? 1 : 0;
}

template <int D>
constexpr int extend_smem_bytes() {
  // Q tile + kStages stages of K and of V, 2-byte elements, + slack to align to 1024 bytes
  return (kBM * D + 2 * kStages * kBN * D) * 2 + 1024;
}

// The CTA's shared memory: tiles (SW128, 1024-byte aligned) and the ring's barriers.
template <typename T, int D>
struct ExtendSmem {
  T* q;   // [kBM rows]
  T* k;   // [kStages][kBN rows]
  T* v;   // [kStages][kBN rows]
  int* item;                                        // [2]: the items handed to consumers
  uint32_t item_full;                               // + 8 * (k & 1)
  uint32_t q_full, q_empty;                         // mbarrier addresses
  uint32_t k_full, k_empty, v_full, v_empty;        // + 8 * stage
  __device__ uint32_t at(uint32_t bar, int stage) const { return bar + 8u * stage; }
};

// Stage and parity of the j-th tile in visiting order (j = 0, 1, ...): the ring's slot and the
// phase of its barriers that this use completes.
__device__ __forceinline__ int ring_stage(int j) { return j % kStages; }
__device__ __forceinline__ uint32_t ring_parity(int j) { return (uint32_t)(j / kStages) & 1u; }

// TMA maps of the K and V pools, [num_slots, num_kv_heads, D] as 3-D tensors with a box of
// (64 columns, 1 head, kBN slots) and the 128-byte swizzle: one box is one column block of a
// tile in the SW128 layout. use = 0 where the host could not encode them (then every tile
// loads with cp.async).
struct KvMaps {
  CUtensorMap k, v;
  int use;
};

// Work item w, with HB = num_q_heads / pack head blocks: token tile rank w / HB (0 = the last
// tile of the concatenation; tiles of kBM / pack tokens), head block hb = w % HB (q heads
// hb * pack .. hb * pack + pack - 1, all of kv head kvh).
struct ExtendItem {
  int req, hb, kvh;
  ExtendTile tl;
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// Row r of a tile whose rows hold 1 << pack_log2 heads: token (in the request) m0 + r / pack,
// q head hb * pack + r % pack.
__device__ __forceinline__ int row_token(const ExtendTile& tl, int r, int pack_log2) {
  return tl.m0 + (r >> pack_log2);
}
__device__ __forceinline__ int row_head(int hb, int r, int pack_log2) {
  return (hb << pack_log2) + (r & ((1 << pack_log2) - 1));
}

// Every warp locates its items itself (a warp-uniform scan of qo_indptr): no cross-warp
// hand-off is needed. req < 0: a spare item (past the last tile), which everyone skips.
__device__ __forceinline__ ExtendItem locate_item(const ExtendParams& p, int num_tiles, int w,
                                                  int lane) {
  const int pack_log2 = extend_pack_log2(p.group);
  const int blocks = p.num_q_heads >> pack_log2, bm = kBM >> pack_log2;
  ExtendItem it;
  it.hb = w % blocks;
  it.kvh = (it.hb << pack_log2) / p.group;
  int tile;
  locate_extend_tile(p, lane, num_tiles - 1 - w / blocks, bm, it.req, tile);
  if (it.req >= 0) it.tl = extend_tile<kBN>(p, it.req, tile, bm);
  return it;
}

// The producer's k-th item: thread 0 takes item numbers from the queue until one is not spare
// (or the queue is empty: then it also counts this CTA out, and the last CTA out resets the
// queue), publishes it in item[k & 1] for the consumers (item_full) and, through a named
// barrier, for the other producer warps. A slot is rewritten two items later, when the
// consumers have released the Q tile of the item in between, so long after they read it.
__device__ __forceinline__ ExtendItem next_item(const ExtendParams& p, int num_tiles,
                                                int num_items, int* item, uint32_t item_full,
                                                int k, int ptid) {
  const int lane = ptid % 32;
  if (ptid < 32) {
    ExtendItem it;
    int w;
    for (;;) {
      w = 0;
      if (lane == 0) w = atomicAdd(p.work_counters, 1);
      w = __shfl_sync(0xffffffffu, w, 0);
      if (w >= num_items) break;
      it = locate_item(p, num_tiles, w, lane);
      if (it.req >= 0) break;
    }
    if (lane == 0) {
      item[k & 1] = w;
      mbar::arrive(item_full + 8u * (k & 1));
      if (w >= num_items) {
        __threadfence();   // this CTA's last take, before it counts itself out
        if (atomicAdd(p.work_counters + 1, 1) == (int)gridDim.x - 1) {
          p.work_counters[0] = 0;
          p.work_counters[1] = 0;
        }
      }
    }
  }
  mbar::named_sync<3, 128>();
  const int w = item[k & 1];
  ExtendItem it;
  it.req = -1;
  if (w < num_items) it = locate_item(p, num_tiles, w, lane);
  return it;
}

// ---------------------------------------------------------------------------------- producer
// 128 threads (ptid 0..127). Per item: K(last), Q (once the consumers are done with the
// previous item's), then {K(n - 1), V(n)} for n from the last tile down, then V(0): the order
// the consumers need them in. Ring positions continue across items.
template <typename T, int D>
__device__ __forceinline__ void produce(const ExtendParams& p, int num_tiles, int num_items,
                                        const ExtendSmem<T, D>& sm, const KvMaps& maps, int ptid) {
  constexpr int kChunks = D / 8;               // 16-byte chunks per row
  constexpr int kRowsPerLoad = 32 / kChunks;   // rows one warp-wide cp.async covers
  constexpr int kLoads = 32 / kRowsPerLoad;    // per warp and tile: 32 rows
  const int warp = ptid / 32, lane = ptid % 32;
  const int chunk = lane % kChunks, sub = lane / kChunks;
  const int row0 = 32 * warp;   // this warp's rows of every tile

  int j0 = 0;   // ring position of the item's first tile
  for (int k = 0;; ++k) {   // k: items of this CTA so far
    const ExtendItem it = next_item(p, num_tiles, num_items, sm.item, sm.item_full, k, ptid);
    if (it.req < 0) return;
    const ExtendTile& tl = it.tl;
    const int32_t* idx = p.kv_indices + tl.kv_start;
    auto slot_of = [&](int n) {   // this lane's row of tile n (-1 past the request's KV)
      const int pos = n * kBN + row0 + lane;
      return pos < tl.kv_len ? __ldg(idx + pos) : -1;
    };
    const int64_t kv_head = (int64_t)it.kvh * p.kv_stride_h + chunk * 8;
    const T* kg = static_cast<const T*>(p.k) + kv_head;
    const T* vg = static_cast<const T*>(p.v) + kv_head;
    auto load = [&](const T* src, T* dst, int my_slot) {   // this warp's 32 rows of a tile
#pragma unroll 4
      for (int i = 0; i < kLoads; ++i) {
        const int r = i * kRowsPerLoad + sub;
        const int slot = __shfl_sync(0xffffffffu, my_slot, r);
        const bool ok = slot >= 0;
        cp_async_16(smem_u32(dst + wgmma::sw128_offset(kBN, row0 + r, chunk)),
                    src + (ok ? (int64_t)slot * p.kv_stride_slot : 0), ok);
      }
    };
    // A tile whose kBN rows all lie within the request and sit in consecutive slots loads with
    // two TMA boxes (D = 128) instead of 32 rows of cp.async per warp: its first slot, or -1.
    // Every producer warp reads the whole tile's slots, so all decide alike without talking.
    auto run_of = [&](int n) {
      if (!maps.use || (n + 1) * kBN > tl.kv_len) return -1;
      const int32_t* t = idx + n * kBN;
      const int first = __ldg(t);
      bool ok = true;
#pragma unroll
      for (int q = 0; q < kBN / 32; ++q) ok &= __ldg(t + 32 * q + lane) == first + 32 * q + lane;
      return __all_sync(0xffffffffu, ok) ? first : -1;
    };
    // one stage of K or V: by TMA (thread 0 arms the barrier with the bytes, everyone arrives)
    // or by cp.async (everyone's arrival waits for its own rows)
    auto fill = [&](const void* map, const T* src, T* dst, uint32_t full, int my_slot, int run) {
      if (run >= 0) {
        if (ptid == 0) {
          mbar::arrive_expect_tx(full, kBN * D * 2);
#pragma unroll
          for (int blk = 0; blk < D / 64; ++blk)
            mbar::tma_load_3d(smem_u32(dst + blk * kBN * 64), map, 64 * blk, it.kvh, run, full);
        } else {
          mbar::arrive(full);
        }
      } else {
        load(src, dst, my_slot);
        mbar::cp_async_arrive(full);
      }
    };
    auto load_k = [&](int j, int my_slot, int run) {
      const int st = ring_stage(j0 + j);
      mbar::wait(sm.at(sm.k_empty, st), ring_parity(j0 + j) ^ 1u);
      fill(&maps.k, kg, sm.k + st * kBN * D, sm.at(sm.k_full, st), my_slot, run);
    };
    auto load_v = [&](int j, int my_slot, int run) {
      const int st = ring_stage(j0 + j);
      mbar::wait(sm.at(sm.v_empty, st), ring_parity(j0 + j) ^ 1u);
      fill(&maps.v, vg, sm.v + st * kBN * D, sm.at(sm.v_full, st), my_slot, run);
    };

    const int last = tl.n_tiles - 1;
    int slot_v = slot_of(last);   // tile j's slots serve K(j) and, one tile later, V(j)
    int run_v = run_of(last);
    load_k(0, slot_v, run_v);

    // ---- Q rows [row0, row0 + 32) of the tile (row_token, row_head); rows past the request's
    // queries are zero
    mbar::wait(sm.q_empty, (uint32_t)(k & 1) ^ 1u);
    const int pack_log2 = extend_pack_log2(p.group);
    const T* qg = static_cast<const T*>(p.q) + chunk * 8;
#pragma unroll 4
    for (int i = 0; i < kLoads; ++i) {
      const int r = row0 + i * kRowsPerLoad + sub;
      const int t = row_token(tl, r, pack_log2);
      const bool ok = t < tl.qo_len;
      const T* src = qg + (ok ? (int64_t)(tl.qo_start + t) * p.q_stride_t +
                                    (int64_t)row_head(it.hb, r, pack_log2) * p.q_stride_h
                              : 0);
      cp_async_16(smem_u32(sm.q + wgmma::sw128_offset(kBM, r, chunk)), src, ok);
    }
    mbar::cp_async_arrive(sm.q_full);

    for (int j = 1; j <= last; ++j) {
      const int slot_k = slot_of(last - j), run_k = run_of(last - j);
      load_k(j, slot_k, run_k);
      load_v(j - 1, slot_v, run_v);
      slot_v = slot_k;
      run_v = run_k;
    }
    load_v(last, slot_v, run_v);
    j0 += tl.n_tiles;
  }
}

// ---------------------------------------------------------------------------------- consumer
// Online softmax of one S tile (rows q_row0 and q_row0 + 8 of this thread, e = 0, 1 and 2, 3
// of each 4-group), after the causal / length mask where the tile can need it. Leaves in s the
// softmax numerators rounded to T (as floats) and returns each row's rescale factor.
template <typename T, int kSN>
__device__ __forceinline__ void online_softmax(float (&s)[kSN], float (&row_m)[2],
                                               float (&row_l)[2], float (&alpha)[2], float sl2) {
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
      // rounded to T once, here: the P V product's A operand and the row sum use the same
      // weights, so each output row is an exactly normalised combination of V rows
      const float e0 = fast_exp2(fmaf(s[4 * i + 2 * h], sl2, -base));
      const float e1 = fast_exp2(fmaf(s[4 * i + 2 * h + 1], sl2, -base));
      const float2 r = TypeTraits<T>::to_float2(TypeTraits<T>::pack(e0, e1));
      s[4 * i + 2 * h] = r.x;
      s[4 * i + 2 * h + 1] = r.y;
      sum += r.x + r.y;
    }
    row_l[h] = row_l[h] * alpha[h] + sum;
  }
}

// s (rounded numerators) -> the A fragments of O += P V: k-step kk = KV rows 16 kk..
template <typename T, int kSN>
__device__ __forceinline__ void to_a_fragments(const float (&s)[kSN], uint32_t (&pa)[kSN / 8][4]) {
#pragma unroll
  for (int i = 0; i < kSN / 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      pa[i / 2][(i % 2) * 2 + h] = TypeTraits<T>::pack(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]);
  }
}

// S = Q K^T: D / 16 k-steps, each 32 bytes into a 128-byte row of one column block of K (and
// of Q, when Q is read from shared memory; else qa holds its A fragments)
template <typename T, int D>
__device__ __forceinline__ void issue_s(float (&s)[kBN / 2], const uint32_t (&qa)[D / 16][4],
                                        uint32_t q_addr, uint32_t k_addr) {
  wgmma::fence_operand(s);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;
    const uint64_t db = wgmma::make_desc(k_addr + blk * (kBN * 128) + in_row, 16, 1024);
    if constexpr (kQInRegs) {
      wgmma::wgmma_rs_m64n128k16<T>(s, qa[kk], db, kk > 0 ? 1 : 0);
    } else {
      const uint64_t da = wgmma::make_desc(q_addr + blk * (kBM * 128) + in_row, 16, 1024);
      wgmma::wgmma_ss_m64n128k16<T>(s, da, db, kk > 0 ? 1 : 0);
    }
  }
}

// This warp's 16 rows of the Q tile as A fragments (m16 k16 per k-step, the mma.sync layout
// wgmma takes from registers): ldmatrix x4 of the SW128 tile, lanes 0-15 rows 0-15 of the low
// 8 columns, lanes 16-31 of the high 8.
template <typename T, int D>
__device__ __forceinline__ void load_q_fragments(const T* sq, int row0, int lane,
                                                 uint32_t (&qa)[D / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t addr =
        smem_u32(sq + wgmma::sw128_offset(kBM, row0 + lane % 16, 2 * kk + lane / 16));
    ldmatrix_x4(addr, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
  }
}

template <typename T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[kBN / 16][4],
                                         uint32_t v_addr) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) {   // 16 KV rows = 2048 bytes of the MN-major V tile
    const uint64_t db = wgmma::make_desc(v_addr + kk * 2048, kBN * 128, 1024);
    if constexpr (D == 128) {
      wgmma::wgmma_rs_tb_m64n128k16<T>(o, pa[kk], db, 1);
    } else {
      wgmma::wgmma_rs_tb_m64n64k16<T>(o, pa[kk], db, 1);
    }
  }
}

// Turns on the tensor cores between the two consumers (kPingPong): barrier 1 + w is consumer
// w's turn; consumer 1 opens with an arrive on consumer 0's.
__device__ __forceinline__ void turn_wait(int cw) {
  if (!kPingPong) return;
  if (cw == 0) mbar::named_sync<1, 256>(); else mbar::named_sync<2, 256>();
}
__device__ __forceinline__ void turn_pass(int cw) {
  if (!kPingPong) return;
  if (cw == 0) mbar::named_arrive<2, 256>(); else mbar::named_arrive<1, 256>();
}

// lane 0 of each consumer warp arrives: the empty barriers expect 4 * kConsumers arrivals
__device__ __forceinline__ void release(uint32_t bar, int lane) {
  __syncwarp();
  if (lane == 0) mbar::arrive(bar);
}

// Normalises this thread's O rows (q_row0, q_row0 + 8: row_token, row_head of head block hb)
// and stores them: each quad of lanes writes 16 contiguous bytes per row and column block (the
// Q tile, the staging buffer of a one-item CTA, may already hold the next item's queries).
template <typename T, int D>
__device__ __forceinline__ void store_rows(const ExtendParams& p, const ExtendTile& tl, int hb,
                                           const float (&o)[D / 2], const float (&row_l)[2],
                                           int q_row0, int t4) {
  const int pack_log2 = extend_pack_log2(p.group);
  T* og = static_cast<T*>(p.out);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_l[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int r = q_row0 + h * 8;
    const int t = row_token(tl, r, pack_log2);
    if (t >= tl.qo_len) continue;
    T* row = og + ((int64_t)(tl.qo_start + t) * p.num_q_heads + row_head(hb, r, pack_log2)) * D +
             2 * t4;
#pragma unroll
    for (int q = 0; q < D / 8; ++q)   // 8 output columns per quad
      *reinterpret_cast<uint32_t*>(row + 8 * q) =
          TypeTraits<T>::pack(o[4 * q + 2 * h] * inv, o[4 * q + 2 * h + 1] * inv);
  }
}

// 128 threads (ctid 0..127) of consumer warpgroup cw: query rows [64 cw, 64 cw + 64) of every
// item. Ring positions continue across items, as the producer's.
template <typename T, int D>
__device__ __forceinline__ void consume(const ExtendParams& p, int num_tiles, int num_items,
                                        const ExtendSmem<T, D>& sm, int cw, int ctid) {
  constexpr int kSN = kBN / 2;   // S accumulators per thread (m64 n128)
  constexpr int kON = D / 2;     // O accumulators per thread (m64 nD)
  const int warp = ctid / 32, lane = ctid % 32;
  // accumulator layout (per warp, as mma.sync m16n8): element 4 i + e holds
  // row 16 warp + g4 + 8 (e >> 1), column 8 i + 2 t4 + (e & 1) of the warpgroup's 64 rows
  const int g4 = lane / 4, t4 = lane % 4;
  const int q_row0 = cw * 64 + warp * 16 + g4;   // tile-local rows q_row0, q_row0 + 8
  const float sl2 = p.scale_log2;
  const uint32_t q_addr = smem_u32(sm.q) + cw * 64 * 128;   // this warpgroup's 64 rows
  const uint32_t k_addr = smem_u32(sm.k), v_addr = smem_u32(sm.v);
  constexpr uint32_t kTileBytes = kBN * D * 2;

  if (cw == 1) turn_pass(1);   // consumer 0 issues first
  int j0 = 0;
  for (int k = 0;; ++k) {   // k: items of this CTA so far
    mbar::wait(sm.item_full + 8u * (k & 1), (uint32_t)(k >> 1) & 1u);
    const int w = sm.item[k & 1];
    if (w >= num_items) break;
    const ExtendItem it = locate_item(p, num_tiles, w, lane);
    const ExtendTile& tl = it.tl;
    // KV positions of this thread's queries: rows q_row0 and q_row0 + 8 are tokens 8 / pack apart
    const int pack_log2 = extend_pack_log2(p.group);
    const int qpos0 = tl.prefix + row_token(tl, q_row0, pack_log2), qstep = 8 >> pack_log2;
    auto mask = [&](float (&s)[kSN], int n) {
      if (n < tl.first_masked) return;
#pragma unroll
      for (int i = 0; i < kSN / 4; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int kpos = n * kBN + i * 8 + 2 * t4 + (e & 1);
          const int qpos = qpos0 + (e >> 1) * qstep;
          if (kpos > qpos || kpos >= tl.kv_len) s[4 * i + e] = -INFINITY;
        }
      }
    };

    float o[kON];
#pragma unroll
    for (int q = 0; q < kON; ++q) o[q] = 0.f;
    float row_m[2] = {-INFINITY, -INFINITY};
    float row_l[2] = {0.f, 0.f};
    float alpha[2];
    float s[kSN];
    uint32_t pa[kBN / 16][4];
    const int last = tl.n_tiles - 1;

    // ---- tile `last` (j = 0): S, then its softmax with nothing to overlap
    mbar::wait(sm.q_full, (uint32_t)(k & 1));
    uint32_t qa[D / 16][4];
    if constexpr (kQInRegs) {
      load_q_fragments<T, D>(sm.q, cw * 64 + warp * 16, lane, qa);
      release(sm.q_empty, lane);   // Q lives in registers now: the next item's may load
    }
    {
      const int st = ring_stage(j0);
      mbar::wait(sm.at(sm.k_full, st), ring_parity(j0));
      turn_wait(cw);
      wgmma::fence();
      issue_s<T, D>(s, qa, q_addr, k_addr + st * kTileBytes);
      wgmma::commit();
      turn_pass(cw);
      wgmma::wait<0>();
      wgmma::fence_operand(s);
      release(sm.at(sm.k_empty, st), lane);
      if (!kQInRegs && last == 0) release(sm.q_empty, lane);
    }
    mask(s, last);
    online_softmax<T, kSN>(s, row_m, row_l, alpha, sl2);
    to_a_fragments<T, kSN>(s, pa);

    // ---- tiles last - 1 .. 0: S(n) and P(n + 1) V(n + 1) in flight, then softmax(n)
    for (int j = 1; j <= last; ++j) {
      const int n = last - j;
      const int st = ring_stage(j0 + j), pst = ring_stage(j0 + j - 1);
      mbar::wait(sm.at(sm.k_full, st), ring_parity(j0 + j));
      turn_wait(cw);
      wgmma::fence();
      issue_s<T, D>(s, qa, q_addr, k_addr + st * kTileBytes);
      wgmma::commit();
      mbar::wait(sm.at(sm.v_full, pst), ring_parity(j0 + j - 1));
      wgmma::fence();   // the wait's loop lies between the first fence and this product
      issue_pv<T, D>(o, pa, v_addr + pst * kTileBytes);
      wgmma::commit();
      turn_pass(cw);
      wgmma::wait<1>();   // S(n) is in
      wgmma::fence_operand(s);
      release(sm.at(sm.k_empty, st), lane);
      if (!kQInRegs && j == last) release(sm.q_empty, lane);   // the item's last read of Q
      mask(s, n);
      online_softmax<T, kSN>(s, row_m, row_l, alpha, sl2);
      wgmma::wait<0>();   // P V is in: O and P may be touched again
      wgmma::fence_operand(o);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) wgmma::fence_operand(pa[kk]);
      release(sm.at(sm.v_empty, pst), lane);
      to_a_fragments<T, kSN>(s, pa);
      // rescale only where a row's max moved (multiplying by 1 is exact: skipping changes nothing)
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int q = 0; q < kON / 4; ++q) {
          o[4 * q + 0] *= alpha[0];
          o[4 * q + 1] *= alpha[0];
          o[4 * q + 2] *= alpha[1];
          o[4 * q + 3] *= alpha[1];
        }
      }
    }

    // ---- P(0) V(0)
    {
      const int pst = ring_stage(j0 + last);
      mbar::wait(sm.at(sm.v_full, pst), ring_parity(j0 + last));
      turn_wait(cw);
      wgmma::fence();
      issue_pv<T, D>(o, pa, v_addr + pst * kTileBytes);
      wgmma::commit();
      turn_pass(cw);
      wgmma::wait<0>();
      wgmma::fence_operand(o);
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) wgmma::fence_operand(pa[kk]);
      release(sm.at(sm.v_empty, pst), lane);
    }
    store_rows<T, D>(p, tl, it.hb, o, row_l, q_row0, t4);
    j0 += tl.n_tiles;
  }
  if (cw == 0) turn_wait(0);   // consumer 1's last pass: every arrive is matched
}

#endif  // sm_90a

// num_tiles: the launch's upper bound of token tiles (of kBM / pack tokens; see
// launch_paged_extend); items = num_tiles x num_q_heads / pack.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    paged_extend_kernel(const ExtendParams p, int num_tiles, const __grid_constant__ KvMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t bars[4 + 4 * kStages];
  __shared__ int items[2];

  // 1024-byte alignment: the swizzle pattern of every tile starts on a 1024-byte boundary
  const uint32_t raw_addr = smem_u32(smem_raw);
  ExtendSmem<T, D> sm;
  sm.q = reinterpret_cast<T*>(smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr));
  sm.k = sm.q + kBM * D;
  sm.v = sm.k + kStages * kBN * D;
  sm.item = items;
  sm.item_full = smem_u32(bars);
  sm.q_full = sm.item_full + 16;
  sm.q_empty = sm.q_full + 8;
  sm.k_full = sm.q_empty + 8;
  sm.k_empty = sm.k_full + 8 * kStages;
  sm.v_full = sm.k_empty + 8 * kStages;
  sm.v_empty = sm.v_full + 8 * kStages;

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbar::init(sm.item_full, 1);                // the producer's thread 0
    mbar::init(sm.item_full + 8, 1);
    mbar::init(sm.q_full, 128);                 // every producer thread, on its cp.async
    mbar::init(sm.q_empty, 4 * kConsumers);     // lane 0 of every consumer warp
    for (int st = 0; st < kStages; ++st) {
      mbar::init(sm.at(sm.k_full, st), 128);
      mbar::init(sm.at(sm.v_full, st), 128);
      mbar::init(sm.at(sm.k_empty, st), 4 * kConsumers);
      mbar::init(sm.at(sm.v_empty, st), 4 * kConsumers);
    }
    mbar::fence_init();
  }
  __syncthreads();
  const int num_items = num_tiles * (p.num_q_heads >> extend_pack_log2(p.group));
  const int wg = tid / 128;
  if (wg == 0) {
    mbar::reg_dealloc<kProducerRegs>();
    produce<T, D>(p, num_tiles, num_items, sm, maps, tid);
  } else {
    mbar::reg_alloc<kConsumerRegs>();
    consume<T, D>(p, num_tiles, num_items, sm, wg - 1, tid % 128);
  }
#else
  __trap();  // built without sm_90a: the host never launches this kernel then
#endif
}

}  // namespace sm90
}  // namespace attn
}  // namespace radixserve
