// Checked kernel launches for hvdx's CUDA kernels (as TensorFlow's GpuLaunchKernel): a
// launch that fails (no kernel image for this device, too many resources requested, a
// sticky error from before) is reported through the op's status instead of leaving the
// outputs uninitialised. The status is hvdx::Status (kernels/status.h): TensorFlow's in
// the op library, the harness's own without TensorFlow.
#ifndef HVDX_KERNELS_GPU_LAUNCH_H_
#define HVDX_KERNELS_GPU_LAUNCH_H_

#if GOOGLE_CUDA
#include <cuda_runtime.h>

#include <string>

#include "kernels/status.h"

namespace hvdx {

// The status of the CUDA call or launch just made: `what` names it in the message.
inline Status CudaStatus(cudaError_t result, const char* what) {
  if (result == cudaSuccess) return OkStatus();
  return errors::Internal("hvdx: CUDA ", what, " failed: ", cudaGetErrorName(result), " (",
                                        cudaGetErrorString(result), ")");
}

// Launches kernel<<<grid, block, shared, stream>>>(args...) and returns the launch's status.
template <typename... Params, typename... Args>
Status Launch(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
              Args... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return OkStatus();  // nothing to do
  kernel<<<grid, block, shared, stream>>>(static_cast<Params>(args)...);
  return CudaStatus(cudaGetLastError(), name);
}

}  // namespace hvdx

#define HVDX_CUDA_RETURN_IF_ERROR(call, what) HVDX_RETURN_IF_ERROR(::hvdx::CudaStatus((call), (what)))

#endif  // GOOGLE_CUDA
#endif  // HVDX_KERNELS_GPU_LAUNCH_H_
