/* The C ABI of hvdx's TensorFlow-free kernel harness (libhvdx_harness.so, built from
 * csrc/harness/CMakeLists.txt). It calls the very functors the TensorFlow ops call
 * (csrc/kernels/: mstopk, sparse_accumulate, error_feedback, quantize .{h,cc,cu.cc}) on raw float32
 * buffers, so that they can be checked and timed where TensorFlow cannot run.
 *
 * Every function that can fail returns 0 on success, else the status code of the
 * functor's hvdx::Status (3 invalid argument, 13 internal: a CUDA call or launch failed,
 * 12 unimplemented: built without CUDA), and writes the message, NUL-terminated and
 * truncated to msg_size bytes, into msg (when msg is not NULL).
 *
 * index_bits selects the index type: 32 (int32_t, the ops' default) or 64 (int64_t).
 * GPU functions take device pointers and a cudaStream_t (NULL: the legacy default stream)
 * and only enqueue work: hvdx_cuda_sync() waits and returns any error of the stream. */
#ifndef HVDX_HARNESS_H_
#define HVDX_HARNESS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HVDX_HARNESS_ABI 2

int hvdx_harness_abi(void);     /* HVDX_HARNESS_ABI */
int hvdx_harness_has_cuda(void); /* 1 when the CUDA kernels are built in */

/* MSTopK (Algorithm 1): exactly min(k, d) elements of x into values/indices (sized
 * min(k, d)), thresholds[2] = {thres1, thres2}. `random` places the band window as the
 * op's random word does. threads: CPU threads (0: every hardware thread). */
int hvdx_mstopk_cpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                    void* indices, int index_bits, double* thresholds, int threads, char* msg, size_t msg_size);
int64_t hvdx_mstopk_gpu_scratch_bytes(int64_t d); /* -1 without CUDA */
int hvdx_mstopk_gpu(const float* x, int64_t d, int64_t k, int num_samplings, uint64_t random, float* values,
                    void* indices, int index_bits, double* thresholds, void* scratch, void* stream, char* msg,
                    size_t msg_size);

/* Sparse accumulation: out = dense (zeros when dense is NULL) + values[j] at indices[j],
 * each element adding its entries in ascending j in float32. The CPU rejects an index
 * outside [0, size); the GPU skips it (as the ops do). */
int hvdx_sparse_accumulate_cpu(const float* values, const void* indices, int index_bits, int64_t nnz,
                               const float* dense, float* out, int64_t size, int threads, char* msg, size_t msg_size);
int64_t hvdx_sparse_accumulate_gpu_workspace_bytes(int64_t nnz, int64_t size, int index_bits); /* -1 without CUDA */
int hvdx_sparse_accumulate_gpu(const float* values, const void* indices, int index_bits, int64_t nnz,
                               const float* dense, float* out, int64_t size, void* workspace, void* stream, char* msg,
                               size_t msg_size);

/* Error feedback with momentum correction (kernels/error_feedback.h): with g the sum of the
 * `count` (1..8) gradients grads[0..count) in order, u = momentum * velocity + g and
 * acc = decay * residual + u, velocity_out = u (velocity NULL: acc = decay * residual + g,
 * velocity_out unused). grads is a host array of `count` pointers (device pointers on the GPU). */
int hvdx_error_feedback_cpu(const float* const* grads, int count, const float* residual, const float* velocity,
                            float momentum, float decay, float* acc, float* velocity_out, int64_t n, int threads,
                            char* msg, size_t msg_size);
int hvdx_error_feedback_gpu(const float* const* grads, int count, const float* residual, const float* velocity,
                            float momentum, float decay, float* acc, float* velocity_out, int64_t n, void* stream,
                            char* msg, size_t msg_size);

/* The wire's chunked low-bit codes (kernels/quantize.h): n values (a multiple of chunk,
 * an even number >= 2) to bits (8 or 4) each plus a float32 scale per chunk, into packed
 * (n * bits / 8 + 4 * n / chunk bytes: the codes, then the scales) and dequantized (n
 * floats, q * s); dequantize decodes packed into out (n floats). */
int hvdx_quantize_cpu(const float* x, int64_t n, int bits, int chunk, uint8_t* packed, float* dequantized,
                      int threads, char* msg, size_t msg_size);
int hvdx_dequantize_cpu(const uint8_t* packed, int64_t n, int bits, int chunk, float* out, int threads, char* msg,
                        size_t msg_size);
int hvdx_quantize_gpu(const float* x, int64_t n, int bits, int chunk, uint8_t* packed, float* dequantized,
                      void* stream, char* msg, size_t msg_size);
int hvdx_dequantize_gpu(const uint8_t* packed, int64_t n, int bits, int chunk, float* out, void* stream, char* msg,
                        size_t msg_size);

/* Plain CUDA helpers, so that a driver needs no CuPy or PyTorch to move data. kind:
 * 1 host to device, 2 device to host, 3 device to device. */
int hvdx_cuda_malloc(void** ptr, int64_t bytes, char* msg, size_t msg_size);
int hvdx_cuda_free(void* ptr, char* msg, size_t msg_size);
int hvdx_cuda_memcpy(void* dst, const void* src, int64_t bytes, int kind, char* msg, size_t msg_size);
int hvdx_cuda_sync(void* stream, char* msg, size_t msg_size);

/* Error injection: a launch through the kernels' checked launcher (kernels/gpu_launch.h)
 * with a grid of 65536 blocks in y (the limit is 65535): must return 13 and name the CUDA
 * error (cudaErrorInvalidValue from CUDA 13 on an H100). */
int hvdx_inject_too_large_grid(void* stream, char* msg, size_t msg_size);

#ifdef __cplusplus
}
#endif

#endif /* HVDX_HARNESS_H_ */
