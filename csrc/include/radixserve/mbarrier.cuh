// Hopper (sm_90) shared-memory barriers (mbarrier) and warpgroup register reallocation
// (setmaxnreg): the synchronisation of the warp-specialised extend kernel
// (extend_attention_sm90.cuh), where a producer warpgroup fills a ring of shared-memory stages
// and consumer warpgroups drain it.
//
// An mbarrier is a 64-bit word in shared memory with an expected arrival count and a phase bit.
// When the count of arrivals reaches the expected count, the phase completes and the barrier
// resets for the next phase. A waiter names the parity of the phase it waits for: on a fresh
// barrier, parity 1 (the phase "before" phase 0) counts as complete, so a producer waiting for
// an empty slot starts at parity 1 and a consumer waiting for a full one at parity 0; both flip
// each time the ring wraps.
//
// cp.async rows signal their completion with cp_async_mbar_arrive (noinc: the arrival is one of
// the expected ones, made when all earlier cp.async of the calling thread have landed), so a
// full barrier of a stage that P threads fill expects P arrivals.
// Everything here exists only when compiling for sm_90 or later; callers guard their use.
#pragma once

#include <cstdint>

namespace radixserve {
namespace attn {
namespace mbar {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// one thread initialises; the fence and a CTA barrier publish the barrier to every thread
__device__ __forceinline__ void init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ bool try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
// until the phase of this parity has completed
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  while (!try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// arrives and adds `bytes` to the phase's expected transaction count (the TMA loads that
// complete_tx on this barrier)
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// TMA: box (c0, c1, c2) of a 3-D tensor map into shared memory at dst (1024-byte aligned for a
// 128-byte swizzle); its bytes complete_tx on bar. map: the address of a __grid_constant__
// CUtensorMap kernel parameter.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, int c0, int c1, int c2,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// arrives when every cp.async this thread issued before it has completed
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Warpgroup-wide register reallocation (every thread of the warpgroup executes it): a
// producer that needs few registers gives them back, consumers take them.
template <int N>
__device__ __forceinline__ void reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: sync waits for all of
// them, arrive counts this warp and goes on.
template <int kId, int kThreads>
__device__ __forceinline__ void named_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_arrive() {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

#endif  // __CUDA_ARCH__ >= 900

}  // namespace mbar
}  // namespace attn
}  // namespace radixserve
