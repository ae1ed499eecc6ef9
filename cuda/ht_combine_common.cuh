// What both HT combines' receive kernels (ht_combine.cu, ht_pair_combine.cu)
// do alike: find the ranks whose rows of this combine never came, and void
// the tokens that needed them.
#ifndef JAX_EP_CUDA_HT_COMBINE_COMMON_CUH_
#define JAX_EP_CUDA_HT_COMBINE_COMMON_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_row_elements.cuh"
#include "cuda/ht_types.h"

namespace jax_ep::cuda {

// The ranks (bits) whose rows of combine `seq` are missing: every rank after a
// faulted dispatch (*num_tokens < 0), else those whose combine flag's bounded
// wait timed out (the wait records the fault). wait_peers false: nothing is
// sent (one rank), no flag is waited for. All threads of the block call it.
__device__ __forceinline__ uint32_t combine_lost_ranks(const HtContext& ctx,
                                                       const uint64_t* flags, uint32_t seq,
                                                       const int32_t* num_tokens,
                                                       bool wait_peers) {
  __shared__ uint32_t s_lost;
  if (threadIdx.x == 0) s_lost = *num_tokens < 0 ? 0xffffffffu : 0u;
  __syncthreads();
  for (int r = threadIdx.x; wait_peers && r < ctx.dims.num_ranks; r += blockDim.x) {
    if (wait_flag(flags + r, seq, ctx.timeout_ns, ctx.status, kOpHtCombine, r, 0) ==
        kFlagTimedOut) {
      atomicOr(&s_lost, 1u << r);
    }
  }
  __syncthreads();
  return s_lost;
}

// A void token's row (the warp): NaN in every element, so it cannot look valid.
template <typename T>
__device__ __forceinline__ void store_nan_row(int4* out_row, int num_vec, int lane) {
  using E = RowElements<T>;
  int4 nan;
#pragma unroll
  for (int j = 0; j < E::kPerVector; ++j) E::set(nan, j, __int_as_float(0x7fc00000));
  for (int v = lane; v < num_vec; v += kWarpSize) out_row[v] = nan;
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_COMBINE_COMMON_CUH_
