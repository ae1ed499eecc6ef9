// get_dispatch_layout on the GPU: one launch of one thread-block cluster.
//
// PROTOCOL: purely local (no peer memory, no flags, no global atomics, no
// scratch). The grid is a single cluster of kClusterBlocks blocks (sm_90
// distributed shared memory):
//   * block b takes the b-th contiguous slice of the T tokens, one token per
//     thread; it writes clean_idx and is_token_in_rank of its tokens and counts
//     them in its own shared counters [E experts | R ranks | invalid entries]
//     (a token counts once per expert and once per rank);
//   * after a cluster barrier, block b sums the b-th slice of those counters
//     over the shared memory of every block of the cluster and writes it to
//     tokens_per_expert, tokens_per_rank or num_invalid;
//   * a second cluster barrier keeps each block's shared memory alive until the
//     other blocks have read it.
// Every output element is written exactly once by this launch, so XLA's
// buffers need no clearing: no memset, no host sync, one node in a command
// buffer.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/layout_launch.h"

namespace jax_ep::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kClusterBlocks = 8;    // the portable cluster size: 8 SMs
constexpr int kLayoutThreads = 512;  // tokens one block handles per round
constexpr int kMaxTopk = 32;

// First item of slice b when n items are split over the cluster's blocks.
__device__ __forceinline__ int slice_begin(int n, int b) {
  return static_cast<int>(static_cast<long long>(n) * b / kClusterBlocks);
}

// Rank owning expert e: e / experts_per_rank as floor(e * magic / 2^32), with
// magic = floor(2^32 / experts_per_rank) + 1 (exact while e * experts_per_rank
// < 2^32, which E <= kLayoutMaxCounters guarantees).
__device__ __forceinline__ int owner_of(int e, uint64_t owner_magic) {
  return static_cast<int>((static_cast<uint64_t>(e) * owner_magic) >> 32);
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kLayoutThreads, 1)
    layout_kernel(LayoutArgs args, uint64_t owner_magic) {
  // This block's counters: [E] tokens per expert, [R] tokens per rank, [1] invalid entries.
  extern __shared__ int s_counts[];
  const int E = args.num_experts, R = args.num_ranks, K = args.num_topk, T = args.num_tokens;
  const int num_counters = E + R + 1;
  int* s_tokens_per_rank = s_counts + E;
  int* s_num_invalid = s_counts + E + R;
  for (int i = threadIdx.x; i < num_counters; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();

  const int block = blockIdx.x;  // the grid is one cluster: block == cluster block rank
  const int lane = threadIdx.x % 32;
  const int tokens_end = slice_begin(T, block + 1);
  // Rows as int4 when K % 4 == 0 (XLA's buffers are at least 16-byte aligned;
  // checked anyway).
  const bool int4_rows =
      K % 4 == 0 &&
      (reinterpret_cast<uintptr_t>(args.topk_idx) | reinterpret_cast<uintptr_t>(args.out_clean_idx)) %
              16 == 0;
  // Rounds are block-uniform (the rank ballots need whole warps).
  for (int round = slice_begin(T, block); round < tokens_end; round += blockDim.x) {
    const int t = round + threadIdx.x;
    uint32_t rank_mask = 0;  // bit r: the token has an entry owned by rank r
    if (t < tokens_end) {
      const int32_t* row = args.topk_idx + static_cast<size_t>(t) * K;
      int32_t* clean_row = args.out_clean_idx + static_cast<size_t>(t) * K;
      int32_t idx[kMaxTopk];
      if (int4_rows) {
#pragma unroll
        for (int v = 0; v < kMaxTopk / 4; ++v) {
          if (4 * v >= K) break;
          const int4 q = __ldg(reinterpret_cast<const int4*>(row) + v);
          idx[4 * v] = q.x, idx[4 * v + 1] = q.y, idx[4 * v + 2] = q.z, idx[4 * v + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          if (k >= K) break;
          idx[k] = __ldg(row + k);
        }
      }
      int num_invalid = 0;
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        if (k >= K) break;
        // -1 <= idx < E, in unsigned arithmetic (no overflow for any int32).
        const bool valid = static_cast<uint32_t>(idx[k]) + 1u <= static_cast<uint32_t>(E);
        num_invalid += valid ? 0 : 1;
        idx[k] = valid ? idx[k] : -1;
        if (idx[k] < 0) continue;
        bool first_of_expert = true;  // duplicates count at their first slot only
#pragma unroll
        for (int j = 0; j < k; ++j) first_of_expert &= idx[j] != idx[k];
        if (first_of_expert) atomicAdd(&s_counts[idx[k]], 1);
        rank_mask |= 1u << owner_of(idx[k], owner_magic);
      }
      if (num_invalid) atomicAdd(s_num_invalid, num_invalid);
      if (int4_rows) {
#pragma unroll
        for (int v = 0; v < kMaxTopk / 4; ++v) {
          if (4 * v >= K) break;
          reinterpret_cast<int4*>(clean_row)[v] =
              make_int4(idx[4 * v], idx[4 * v + 1], idx[4 * v + 2], idx[4 * v + 3]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          if (k >= K) break;
          clean_row[k] = idx[k];
        }
      }
      bool* in_rank_row = args.out_is_token_in_rank + static_cast<size_t>(t) * R;
      for (int r = 0; r < R; ++r) in_rank_row[r] = (rank_mask >> r) & 1u;
    }
    // Tokens per rank: one shared atomic per warp and rank present in the warp.
    for (uint32_t present = __reduce_or_sync(~0u, rank_mask); present != 0;
         present &= present - 1) {
      const int r = __ffs(present) - 1;
      const int tokens = __popc(__ballot_sync(~0u, (rank_mask >> r) & 1u));
      if (lane == 0) atomicAdd(&s_tokens_per_rank[r], tokens);
    }
  }

  // Block b sums counters [c_begin, c_end) over the cluster and writes them.
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's counts are final (release / acquire)
  const int c_begin = slice_begin(num_counters, block), c_end = slice_begin(num_counters, block + 1);
  for (int c = c_begin + threadIdx.x; c < c_end; c += blockDim.x) {
    int total = 0;
#pragma unroll
    for (int src = 0; src < kClusterBlocks; ++src) total += cluster.map_shared_rank(s_counts, src)[c];
    if (c < E) {
      args.out_tokens_per_expert[c] = total;
    } else if (c < E + R) {
      args.out_tokens_per_rank[c - E] = total;
    } else {
      *args.out_num_invalid = total;
    }
  }
  cluster.sync();  // no block exits (freeing its shared memory) while another reads it
}

}  // namespace

cudaError_t LaunchLayout(const LayoutArgs& args, cudaStream_t stream) {
  if (args.num_topk < 1 || args.num_topk > kMaxTopk || args.num_ranks < 1 ||
      args.num_ranks > kLayoutMaxRanks || args.num_tokens < 0 ||
      args.num_experts < args.num_ranks || args.num_experts % args.num_ranks != 0 ||
      args.num_experts + args.num_ranks > kLayoutMaxCounters) {
    return cudaErrorInvalidValue;
  }
  const uint64_t owner_magic = (uint64_t{1} << 32) / (args.num_experts / args.num_ranks) + 1;
  const size_t smem = static_cast<size_t>(args.num_experts + args.num_ranks + 1) * sizeof(int);
  layout_kernel<<<kClusterBlocks, kLayoutThreads, smem, stream>>>(args, owner_magic);
  return cudaGetLastError();
}

}  // namespace jax_ep::cuda
