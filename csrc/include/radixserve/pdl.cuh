// Programmatic dependent launch (PDL, sm_90+): a kernel launched with the
// ProgrammaticStreamSerialization attribute may start while the kernel before it in the stream
// is still running, once every CTA of that kernel has called pdl_launch_dependents() (or
// exited). It must call pdl_wait() before it reads anything the earlier kernel writes, or
// writes anything it reads: pdl_wait() returns when the earlier kernel has completed and its
// memory is visible. Work that depends on neither (a weight stream's first loads) goes before
// it. Both are no-ops below sm_90 and in kernels launched without the attribute. Header-only.
#pragma once

#include <cuda_runtime.h>

namespace radixserve {

// Lets the next kernel in the stream (if launched with PDL) be scheduled from now on.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Blocks until the previous kernel in the stream has completed, its writes visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl is true (the
// caller checks the device is sm_90+). Stream capture records it as a programmatic graph edge.
template <typename... KArgs, typename... Args>
cudaError_t launch_with_pdl(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                            cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
}

}  // namespace radixserve
