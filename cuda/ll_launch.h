// Host launchers of the low-latency kernels (ll_kernels.cu). Plain C++: the
// FFI glue in xla_ffi/cuda/ calls these without seeing CUDA device code.
#ifndef JAX_EP_CUDA_LL_LAUNCH_H_
#define JAX_EP_CUDA_LL_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/ep_types.h"

namespace jax_ep::cuda {

// x: bf16 [num_tokens, H]; topk_idx: int32 [num_tokens, K]; num_invalid: int32[1].
// ticket (may be null): receives the call's sequence number for the recv.
cudaError_t LaunchLlDispatchSend(const LlContext& ctx, const void* x, const int32_t* topk_idx,
                                 int num_tokens, bool use_fp8, int32_t* num_invalid,
                                 uint32_t* ticket, cudaStream_t stream);

// ticket: the send's ticket (device memory), or null right after the send in
// the same stream. out_x: [E_local, R*T, H] bf16 (or fp8 e4m3 with
// use_fp8); out_scales: float32 [E_local, R*T, H/128] (fp8 only); out_count:
// int32 [E_local]; out_recv_src: int32 [E_local, R*T] (src_rank * num_tokens +
// src_token, -1 past count).
cudaError_t LaunchLlDispatchRecv(const LlContext& ctx, const uint32_t* ticket, int num_tokens,
                                 bool use_fp8, void* out_x, float* out_scales, int32_t* out_count,
                                 int32_t* out_recv_src, cudaStream_t stream);

// The one-call dispatch: send and receive parts in one kernel; arguments as in
// the two above.
cudaError_t LaunchLlDispatch(const LlContext& ctx, const void* x, const int32_t* topk_idx,
                             int num_tokens, bool use_fp8, int32_t* num_invalid, void* out_x,
                             float* out_scales, int32_t* out_count, int32_t* out_recv_src,
                             cudaStream_t stream);

// Dynamic shared memory the dispatch send part needs for num_tokens tokens, and
// the most a kernel may use (larger batches are refused: use the HT ops).
size_t LlDispatchSmemBytes(int num_tokens, const EpDims& dims);
size_t LlMaxDynamicSmemBytes();

// y: bf16 [E_local, R*T, H]; recv_src/count from the dispatch; ticket as above.
cudaError_t LaunchLlCombineSend(const LlContext& ctx, const void* y, const int32_t* recv_src,
                                const int32_t* count, int num_tokens, uint32_t* ticket,
                                cudaStream_t stream);

// ticket as in LaunchLlDispatchRecv; out: bf16 [num_tokens, H].
cudaError_t LaunchLlCombineRecv(const LlContext& ctx, const uint32_t* ticket,
                                const int32_t* topk_idx, const float* topk_weights,
                                int num_tokens, void* out, cudaStream_t stream);

// The one-call combine: send and receive parts in one kernel.
cudaError_t LaunchLlCombine(const LlContext& ctx, const void* y, const int32_t* recv_src,
                            const int32_t* count, const int32_t* topk_idx,
                            const float* topk_weights, int num_tokens, void* out,
                            cudaStream_t stream);

// Loads the LL kernels and sets their attributes (call once at initialisation).
cudaError_t PrepareLlKernels();

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LL_LAUNCH_H_
