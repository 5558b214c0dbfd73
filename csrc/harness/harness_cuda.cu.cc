// The GPU half of the harness's C ABI (hvdx_harness.h): the CUDA functors of
// csrc/kernels/*.cu.cc on a GpuDevice holding the caller's stream, plus the CUDA helpers
// and the injected launch error.
#if GOOGLE_CUDA
#include <cuda_runtime.h>

#include "harness/harness_common.h"
#include "harness/hvdx_harness.h"
#include "kernels/device.h"
#include "kernels/error_feedback.h"
#include "kernels/gpu_launch.h"
#include "kernels/mstopk.h"
#include "kernels/quantize.h"
#include "kernels/sparse_accumulate.h"

namespace {

using hvdx::GpuDevice;
using hvdx::Status;
using hvdx::harness::Report;

cudaStream_t Stream(void* stream) { return static_cast<cudaStream_t>(stream); }

template <typename Tidx>
Status MsTopKGpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                 void* indices, double* thresholds, void* scratch, void* stream) {
  return hvdx::functor::MsTopK<GpuDevice, float, Tidx>()(GpuDevice(Stream(stream)), x, d, k, num_samplings, random,
                                                         values, static_cast<Tidx*>(indices), thresholds, scratch);
}

template <typename Tidx>
Status SparseGpu(const float* values, const void* indices, int64_t nnz, const float* dense, float* out, int64_t size,
                 void* workspace, void* stream) {
  return hvdx::functor::SparseAccumulate<GpuDevice, float, Tidx, float>()(
      GpuDevice(Stream(stream)), values, static_cast<const Tidx*>(indices), nnz, dense, out, size, workspace);
}

__global__ void Nothing(int) {}

}  // namespace

extern "C" {

int hvdx_harness_has_cuda(void) { return 1; }

int64_t hvdx_mstopk_gpu_scratch_bytes(int64_t d) {
  return hvdx::functor::MsTopK<GpuDevice, float, int32_t>::ScratchBytes(d);
}

int hvdx_mstopk_gpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                    void* indices, int index_bits, double* thresholds, void* scratch, void* stream, char* msg,
                    size_t msg_size) {
  int64_t kk = 0;
  Status status = hvdx::harness::CheckMsTopK(d, k, num_samplings, index_bits, &kk);
  if (status.ok()) {
    status = index_bits == 32
                 ? MsTopKGpu<int32_t>(x, d, kk, num_samplings, random, values, indices, thresholds, scratch, stream)
                 : MsTopKGpu<int64_t>(x, d, kk, num_samplings, random, values, indices, thresholds, scratch, stream);
  }
  return Report(status, msg, msg_size);
}

int64_t hvdx_sparse_accumulate_gpu_workspace_bytes(int64_t nnz, int64_t size, int index_bits) {
  return index_bits == 32 ? hvdx::functor::SparseAccumulate<GpuDevice, float, int32_t, float>::WorkspaceBytes(nnz, size)
                          : hvdx::functor::SparseAccumulate<GpuDevice, float, int64_t, float>::WorkspaceBytes(nnz, size);
}

int hvdx_sparse_accumulate_gpu(const float* values, const void* indices, int index_bits, int64_t nnz,
                               const float* dense, float* out, int64_t size, void* workspace, void* stream, char* msg,
                               size_t msg_size) {
  Status status = hvdx::harness::CheckSparse(nnz, size, index_bits);
  if (status.ok()) {
    status = index_bits == 32 ? SparseGpu<int32_t>(values, indices, nnz, dense, out, size, workspace, stream)
                              : SparseGpu<int64_t>(values, indices, nnz, dense, out, size, workspace, stream);
  }
  return Report(status, msg, msg_size);
}

int hvdx_error_feedback_gpu(const float* const* grads, int count, const float* residual, const float* velocity,
                            float momentum, float decay, float* acc, float* velocity_out, int64_t n, void* stream,
                            char* msg, size_t msg_size) {
  hvdx::functor::GradientList list;
  Status status = hvdx::harness::GradientList(grads, count, n, &list);
  if (status.ok()) {
    status = hvdx::functor::ErrorFeedback<GpuDevice>()(GpuDevice(Stream(stream)), list, residual, velocity, momentum,
                                                         decay, acc, velocity_out, n);
  }
  return Report(status, msg, msg_size);
}

int hvdx_quantize_gpu(const float* x, int64_t n, int bits, int chunk, uint8_t* packed, float* dequantized,
                      void* stream, char* msg, size_t msg_size) {
  return Report(hvdx::functor::Quantize<GpuDevice>()(GpuDevice(Stream(stream)), x, n, bits, chunk, packed, dequantized),
                msg, msg_size);
}

int hvdx_dequantize_gpu(const uint8_t* packed, int64_t n, int bits, int chunk, float* out, void* stream, char* msg,
                        size_t msg_size) {
  return Report(hvdx::functor::Dequantize<GpuDevice>()(GpuDevice(Stream(stream)), packed, n, bits, chunk, out), msg,
                msg_size);
}

int hvdx_cuda_malloc(void** ptr, int64_t bytes, char* msg, size_t msg_size) {
  return Report(hvdx::CudaStatus(cudaMalloc(ptr, static_cast<size_t>(bytes)), "cudaMalloc"), msg, msg_size);
}

int hvdx_cuda_free(void* ptr, char* msg, size_t msg_size) {
  return Report(hvdx::CudaStatus(cudaFree(ptr), "cudaFree"), msg, msg_size);
}

int hvdx_cuda_memcpy(void* dst, const void* src, int64_t bytes, int kind, char* msg, size_t msg_size) {
  const cudaMemcpyKind kinds[] = {cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                  cudaMemcpyDeviceToDevice};
  if (kind < 1 || kind > 3)
    return Report(hvdx::errors::InvalidArgument("hvdx_cuda_memcpy: kind must be 1, 2 or 3, got ", kind), msg,
                  msg_size);
  return Report(hvdx::CudaStatus(cudaMemcpy(dst, src, static_cast<size_t>(bytes), kinds[kind]), "cudaMemcpy"), msg,
                msg_size);
}

int hvdx_cuda_sync(void* stream, char* msg, size_t msg_size) {
  Status status = hvdx::CudaStatus(cudaStreamSynchronize(Stream(stream)), "cudaStreamSynchronize");
  if (status.ok()) status = hvdx::CudaStatus(cudaGetLastError(), "a kernel before cudaStreamSynchronize");
  return Report(status, msg, msg_size);
}

int hvdx_inject_too_large_grid(void* stream, char* msg, size_t msg_size) {
  return Report(hvdx::Launch("Nothing", Nothing, dim3(1, 65536, 1), dim3(1), 0, Stream(stream), 0), msg, msg_size);
}

}  // extern "C"

#endif  // GOOGLE_CUDA
