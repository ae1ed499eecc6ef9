// The expert-major HT dispatch's pair placement (ht_dispatch.cu kExpertMajor;
// docs/design.md, "HT protocol", expert-major): group layout, pair rows,
// padding rows, and storing a row to each of its pair rows. Included by
// ht_dispatch.cu alone.
#ifndef JAX_EP_CUDA_HT_DISPATCH_PAIRS_CUH_
#define JAX_EP_CUDA_HT_DISPATCH_PAIRS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_dispatch_plan.cuh"
#include "cuda/ht_pair_rank.cuh"

namespace jax_ep::cuda {
namespace {

// ---------------------------------------------------------------- expert-major
// The expert-major dispatch's shared memory, after the send plan (dynamic):
//   base [R][E_local]   pair row of source s's first pair for local expert e:
//                       the group's start plus the pairs of the sources before s
//   group_start [E_local], group_pairs [E_local]  (pairs received, before the cut at M)
//   pad_first [E_local + 1], pad_prefix [E_local + 2]  the padding rows: range e
//                       (e < E_local: group e's alignment rows; E_local: the
//                       rows past the last group) is [pad_first[e], pad_first[e]
//                       + its length), pad_prefix the exclusive scan of the lengths
//   sums [4]            scan totals, pairs kept, pairs received (block 0)
struct PairSmem {
  int* base;
  int* group_start;
  int* group_pairs;
  int* pad_first;
  int* pad_prefix;
  int* sums;
};
__host__ __device__ constexpr size_t pair_smem_bytes(int num_ranks, int experts_per_rank) {
  return sizeof(int) * (static_cast<size_t>(num_ranks) * experts_per_rank +
                        4 * static_cast<size_t>(experts_per_rank) + 3 + 4);
}
__device__ __forceinline__ PairSmem pair_smem(uint8_t* at, int num_ranks, int experts_per_rank) {
  int* p = reinterpret_cast<int*>(at);
  PairSmem s;
  s.base = p;
  s.group_start = s.base + num_ranks * experts_per_rank;
  s.group_pairs = s.group_start + experts_per_rank;
  s.pad_first = s.group_pairs + experts_per_rank;
  s.pad_prefix = s.pad_first + experts_per_rank + 1;
  s.sums = s.pad_prefix + experts_per_rank + 2;
  return s;
}

// Every block, once the counts per (source, local expert) are readable (the
// count exchange's flags acquired; at one rank `one_rank_totals`, this
// block's sums of the plan's columns in shared memory): the groups, each
// source's first row in each, and the padding ranges. Block 0 writes
// tokens_per_expert, group_sizes, num_pairs and num_dropped. (At one rank a
// pair's rank counts from its block range's first token: the sender adds
// the blocks before that range, plan_block_before, to its rank.) All threads
// call it.
template <bool kSingleRank>
__device__ void place_groups(const HtContext& ctx, const HtDispatchArgs& args, uint32_t seq,
                             const PairSmem& p, const int* one_rank_totals) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks, El = d.experts_per_rank;
  const int M = args.pairs.num_rows, A = args.pairs.alignment;
  const int32_t* counts = ctx.buffers.expert_counts + (seq & 1) * R * El;
  if (threadIdx.x == 0) p.sums[2] = p.sums[3] = 0;
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    int running = 0;
    for (int s = 0; s < R; ++s) {
      p.base[s * El + e] = running;
      // Written by source s before its notify flag, which this block acquired.
      running += kSingleRank ? one_rank_totals[e]
                             : static_cast<int>(ld_volatile_u32(
                                   reinterpret_cast<const uint32_t*>(counts + s * El + e)));
    }
    p.group_pairs[e] = running;
    p.group_start[e] = (running + A - 1) / A * A;  // padded: scanned into the starts
  }
  shared_exclusive_scan(p.group_start, El, &p.sums[0]);
  int kept = 0, received = 0;
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    const int start = p.group_start[e], full = p.group_pairs[e];
    const int padded = (full + A - 1) / A * A;
    for (int s = 0; s < R; ++s) p.base[s * El + e] += start;
    p.pad_first[e] = min(M, start + full);
    p.pad_prefix[e] = min(M, start + padded) - p.pad_first[e];
    const int room = max(M - start, 0);
    kept += min(room, full);
    received += full;
    if (blockIdx.x == 0) {
      args.out_tokens_per_expert[e] = min(room, full);
      args.pairs.out_group_sizes[e] = min(room, padded);
    }
  }
  if (threadIdx.x == 0) {
    p.pad_first[El] = min(M, p.sums[0]);
    p.pad_prefix[El] = M - p.pad_first[El];
  }
  kept = __reduce_add_sync(0xffffffffu, kept);
  received = __reduce_add_sync(0xffffffffu, received);
  if (threadIdx.x % kWarpSize == 0 && (kept | received) != 0) {
    atomicAdd(&p.sums[2], kept);
    atomicAdd(&p.sums[3], received);
  }
  shared_exclusive_scan(p.pad_prefix, El + 1, &p.sums[1]);
  if (threadIdx.x == 0) {
    p.pad_prefix[El + 1] = p.sums[1];
    if (blockIdx.x == 0) {
      *args.pairs.out_num_pairs = p.sums[2];
      *args.out_num_dropped = p.sums[3] - p.sums[2];
    }
  }
  __syncthreads();
}

