// Host interface of the dispatch-layout kernel (cuda/layout_kernel.cu).
#ifndef JAX_EP_CUDA_LAYOUT_LAUNCH_H_
#define JAX_EP_CUDA_LAYOUT_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_ep::cuda {

// Experts plus ranks the kernel counts: every block of its cluster keeps
// E + R + 1 counters (the 1: invalid entries) of 4 bytes in shared memory,
// within the 48 KB a launch gets without raising its limit. It also keeps the
// rank owner's multiply-shift exact (E * E < 2^32).
constexpr int kLayoutMaxCounters = 12000;

// Ranks: a token's ranks are one 32-bit mask.
constexpr int kLayoutMaxRanks = 32;

struct LayoutArgs {
  const int32_t* topk_idx;         // [T, K], any values
  int num_tokens;                  // T (this rank)
  int num_topk;                    // K <= 32
  int num_experts;                 // E
  int num_ranks;                   // R <= 32; E % R == 0
  int32_t* out_clean_idx;          // [T, K]: entries outside [-1, E) -> -1
  int32_t* out_num_invalid;        // []
  int32_t* out_tokens_per_rank;    // [R]: a token counts once per rank
  int32_t* out_tokens_per_expert;  // [E]: a token counts once per expert
  bool* out_is_token_in_rank;      // [T, R]
};

// cudaErrorInvalidValue unless 1 <= K <= 32, 1 <= R <= kLayoutMaxRanks, E is a
// positive multiple of R and E + R <= kLayoutMaxCounters.
cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream);

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LAYOUT_LAUNCH_H_
