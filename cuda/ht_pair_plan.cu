// The expert-major dispatch's pair plan: for each of this rank's tokens t and
// top-k entries k, the rank of t among this rank's tokens that choose expert
// topk_idx[t][k] (in token order), and this rank's tokens per expert. The
// dispatch kernel (ht_dispatch.cu, kExpertMajor) places pair (source s, token
// t, local expert e) of a receiver at group_start[e] + (the tokens of sources
// before s choosing e) + this rank.
//
// PROTOCOL (local: peers never read these words; two kernels on the
// dispatch's stream, before its kernel, which reads their results):
//   ht_pair_count (G blocks): block b counts, per expert e, the tokens of its
//     range [b*L, b*L + L), L = ceil(T / G), that choose e (a token naming e
//     twice counts once; entries outside [0, E) count nowhere) and writes
//     plan_block_counts[b][e] for every e, zeros included.
//   ht_pair_rank (the same G blocks, after ht_pair_count in stream order):
//     block b starts from base[e] = sum_{b' < b} plan_block_counts[b'][e] and
//     walks its range in sub-tiles of 32*W tokens: a bit per (expert, token)
//     in shared memory (atomicOr; the bits, unlike an atomic counter's order,
//     do not depend on the threads' timing), then each entry's rank = base[e]
//     plus the bits of e before its token. plan_pair_rank[t][k] = that rank
//     for the first k naming a valid e, -1 for every other k. Block G-1 writes
//     plan_expert_totals[e] (its base plus its own count).
//   Nothing is reset: every plan rewrites every word it owns, and the next
//   plan starts after the dispatch kernel that read this one ended (stream
//   order).
// At one rank neither kernel runs: each block of the dispatch kernel counts
// and ranks its own range's pairs and sums the other blocks' counts
// (ht_dispatch.cu), with
// the same block functions (ht_pair_rank.cuh), which saves two launches and
// the gaps between them (docs/benchmarks.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/ht_launch.h"
#include "cuda/ht_pair_rank.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kPlanThreads = 512;
// Shared memory of ht_pair_rank: running counts [E] and the bits [E][W].
constexpr size_t kPlanSmemBytes = 96 * 1024;

__device__ __forceinline__ void block_range(int num_tokens, int* lo, int* hi) {
  const int per_block = (num_tokens + gridDim.x - 1) / gridDim.x;
  *lo = min(num_tokens, static_cast<int>(blockIdx.x) * per_block);
  *hi = min(num_tokens, *lo + per_block);
}

__global__ void __launch_bounds__(kPlanThreads)
    ht_pair_count(HtContext ctx, const int32_t* topk_idx, int num_tokens) {
  extern __shared__ int s_count[];  // [E]
  const int E = ctx.dims.num_experts, K = ctx.dims.num_topk;
  for (int e = threadIdx.x; e < E; e += blockDim.x) s_count[e] = 0;
  __syncthreads();
  int lo, hi;
  block_range(num_tokens, &lo, &hi);
  count_pair_range(topk_idx, lo, hi, K, E, s_count);
  __syncthreads();
  int32_t* out = ctx.buffers.plan_block_counts + static_cast<size_t>(blockIdx.x) * E;
  for (int e = threadIdx.x; e < E; e += blockDim.x) out[e] = s_count[e];
}

__global__ void __launch_bounds__(kPlanThreads)
    ht_pair_rank(HtContext ctx, const int32_t* topk_idx, int num_tokens, int words) {
  extern __shared__ int s_plan[];
  const int E = ctx.dims.num_experts, K = ctx.dims.num_topk;
  int* s_running = s_plan;                                      // [E]
  uint32_t* s_bits = reinterpret_cast<uint32_t*>(s_plan + E);  // [E][words]
  const HtBuffers& b = ctx.buffers;
  // The earlier blocks' counts: eight independent loads in flight per step.
  // (One load per step put up to 63 L2 round trips one after the other in
  // front of the last block's work.)
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    const int32_t* column = b.plan_block_counts + e;
    const int num_before = static_cast<int>(blockIdx.x);
    int base = 0;
    int other = 0;
    for (; other + 8 <= num_before; other += 8) {
      int part[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) part[i] = column[static_cast<size_t>(other + i) * E];
#pragma unroll
      for (int i = 0; i < 8; ++i) base += part[i];
    }
    for (; other < num_before; ++other) base += column[static_cast<size_t>(other) * E];
    s_running[e] = base;
  }
  int lo, hi;
  block_range(num_tokens, &lo, &hi);
  rank_pair_range(topk_idx, lo, hi, K, E, words, s_running, s_bits, b.plan_pair_rank);
  // Thread e wrote s_running[e] (or its last barrier ordered the writes).
  if (blockIdx.x == gridDim.x - 1) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) b.plan_expert_totals[e] = s_running[e];
  }
}

}  // namespace

cudaError_t LaunchHtPairPlan(const HtContext& ctx, const int32_t* topk_idx, int num_tokens,
                             cudaStream_t stream) {
  const int E = ctx.dims.num_experts;
  if (ctx.dims.num_ranks == 1) return cudaSuccess;  // the dispatch kernel ranks its own tokens
  const int grid = std::max(1, std::min({kHtPlanBlocks, ctx.num_sms,
                                         (num_tokens + kPairRankWordBits - 1) /
                                             kPairRankWordBits}));
  const int per_block = (num_tokens + grid - 1) / grid;
  const int max_words = static_cast<int>((kPlanSmemBytes / sizeof(int) - E) / std::max(E, 1));
  const int words = std::max(1, std::min({kPairRankMaxWords, max_words,
                                          (per_block + kPairRankWordBits - 1) /
                                              kPairRankWordBits}));
  if (E <= 0 || max_words < 1 || num_tokens < 0) return cudaErrorInvalidValue;
  ht_pair_count<<<grid, kPlanThreads, E * sizeof(int), stream>>>(ctx, topk_idx, num_tokens);
  const size_t smem = (static_cast<size_t>(E) + static_cast<size_t>(E) * words) * sizeof(int);
  ht_pair_rank<<<grid, kPlanThreads, smem, stream>>>(ctx, topk_idx, num_tokens, words);
  return cudaGetLastError();
}

cudaError_t PrepareHtPairPlan() {
  cudaError_t err = cudaFuncSetAttribute(ht_pair_rank, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kPlanSmemBytes));
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(ht_pair_count, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(kPlanSmemBytes));
  }
  return err;
}

}  // namespace jax_ep::cuda
