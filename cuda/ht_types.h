// Buffers and context of the high-throughput (HT) kernels. Plain C++.
#ifndef JAX_EP_CUDA_HT_TYPES_H_
#define JAX_EP_CUDA_HT_TYPES_H_

#include <cstddef>
#include <cstdint>

#include "cuda/ep_types.h"
#include "cuda/limits.h"

namespace jax_ep::cuda {

// Symmetric HT buffers (local addresses; peers reached through nvshmem_ptr).
//   counts            [2][R][R] int32, by seq parity: row s is written by source s
//                     (its tokens per rank)
//   notify_flags      [2][R] by seq parity: (seq, 1) from source s once its counts
//                     row landed
//   recv_x            [R*T] rows of row_bytes: received rows, already in output order
//   recv_scales       [R*T][H/128] float32 (FP8 dispatch)
//   recv_src          [R*T] int32 source token index of each received row
//   recv_idx/recv_w   [R*T][K] int32/float32: top-k of each received row, rewritten
//                     to this rank's local experts (-1 / 0 elsewhere)
//   chunk_arrived     [R][C] uint32, C = ceil(T / kHtChunkRows): rows of source s's
//                     chunk c (rows s_first + c*kHtChunkRows ..) that have landed here;
//                     added to by s (one release-add per row), reset to 0 by this
//                     rank once the chunk is complete
//   combine_recv[p]   [R][T] bf16 rows: rank r's copy of local token t
//   combine_flags[p]  [R] (seq, 0) from rank r once its rows landed
// Expert-major dispatch only (ht_pair_plan.cu, ht_dispatch.cu):
//   expert_counts     [2][R][E_local] int32, by seq parity: row s is written by
//                     source s before its notify flag (its tokens per local
//                     expert of this rank)
//   recv_pair_rank    [R*T][K] int32: for each received row and k choosing a
//                     local expert here, the token's rank among its source's
//                     tokens choosing that expert (-1 elsewhere)
//   plan_*            this rank's own scratch (never read by peers), written by
//                     the pair plan before the dispatch kernel reads it:
//                     block_counts [HtPlanBlockRows(R)][E], pair_rank [T][K],
//                     expert_totals [E] (at one rank the dispatch kernel
//                     writes block_counts and pair_rank itself, in shared
//                     memory the totals: ht_dispatch.cu); at one rank also
//                     block_before [kHtOneRankPlanBlocks][E] (row b: the
//                     pairs per expert of the blocks before b) and
//                     token_slot [T] (a token's index among its block range's
//                     routed tokens, -1: none), for the warps that take
//                     tokens of other blocks' ranges
struct HtBuffers {
  int32_t* counts;
  uint64_t* notify_flags;
  char* recv_x;
  float* recv_scales;
  int32_t* recv_src;
  int32_t* recv_idx;
  float* recv_w;
  uint32_t* chunk_arrived;
  int chunks_per_source;
  char* combine_recv[2];
  uint64_t* combine_flags[2];
  size_t row_bytes;
  int32_t* expert_counts;
  int32_t* recv_pair_rank;
  int32_t* plan_block_counts;
  int32_t* plan_pair_rank;
  int32_t* plan_expert_totals;
  int32_t* plan_block_before;  // one rank only (else null): see above
  int32_t* plan_token_slot;    // one rank only (else null): see above
};

// kHtPlanBlocks, kHtOneRankPlanBlocks: cuda/limits.h.
// Rows of plan_block_counts.
constexpr int HtPlanBlockRows(int num_ranks) {
  return num_ranks == 1 ? kHtOneRankPlanBlocks : kHtPlanBlocks;
}

struct HtContext {
  EpDims dims;
  HtBuffers buffers;
  DeviceCounters* counters;  // device memory
  DeviceStatus* status;      // host-mapped
  uint64_t timeout_ns;
  int num_sms;               // SM budget of the HT kernels (EpGroup.num_sms)
  DeviceProfile* profile;    // device memory, or null (profiling off)
  // Experiments, set from the environment at initialize (docs/benchmarks.md):
  int recv_divisor;          // dispatch: grid / recv_divisor blocks receive (>= 2)
};

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_TYPES_H_
