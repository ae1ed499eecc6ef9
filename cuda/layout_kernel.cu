// get_dispatch_layout on the GPU: one pass over this rank's top-k indices.
//
// PROTOCOL: purely local, no peer memory, no flags. One block (the work is
// T * K entries, a few hundred KB at most): the block zeroes its shared
// counters, each thread takes whole tokens (one warp lane per token) and
// adds to them (shared atomics), then the block writes every output. Every
// output element is written by this launch, so XLA's buffers need no
// clearing; nothing survives the launch.
#include <cuda_runtime.h>

#include "cuda/layout_launch.h"

namespace jax_ep::cuda {
namespace {

constexpr int kLayoutThreads = 1024;

__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(LayoutArgs args) {
  extern __shared__ int s_counts[];  // [E] per expert, then [R] per rank
  __shared__ int s_invalid;
  const int E = args.num_experts, R = args.num_ranks, K = args.num_topk;
  const int experts_per_rank = E / R;
  int* s_expert = s_counts;
  int* s_rank = s_counts + E;
  for (int i = threadIdx.x; i < E + R; i += blockDim.x) s_counts[i] = 0;
  if (threadIdx.x == 0) s_invalid = 0;
  __syncthreads();
  int invalid = 0;
  for (int t = threadIdx.x; t < args.num_tokens; t += blockDim.x) {
    const int32_t* row = args.topk_idx + static_cast<size_t>(t) * K;
    int32_t clean[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      if (k >= K) break;
      const int32_t e = row[k];
      const bool valid = e >= -1 && e < E;
      invalid += valid ? 0 : 1;
      clean[k] = valid ? e : -1;
      args.out_clean_idx[static_cast<size_t>(t) * K + k] = clean[k];
    }
    // Count each expert and each rank once per token: only at its first slot.
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      if (k >= K) break;
      if (clean[k] < 0) continue;
      bool first_expert = true, first_rank = true;
      const int owner = clean[k] / experts_per_rank;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (j >= k) break;
        first_expert &= clean[j] != clean[k];
        first_rank &= clean[j] < 0 || clean[j] / experts_per_rank != owner;
      }
      if (first_expert) atomicAdd(&s_expert[clean[k]], 1);
      if (first_rank) atomicAdd(&s_rank[owner], 1);
    }
    bool* in_rank = args.out_is_token_in_rank + static_cast<size_t>(t) * R;
    for (int r = 0; r < R; ++r) {
      bool any = false;
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        if (k >= K) break;
        any |= clean[k] >= 0 && clean[k] / experts_per_rank == r;
      }
      in_rank[r] = any;
    }
  }
  if (invalid) atomicAdd(&s_invalid, invalid);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) args.out_tokens_per_expert[e] = s_expert[e];
  for (int r = threadIdx.x; r < R; r += blockDim.x) args.out_tokens_per_rank[r] = s_rank[r];
  if (threadIdx.x == 0) *args.out_num_invalid = s_invalid;
}

}  // namespace

cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream) {
  if (args.num_topk > 32 || args.num_topk < 1 || args.num_ranks < 1 ||
      args.num_experts % args.num_ranks != 0 ||
      args.num_experts + args.num_ranks > kLayoutMaxCounters) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = static_cast<size_t>(args.num_experts + args.num_ranks) * sizeof(int);
  layout_kernel<<<1, kLayoutThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_ep::cuda
