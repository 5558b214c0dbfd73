// The CPU half of the harness's C ABI (hvdx_harness.h): the CPU functors of
// csrc/kernels/*.cc on a CpuDevice of `threads` threads; without CUDA, the GPU entry
// points answer "built without CUDA".
#include <thread>

#include "harness/harness_common.h"
#include "harness/hvdx_harness.h"
#include "kernels/device.h"
#include "kernels/error_feedback.h"
#include "kernels/mstopk.h"
#include "kernels/quantize.h"
#include "kernels/sparse_accumulate.h"

namespace {

using hvdx::CpuDevice;
using hvdx::Status;
using hvdx::harness::Report;

CpuDevice Device(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return CpuDevice(threads);
}

template <typename Tidx>
Status MsTopKCpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                 void* indices, double* thresholds, int threads) {
  return hvdx::functor::MsTopK<CpuDevice, float, Tidx>()(Device(threads), x, d, k, num_samplings, random, values,
                                                         static_cast<Tidx*>(indices), thresholds, nullptr);
}

template <typename Tidx>
Status SparseCpu(const float* values, const void* indices, int64_t nnz, const float* dense, float* out, int64_t size,
                 int threads) {
  const Tidx* idx = static_cast<const Tidx*>(indices);
  for (int64_t j = 0; j < nnz; ++j) {  // as the CPU op: the functor trusts the indices
    if (idx[j] < 0 || static_cast<int64_t>(idx[j]) >= size)
      return hvdx::errors::InvalidArgument("indices[", j, "] = ", static_cast<int64_t>(idx[j]),
                                           " is out of range [0, ", size, ")");
  }
  return hvdx::functor::SparseAccumulate<CpuDevice, float, Tidx, float>()(Device(threads), values, idx, nnz, dense,
                                                                          out, size, nullptr);
}

}  // namespace

extern "C" {

int hvdx_harness_abi(void) { return HVDX_HARNESS_ABI; }

int hvdx_mstopk_cpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                    void* indices, int index_bits, double* thresholds, int threads, char* msg, size_t msg_size) {
  int64_t kk = 0;
  Status status = hvdx::harness::CheckMsTopK(d, k, num_samplings, index_bits, &kk);
  if (status.ok()) {
    status = index_bits == 32 ? MsTopKCpu<int32_t>(x, d, kk, num_samplings, random, values, indices, thresholds, threads)
                              : MsTopKCpu<int64_t>(x, d, kk, num_samplings, random, values, indices, thresholds, threads);
  }
  return Report(status, msg, msg_size);
}

int hvdx_sparse_accumulate_cpu(const float* values, const void* indices, int index_bits, int64_t nnz,
                               const float* dense, float* out, int64_t size, int threads, char* msg, size_t msg_size) {
  Status status = hvdx::harness::CheckSparse(nnz, size, index_bits);
  if (status.ok()) {
    status = index_bits == 32 ? SparseCpu<int32_t>(values, indices, nnz, dense, out, size, threads)
                              : SparseCpu<int64_t>(values, indices, nnz, dense, out, size, threads);
  }
  return Report(status, msg, msg_size);
}

int hvdx_error_feedback_cpu(const float* const* grads, int count, const float* residual, const float* velocity,
                            float momentum, float decay, float* acc, float* velocity_out, int64_t n, int threads,
                            char* msg, size_t msg_size) {
  hvdx::functor::GradientList list;
  Status status = hvdx::harness::GradientList(grads, count, n, &list);
  if (status.ok()) {
    status = hvdx::functor::ErrorFeedback<CpuDevice>()(Device(threads), list, residual, velocity, momentum, decay,
                                                         acc, velocity_out, n);
  }
  return Report(status, msg, msg_size);
}

int hvdx_quantize_cpu(const float* x, int64_t n, int bits, int chunk, uint8_t* packed, float* dequantized,
                      int threads, char* msg, size_t msg_size) {
  return Report(hvdx::functor::Quantize<CpuDevice>()(Device(threads), x, n, bits, chunk, packed, dequantized), msg,
                msg_size);
}

int hvdx_dequantize_cpu(const uint8_t* packed, int64_t n, int bits, int chunk, float* out, int threads, char* msg,
                        size_t msg_size) {
  return Report(hvdx::functor::Dequantize<CpuDevice>()(Device(threads), packed, n, bits, chunk, out), msg, msg_size);
}

#if !GOOGLE_CUDA
int hvdx_harness_has_cuda(void) { return 0; }
int64_t hvdx_mstopk_gpu_scratch_bytes(int64_t) { return -1; }
int hvdx_mstopk_gpu(const float*, int64_t, int64_t, int, uint64_t, float*, void*, int, double*, void*, void*, char* msg,
                    size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int64_t hvdx_sparse_accumulate_gpu_workspace_bytes(int64_t, int64_t, int) { return -1; }
int hvdx_sparse_accumulate_gpu(const float*, const void*, int, int64_t, const float*, float*, int64_t, void*, void*,
                               char* msg, size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int hvdx_error_feedback_gpu(const float* const*, int, const float*, const float*, float, float, float*, float*, int64_t,
                            void*, char* msg, size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int hvdx_quantize_gpu(const float*, int64_t, int, int, uint8_t*, float*, void*, char* msg, size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int hvdx_dequantize_gpu(const uint8_t*, int64_t, int, int, float*, void*, char* msg, size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int hvdx_cuda_malloc(void**, int64_t, char* msg, size_t msg_size) { return hvdx::harness::NoCuda(msg, msg_size); }
int hvdx_cuda_free(void*, char* msg, size_t msg_size) { return hvdx::harness::NoCuda(msg, msg_size); }
int hvdx_cuda_memcpy(void*, const void*, int64_t, int, char* msg, size_t msg_size) {
  return hvdx::harness::NoCuda(msg, msg_size);
}
int hvdx_cuda_sync(void*, char* msg, size_t msg_size) { return hvdx::harness::NoCuda(msg, msg_size); }
int hvdx_inject_too_large_grid(void*, char* msg, size_t msg_size) { return hvdx::harness::NoCuda(msg, msg_size); }
#endif

}  // extern "C"