// One received (or own) row's pairs, by its warp; lane k < K holds entry k:
// `local` its local expert here (-1: elsewhere or invalid), `weight` its
// weight (0 where local is -1), `rank` the token's rank among its source's
// tokens choosing that expert (-1 but on the first entry naming it, the
// pair's owner). `source_base` is base[s] of the row's source. Writes the
// staging row `row`'s slot_row and rows_by_expert and each kept pair's
// expert, weight (the entries' weights summed in k order from 0.0f) and
// staging row. Returns the lane's pair row: the owners' rows below M, -1
// elsewhere.
__device__ __forceinline__ int place_pairs(const HtPairArgs& pairs, const int* source_base,
                                           int row, int local, float weight, int rank,
                                           int num_topk, int lane) {
  int pair_row = -1;
  if (local >= 0 && rank >= 0) {
    pair_row = source_base[local] + rank;
    if (pair_row >= pairs.num_rows) pair_row = -1;  // dropped: past M
  }
  const uint32_t kept = __ballot_sync(0xffffffffu, pair_row >= 0);
  int slot = -1, before = 0;
  float summed = 0.0f;
  for (int j = 0; j < num_topk; ++j) {
    const int other_local = __shfl_sync(0xffffffffu, local, j);
    const float other_weight = __shfl_sync(0xffffffffu, weight, j);
    const int other_rank = __shfl_sync(0xffffffffu, rank, j);
    const int other_row = __shfl_sync(0xffffffffu, pair_row, j);
    if (local >= 0 && other_local == local) {
      summed += other_weight;
      if (other_rank >= 0) slot = other_row;
    }
    if (((kept >> j) & 1u) != 0u && other_local < local) ++before;
  }
  if (lane < num_topk) {
    const size_t at = static_cast<size_t>(row) * num_topk;
    pairs.out_slot_row[at + lane] = local >= 0 ? slot : -1;
    if (pair_row >= 0) pairs.out_rows_by_expert[at + before] = pair_row;
    if (lane >= __popc(kept)) pairs.out_rows_by_expert[at + lane] = -1;
  }
  if (pair_row >= 0) {
    pairs.out_pair_expert[pair_row] = local;
    pairs.out_pair_weight[pair_row] = summed;
    pairs.out_pair_src[pair_row] = row;
  }
  return pair_row;
}

