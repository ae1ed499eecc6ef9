// The bounded barrier of the host's collective steps (host_barrier.cu). Plain C++.
#ifndef JAX_EP_CUDA_HOST_BARRIER_H_
#define JAX_EP_CUDA_HOST_BARRIER_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_ep::cuda {

// Barrier number `n` over `npes` PEs through the symmetric `flags` [npes]
// (zero-initialised, reused by every barrier). Waits for it on `stream`;
// *first_missing is the first PE that did not arrive within timeout_ns, or -1.
// `device_result` is one int32 of device memory.
cudaError_t RunBoundedBarrier(uint64_t* flags, int me, int npes, uint32_t n,
                              uint64_t timeout_ns, cudaStream_t stream, int32_t* device_result,
                              int* first_missing);

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HOST_BARRIER_H_
