// Block-level pieces of the expert-major pair plan, shared by its own kernels
// (ht_pair_plan.cu, ranks > 1) and the one-rank dispatch kernel, which ranks
// each block's own tokens itself (ht_dispatch.cu). One definition of what a
// pair rank is, so both give the same bits:
//   * a token's pairs are its first top-k entries naming each expert in
//     [0, E) (a token naming e twice has one pair of e; -1 and entries outside
//     [0, E) have none);
//   * pair (t, e)'s rank is the number of tokens before t, in token order,
//     with a pair of e (the one-rank dispatch ranks from its block's first
//     token and adds the blocks before it to the group's base).
// Shared memory only; the callers own the global words (ht_types.h plan_*).
#ifndef JAX_EP_CUDA_HT_PAIR_RANK_CUH_
#define JAX_EP_CUDA_HT_PAIR_RANK_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep::cuda {

constexpr int kPairRankWordBits = 32;  // tokens per word of a sub-tile's bits
constexpr int kPairRankMaxWords = 32;  // at most 1024 tokens per sub-tile

// Calls f(k, e) for each top-k entry of one token: e is the entry's expert if
// k is the first entry naming that valid expert, else -1.
template <typename F>
__device__ __forceinline__ void for_each_pair(const int32_t* idx, int num_topk, int num_experts,
                                              F f) {
  for (int k = 0; k < num_topk; ++k) {
    const int e = __ldg(idx + k);
    bool first = e >= 0 && e < num_experts;
    for (int j = 0; j < k && first; ++j) first = __ldg(idx + j) != e;
    f(k, first ? e : -1);
  }
}

// s_count[e] += the tokens of [lo, hi) with a pair of e (shared atomics: the
// sums do not depend on the threads' order). No barrier inside: the caller
// orders s_count's zeroing before and its reads after.
__device__ __forceinline__ void count_pair_range(const int32_t* topk_idx, int lo, int hi,
                                                 int num_topk, int num_experts, int* s_count) {
  for (int t = lo + static_cast<int>(threadIdx.x); t < hi; t += blockDim.x) {
    for_each_pair(topk_idx + static_cast<size_t>(t) * num_topk, num_topk, num_experts,
                  [&](int, int e) {
                    if (e >= 0) atomicAdd(&s_count[e], 1);
                  });
  }
}

// Ranks the pairs of tokens [lo, hi): on entry s_running[e] holds the tokens
// before lo with a pair of e, on exit those before hi. Writes
// pair_rank[t][k] = the rank for the entry owning a pair, -1 for every other
// k. Walks the range in sub-tiles of kPairRankWordBits * words tokens: a bit
// per (expert, token) in s_bits [E][words] (atomicOr: the bits, unlike an
// atomic counter's order, do not depend on the threads' timing), then each
// pair's rank = s_running[e] plus the bits of e before its token. All threads
// call it; its first barrier orders the caller's writes of s_running before
// their reads, and it ends on a barrier when the range is not empty.
__device__ __forceinline__ void rank_pair_range(const int32_t* topk_idx, int lo, int hi,
                                                int num_topk, int num_experts, int words,
                                                int* s_running, uint32_t* s_bits,
                                                int32_t* pair_rank) {
  const int E = num_experts, K = num_topk;
  const int tile = kPairRankWordBits * words;
  for (int first = lo; first < hi; first += tile) {
    const int n = min(tile, hi - first);
    for (int i = threadIdx.x; i < E * words; i += blockDim.x) s_bits[i] = 0u;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      for_each_pair(topk_idx + static_cast<size_t>(first + i) * K, K, E, [&](int, int e) {
        if (e >= 0) {
          atomicOr(&s_bits[e * words + i / kPairRankWordBits], 1u << (i % kPairRankWordBits));
        }
      });
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      int32_t* ranks = pair_rank + static_cast<size_t>(first + i) * K;
      for_each_pair(topk_idx + static_cast<size_t>(first + i) * K, K, E, [&](int k, int e) {
        int rank = -1;
        if (e >= 0) {
          const uint32_t* bits = s_bits + e * words;
          rank = s_running[e];
          for (int w = 0; w < i / kPairRankWordBits; ++w) rank += __popc(bits[w]);
          rank += __popc(bits[i / kPairRankWordBits] &
                         ((1u << (i % kPairRankWordBits)) - 1u));
        }
        ranks[k] = rank;
      });
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      int count = 0;
      for (int w = 0; w < words; ++w) count += __popc(s_bits[e * words + w]);
      s_running[e] += count;
    }
    __syncthreads();  // the next sub-tile zeroes the bits only after these reads
  }
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_PAIR_RANK_CUH_