// The rows holding no pair (each group's alignment rows, the rows past the
// last group): zero rows and scales, expert -1, weight 0, staging row -1;
// then the staging rows past the received ones: slot_row, rows_by_expert and
// recv_src -1. Warp `worker` of `num_workers`.
// Padding row j (0 <= j < pad_prefix[El + 1], in group order) is the warp's
// when j = worker (mod num_workers); its group e is the one with
// pad_prefix[e] <= j < pad_prefix[e + 1], found by a running index that only
// moves forward, so a warp reads each group's bounds once and a call without
// padding (A = 1, every group full) does no per-group work at all. (Walking
// every group with two remainders each cost every warp about 11,000
// instructions, padding or not.) zero_pair_padding_row zeroes padding row j,
// `group` the warp's running index (start at 0; the warp's j only grow).
// padding_rows_taken: the one-rank expert-major dispatch's warps took the
// padding rows as work items (dispatch_send_role); only the staging rows are
// left here.
template <bool kHasScales>
__device__ __forceinline__ void zero_pair_padding_row(const HtDispatchArgs& args,
                                                      const PairSmem& p, int j, int* group,
                                                      int lane) {
  int e = *group;
  while (p.pad_prefix[e + 1] <= j) ++e;  // stops at e <= El: pad_prefix[El + 1] > j
  *group = e;
  const int row = p.pad_first[e] + (j - p.pad_prefix[e]);
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                      static_cast<size_t>(row) * args.out_row_stride);
  for (int v = lane; v < num_vec; v += kWarpSize) st_na_v4(dst + v, make_int4(0, 0, 0, 0));
  if constexpr (kHasScales) {
    auto* scales = reinterpret_cast<uint32_t*>(static_cast<char*>(args.out_scales) +
                                               static_cast<size_t>(row) * args.scale_bytes);
    for (int i = lane; i < static_cast<int>(args.scale_bytes / 4); i += kWarpSize) {
      scales[i] = 0u;
    }
  }
  if (lane == 0) {
    args.pairs.out_pair_expert[row] = -1;
    args.pairs.out_pair_weight[row] = 0.0f;
    args.pairs.out_pair_src[row] = -1;
  }
}
template <bool kHasScales>
__device__ void zero_pair_padding(const HtContext& ctx, const HtDispatchArgs& args,
                                  const PairSmem& p, int received, int worker, int num_workers,
                                  int lane, bool padding_rows_taken) {
  const int El = ctx.dims.experts_per_rank, K = ctx.dims.num_topk;
  const int num_padding = padding_rows_taken ? 0 : p.pad_prefix[El + 1];
  int group = 0;
  for (int j = worker; j < num_padding; j += num_workers) {
    zero_pair_padding_row<kHasScales>(args, p, j, &group, lane);
  }
  for (int row = received + worker; row < args.capacity; row += num_workers) {
    if (lane < K) {
      args.pairs.out_slot_row[static_cast<size_t>(row) * K + lane] = -1;
      args.pairs.out_rows_by_expert[static_cast<size_t>(row) * K + lane] = -1;
    }
    if (lane == 0) args.out_recv_src[row] = -1;
  }
}

// One batch of a row (vectors base + u*32 + lane, as warp_load_batch loaded
// it) to each of the row's kept pair rows (lanes in `pairs` hold them in
// pair_row): loaded once, stored once per pair row. (Bulk stores through a
// shared staging slot were measured no faster: docs/benchmarks.md.)
template <int kUnroll>
__device__ __forceinline__ void store_to_pairs(const int4 (&batch)[kUnroll], int base,
                                               int num_vec, int lane, uint32_t pairs,
                                               int pair_row, char* out, size_t row_stride) {
  for (uint32_t left = pairs; left != 0u; left &= left - 1u) {
    const int at = __shfl_sync(0xffffffffu, pair_row, __ffs(left) - 1);
    warp_store_batch(reinterpret_cast<int4*>(out + static_cast<size_t>(at) * row_stride), batch,
                     base, num_vec, lane);
  }
}

// A row's scales (held as store_scale_words takes them) to each of its kept
// pair rows, as store_to_pairs does the row.
__device__ __forceinline__ void store_scales_to_pairs(const HtDispatchArgs& args,
                                                      const uint32_t (&words)[kScaleWordsPerLane],
                                                      const uint32_t* src, int num_words,
                                                      uint32_t pairs, int pair_row, int lane) {
  for (uint32_t left = pairs; left != 0u; left &= left - 1u) {
    const int at = __shfl_sync(0xffffffffu, pair_row, __ffs(left) - 1);
    store_scale_words(reinterpret_cast<uint32_t*>(static_cast<char*>(args.out_scales) +
                                                  static_cast<size_t>(at) * args.scale_bytes),
                      words, src, num_words, lane);
  }
}

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_DISPATCH_PAIRS_CUH_
