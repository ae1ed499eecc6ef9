// get_dispatch_layout on the GPU: one pass over this rank's top-k indices per
// block.
//
// PROTOCOL: purely local, no peer memory, no flags, no atomics to global
// memory. B blocks; every block reads all T * K indices (a few hundred KB at
// most, from L2 after the first block) and
//   * writes clean_idx and is_token_in_rank for its own slice of tokens;
//   * counts, in shared memory, only its own slice of experts and of ranks
//     (a token counts once per expert and once per rank), then writes those
//     counters;
//   * block 0 also counts the invalid entries.
// Every output element is written exactly once by this launch, so XLA's
// buffers need no clearing and no block waits for another.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/layout_launch.h"

namespace jax_ep::cuda {
namespace {

constexpr int kLayoutThreads = 512;
constexpr int kLayoutMaxBlocks = 32;
constexpr int kTokensPerBlock = 256;

// [first, last) of slice b of n items split over num_blocks.
__device__ __forceinline__ int slice_begin(int n, int b, int num_blocks) {
  return static_cast<int>((static_cast<long long>(n) * b) / num_blocks);
}

__global__ void __launch_bounds__(kLayoutThreads, 1) layout_kernel(LayoutArgs args) {
  extern __shared__ int s_counts[];  // this block's experts, then its ranks
  __shared__ int s_invalid;
  const int E = args.num_experts, R = args.num_ranks, K = args.num_topk, T = args.num_tokens;
  const int experts_per_rank = E / R;
  const int b = blockIdx.x, B = gridDim.x;
  const int e0 = slice_begin(E, b, B), e1 = slice_begin(E, b + 1, B);
  const int r0 = slice_begin(R, b, B), r1 = slice_begin(R, b + 1, B);
  const int t0 = slice_begin(T, b, B), t1 = slice_begin(T, b + 1, B);
  int* s_expert = s_counts;             // [e1 - e0]
  int* s_rank = s_counts + (e1 - e0);   // [r1 - r0]
  for (int i = threadIdx.x; i < (e1 - e0) + (r1 - r0); i += blockDim.x) s_counts[i] = 0;
  if (threadIdx.x == 0) s_invalid = 0;
  __syncthreads();
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  int invalid = 0;
  for (int t = threadIdx.x; t < T; t += blockDim.x) {
    const int32_t* row = topk_idx + static_cast<size_t>(t) * K;
    int32_t clean[32];
#pragma unroll
    for (int k = 0; k < 32; ++k) clean[k] = k < K ? __ldg(row + k) : -1;
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      const bool valid = clean[k] >= -1 && clean[k] < E;
      if (k < K) invalid += valid ? 0 : 1;
      clean[k] = valid ? clean[k] : -1;
    }
    // Each expert and each rank counts at the token's first slot holding it.
#pragma unroll
    for (int k = 0; k < 32; ++k) {
      if (k >= K) break;
      const int e = clean[k];
      if (e < 0) continue;
      const int owner = e / experts_per_rank;
      const bool my_expert = e >= e0 && e < e1, my_rank = owner >= r0 && owner < r1;
      if (!my_expert && !my_rank) continue;
      bool first_expert = true, first_rank = true;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        if (j >= k) break;
        first_expert &= clean[j] != e;
        first_rank &= clean[j] < 0 || clean[j] / experts_per_rank != owner;
      }
      if (my_expert && first_expert) atomicAdd(&s_expert[e - e0], 1);
      if (my_rank && first_rank) atomicAdd(&s_rank[owner - r0], 1);
    }
    if (t >= t0 && t < t1) {
      int32_t* out = args.out_clean_idx + static_cast<size_t>(t) * K;
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        if (k < K) out[k] = clean[k];
      }
      bool* in_rank = args.out_is_token_in_rank + static_cast<size_t>(t) * R;
      for (int r = 0; r < R; ++r) {
        bool any = false;
#pragma unroll
        for (int k = 0; k < 32; ++k) any |= k < K && clean[k] >= 0 && clean[k] / experts_per_rank == r;
        in_rank[r] = any;
      }
    }
  }
  if (b == 0 && invalid) atomicAdd(&s_invalid, invalid);
  __syncthreads();
  for (int e = e0 + threadIdx.x; e < e1; e += blockDim.x) args.out_tokens_per_expert[e] = s_expert[e - e0];
  for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) args.out_tokens_per_rank[r] = s_rank[r - r0];
  if (b == 0 && threadIdx.x == 0) *args.out_num_invalid = s_invalid;
}

}  // namespace

cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream) {
  if (args.num_topk > 32 || args.num_topk < 1 || args.num_ranks < 1 ||
      args.num_experts % args.num_ranks != 0 ||
      args.num_experts + args.num_ranks > kLayoutMaxCounters) {
    return cudaErrorInvalidValue;
  }
  const int blocks = std::max(1, std::min(kLayoutMaxBlocks,
                                          (args.num_tokens + kTokensPerBlock - 1) / kTokensPerBlock));
  // A block counts at most ceil(E / blocks) experts and ceil(R / blocks) ranks.
  const size_t smem = static_cast<size_t>((args.num_experts + blocks - 1) / blocks +
                                          (args.num_ranks + blocks - 1) / blocks) * sizeof(int);
  layout_kernel<<<blocks, kLayoutThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jax_ep::cuda
