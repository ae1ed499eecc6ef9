// Host interface of the dispatch-layout kernel (cuda/layout_kernel.cu).
#ifndef JAX_EP_CUDA_LAYOUT_LAUNCH_H_
#define JAX_EP_CUDA_LAYOUT_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace jax_ep::cuda {

// Experts plus ranks one block may count (4 bytes each in shared memory; a
// single block counts all of them, within the 48 KB a launch gets without
// raising its limit).
constexpr int kLayoutMaxCounters = 12000;

struct LayoutArgs {
  const int32_t* topk_idx;         // [T, K], any values
  int num_tokens;                  // T (this rank)
  int num_topk;                    // K <= 32
  int num_experts;                 // E
  int num_ranks;                   // R; E % R == 0
  int32_t* out_clean_idx;          // [T, K]: entries outside [-1, E) -> -1
  int32_t* out_num_invalid;        // []
  int32_t* out_tokens_per_rank;    // [R]: a token counts once per rank
  int32_t* out_tokens_per_expert;  // [E]: a token counts once per expert
  bool* out_is_token_in_rank;      // [T, R]
};

// cudaErrorInvalidValue when K > 32 or E + R > kLayoutMaxCounters.
cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream);

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LAYOUT_LAUNCH_H_
