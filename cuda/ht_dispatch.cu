// HT dispatch over NVLink (R <= kHtMaxRanks): one kernel, ht_dispatch, whose
// first blocks send and last third receive (at one rank every block sends).
// The protocol in full, with its one-rank and expert-major variants and the
// reasons: docs/design.md, "HT protocol"; tests/cpu/protocol_model.py models
// it. In short (seq: the call's sequence number, the same on every rank;
// p = seq parity; flags are (seq << 32 | value) words, never reset; buffers:
// ht_types.h):
//   1. Each sender block plans in shared memory: every token's rank mask and
//      this rank's rows per destination before each tile.
//   2. Block 0 writes this rank's counts into every rank's counts[p][me][*],
//      then notify_flags[p][me] (st.release.sys); every block waits (bounded)
//      for every rank's flag and reads the R x R count matrix.
//   3. Senders (a warp per token) store each row, its scales, source and top-k
//      to its final row in each peer's recv_* buffers, then fence
//      (fence.acq_rel.sys) and add the rows to the peer's chunk_arrived[me][c]
//      (red.relaxed.sys). Rows for this rank go straight to the outputs.
//   4. Receivers take chunks by ticket, wait (bounded) until chunk_arrived[s][c]
//      holds the chunk's rows, reset it to 0 and copy the rows out; the last
//      block writes num_tokens and resets the ticket.
// Reuse: counts and notify_flags alternate by parity; a peer rewrites
// recv_* and chunk_arrived only after this rank's next notify flag, sent
// after this kernel ended (stream order). Faults: a timed-out wait records
// the fault (device_common.cuh); the outputs then read -1.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_common.cuh"
#include "cuda/ht_dispatch_pairs.cuh"
#include "cuda/ht_dispatch_plan.cuh"
#include "cuda/ht_dispatch_roles.cuh"
#include "cuda/ht_pair_rank.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

// kExpertMajor: pairs.num_rows > 0 (HtPairArgs); the dynamic shared memory
// holds the pair placement (PairSmem) after the send plan, at `pair_offset`,
// and at one rank the pair plan (OneRankPairPlan, sub-tiles of `pair_words`
// words) after that, at `plan_offset`.
template <bool kHasScales, bool kSingleRank, bool kExpertMajor>
__global__ void __launch_bounds__(kThreads, 1)
    ht_dispatch(HtContext ctx, HtDispatchArgs args, int num_send_blocks, int pair_offset,
                int plan_offset, int pair_words) {
  extern __shared__ __align__(16) uint8_t s_send_plan[];  // senders: dispatch_smem_bytes()
  __shared__ int s_prefix[kHtMaxRanks + 1];
  __shared__ int s_row_offset[kHtMaxRanks];
  __shared__ int s_tpe[kHtMaxExpertsPerRank];
  __shared__ int s_warp[kWarpSize][kHtMaxRanks];  // scan scratch
  __shared__ int s_total[kHtMaxRanks];
  __shared__ int s_matrix[kHtMaxRanks][kHtMaxRanks];
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  ht_profile_start(ctx, kProfCounts);
  ht_profile_start(ctx, kProfDispatchSend);
  ht_profile_start(ctx, kProfDispatchRecv);
  if (blockIdx.x == 0 && threadIdx.x == 0) ht_trace(ctx, seq, kTraceStart);
  // With a single block, it sends first and then receives; so does every block
  // when all of them send (one rank: no rows arrive from peers, and receiver
  // blocks would only zero-fill the padding; each block does its share).
  const bool both_roles = gridDim.x == 1 || num_send_blocks == static_cast<int>(gridDim.x);
  const bool sender = both_roles || static_cast<int>(blockIdx.x) < num_send_blocks;
  const bool receiver = both_roles || static_cast<int>(blockIdx.x) >= num_send_blocks;
  const int tile_tokens = num_send_blocks * kWarps;
  uint8_t* s_mask = s_send_plan;
  int* s_tile_base = reinterpret_cast<int*>(s_send_plan + dispatch_mask_bytes(args.num_tokens));
  const PairSmem pair = pair_smem(s_send_plan + pair_offset, d.num_ranks, d.experts_per_rank);
  OneRankPairPlan one_rank_plan{nullptr, nullptr, nullptr, pair_words};
  if constexpr (kSingleRank && kExpertMajor) {
    one_rank_plan.running = reinterpret_cast<int*>(s_send_plan + plan_offset);
    one_rank_plan.totals = one_rank_plan.running + d.num_experts;
    one_rank_plan.bits = reinterpret_cast<uint32_t*>(one_rank_plan.totals + d.num_experts);
  }
  if (threadIdx.x == 0) s_invalid = 0;
  for (int e = threadIdx.x; e < d.experts_per_rank && e < kHtMaxExpertsPerRank; e += blockDim.x) {
    s_tpe[e] = 0;
  }
  // Expert-major: block 0 writes tokens_per_expert once the counts are in (place_groups).
  if (!kExpertMajor && blockIdx.x == 0) {  // before block 0 publishes its counts (publish_counts)
    for (int e = threadIdx.x; e < d.experts_per_rank; e += blockDim.x) {
      args.out_tokens_per_expert[e] = 0;
    }
  }
  if (kSingleRank && blockIdx.x == 0 && threadIdx.x == 0) *args.out_num_invalid = 0;
  __syncthreads();
  uint64_t plan_built = 0;
  if constexpr (kSingleRank) {
    plan_built = ctx.profile != nullptr ? global_timer_ns() : 0;
    single_rank_plan<kExpertMajor>(ctx, args, seq, s_mask, s_tile_base,
                                   single_rank_tile_tokens(args.num_tokens, num_send_blocks),
                                   s_prefix, s_row_offset, one_rank_plan);
  } else {
    if (sender) {
      const int invalid = build_send_plan<kExpertMajor>(ctx, args, seq, s_mask, s_tile_base,
                                                        tile_tokens, s_warp, s_total);
      if (invalid) atomicAdd(&s_invalid, invalid);
    }
    plan_built = ctx.profile != nullptr ? global_timer_ns() : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) ht_trace(ctx, seq, kTracePlanBuilt, plan_built);
    receive_counts(ctx, seq, s_matrix, s_prefix, s_row_offset);
    if (blockIdx.x == 0 && threadIdx.x == 0) *args.out_num_invalid = s_invalid;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (ctx.profile != nullptr) {
      const uint64_t now = global_timer_ns();
      ht_trace(ctx, seq, kTraceCounts, now);
      ht_profile_wait(ctx, kProfCounts, now - plan_built);
      ctx.profile->role_end[kProfCounts] = now;
    }
  }
  if constexpr (kExpertMajor) {
    place_groups<kSingleRank>(ctx, args, seq, pair, one_rank_plan.totals);
  }
  const int received = s_prefix[d.num_ranks];
  const int kept = min(received, args.capacity);
  uint64_t waited_ns = 0;  // thread 0 of a receiver block (profiling)
  if (sender) {
    dispatch_send_role<kHasScales, kSingleRank, kExpertMajor>(
        ctx, args, seq, blockIdx.x, num_send_blocks, s_tpe, s_row_offset, s_mask, s_tile_base,
        pair);
    __syncthreads();
    ht_profile_role_end(ctx, kProfDispatchSend);
  }
  const int num_recv_blocks = both_roles ? gridDim.x : gridDim.x - num_send_blocks;
  if (receiver) {
    const int recv_block = both_roles ? blockIdx.x : blockIdx.x - num_send_blocks;
    waited_ns = dispatch_recv_role<kHasScales, kExpertMajor>(ctx, args, recv_block,
                                                             num_recv_blocks, s_tpe, s_prefix,
                                                             kept, pair);
  } else {
    // Done sending: help copy out the last chunks (measured 9 us off the
    // BF16 dispatch's tail, 2026-11-30).
    dispatch_recv_role<kHasScales, kExpertMajor>(ctx, args, -1, num_recv_blocks, s_tpe, s_prefix,
                                                 kept, pair);
  }
  __syncthreads();
  if (receiver) {
    ht_profile_wait(ctx, kProfDispatchRecv, waited_ns);
    ht_profile_role_end(ctx, kProfDispatchRecv);
  }
  // tokens_per_expert was zeroed before the notify flag this block acquired.
  for (int e = threadIdx.x; !kExpertMajor && e < d.experts_per_rank && e < kHtMaxExpertsPerRank;
       e += blockDim.x) {
    if (s_tpe[e]) atomicAdd(args.out_tokens_per_expert + e, s_tpe[e]);
  }
  // One rank, unprofiled: no last block. No rows come from peers (no chunk
  // tickets) and no peer can be out of step, so block 0 runs the epilogue
  // alone, and every block's adds to tokens_per_expert land before the kernel
  // ends. A fault recorded before the call does not void it: the next
  // execution fails on it in the prepare stage (as the one-rank LL ops).
  const bool block0_alone = kSingleRank && ctx.profile == nullptr;
  if (runs_epilogue(&ctx.counters->ht_dispatch_done, block0_alone)) {
    // After a fault (a wait of this call or an earlier one gave up) the rows
    // are incomplete: counts that cannot be real say so, and the combine
    // sends nothing for them. Every block's adds to tokens_per_expert came
    // before its arrival, so these writes are the last.
    const bool faulted = !block0_alone && fault_recorded(ctx.status);
    *args.out_num_tokens = faulted ? -1 : kept;
    // Expert-major: block 0 wrote the pair counts (place_groups), before its arrival.
    if (!kExpertMajor || faulted) *args.out_num_dropped = faulted ? -1 : received - kept;
    if (faulted) {
      for (int e = 0; e < d.experts_per_rank; ++e) args.out_tokens_per_expert[e] = -1;
      if constexpr (kExpertMajor) {
        *args.pairs.out_num_pairs = -1;
        for (int e = 0; e < d.experts_per_rank; ++e) args.pairs.out_group_sizes[e] = 0;
      }
    }
    ctx.counters->ht_dispatch_seq = seq;
    ctx.counters->ht_recv_ticket = 0u;  // every block has taken its last ticket (if any)
    if (ctx.profile != nullptr) {
      ht_trace(ctx, seq, kTraceSendEnd, ctx.profile->role_end[kProfDispatchSend]);
      ht_trace(ctx, seq, kTraceRecvEnd, ctx.profile->role_end[kProfDispatchRecv]);
      ht_trace(ctx, seq, kTraceEnd);
    }
    ht_profile_close(ctx, kProfCounts);
    ht_profile_close(ctx, kProfDispatchSend);
    ht_profile_close(ctx, kProfDispatchRecv);
  }
}

}  // namespace

cudaError_t LaunchHtDispatch(const HtContext& ctx, const HtDispatchArgs& args,
                             cudaStream_t stream) {
  // One SM budget for both roles: about a third of the blocks receive.
  // ctx.recv_divisor (3; JAX_EP_HT_RECV_DIVISOR, an experiment) sets the
  // share of receiver blocks: grid / divisor. With one rank every row is this
  // rank's own, stored by its sender straight into the outputs: nothing is
  // received, so every block sends (16 of 24 blocks copied at EP1 before).
  const bool single_rank = ctx.dims.num_ranks == 1;
  const bool expert_major = args.pairs.num_rows > 0;
  // One rank, expert-major: each block writes its row of plan_block_counts
  // (HtPlanBlockRows rows).
  const int grid = single_rank && expert_major
                       ? std::max(1, std::min(ctx.num_sms, kHtOneRankPlanBlocks))
                       : std::max(1, ctx.num_sms);
  const int num_send_blocks =
      grid == 1 || ctx.dims.num_ranks == 1
          ? grid
          : grid - std::max(1, grid / std::max(2, ctx.recv_divisor));
  const size_t plan_smem =
      single_rank ? dispatch_mask_bytes(args.num_tokens) + sizeof(int) * grid  // a base per block
                  : dispatch_smem_bytes(args.num_tokens, num_send_blocks * kWarps,
                                        ctx.dims.num_ranks);
  const size_t pair_offset = (plan_smem + 15) / 16 * 16;
  size_t smem =
      expert_major ? pair_offset + pair_smem_bytes(ctx.dims.num_ranks, ctx.dims.experts_per_rank)
                   : plan_smem;
  // One rank, expert-major: the pair plan's scratch, with sub-tiles as wide
  // as the room left allows (at most kPairRankMaxWords words, no wider than
  // a block's range).
  size_t plan_offset = 0;
  int pair_words = 0;
  if (single_rank && expert_major) {
    const int E = std::max(ctx.dims.num_experts, 1);
    plan_offset = (smem + 15) / 16 * 16;
    const size_t fixed = plan_offset + one_rank_pair_plan_bytes(E, 0);
    const int max_words =
        fixed < kDispatchMaxSmem ? static_cast<int>((kDispatchMaxSmem - fixed) / (sizeof(int) * E))
                                 : 0;
    const int range = single_rank_tile_tokens(args.num_tokens, grid);
    pair_words = std::max(1, std::min({kPairRankMaxWords, max_words,
                                       (range + kPairRankWordBits - 1) / kPairRankWordBits}));
    smem = plan_offset + one_rank_pair_plan_bytes(E, pair_words);
  }
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.experts_per_rank > kHtMaxExpertsPerRank ||
      (single_rank && grid > kMaxHtBlocks) ||
      args.row_bytes % 16 != 0 || args.row_bytes > ctx.buffers.row_bytes ||
      ctx.dims.num_topk > kWarpSize || args.num_tokens > kHtMaxTokens ||
      smem > kDispatchMaxSmem ||
      (expert_major &&
       (args.pairs.alignment < 1 || args.capacity < ctx.dims.num_ranks * args.num_tokens))) {
    return cudaErrorInvalidValue;
  }
  using Kernel = void (*)(HtContext, HtDispatchArgs, int, int, int, int);
  static constexpr Kernel kKernels[2][2][2] = {  // [scales][single rank][expert-major]
      {{ht_dispatch<false, false, false>, ht_dispatch<false, false, true>},
       {ht_dispatch<false, true, false>, ht_dispatch<false, true, true>}},
      {{ht_dispatch<true, false, false>, ht_dispatch<true, false, true>},
       {ht_dispatch<true, true, false>, ht_dispatch<true, true, true>}}};
  const Kernel kernel = kKernels[args.scales != nullptr][single_rank][expert_major];
  kernel<<<grid, kThreads, smem, stream>>>(ctx, args, num_send_blocks,
                                           static_cast<int>(pair_offset),
                                           static_cast<int>(plan_offset), pair_words);
  return cudaGetLastError();
}

cudaError_t PrepareHtDispatchKernels() {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaSuccess;
  for (const void* kernel : {reinterpret_cast<const void*>(ht_dispatch<true, false, false>),
                             reinterpret_cast<const void*>(ht_dispatch<false, false, false>),
                             reinterpret_cast<const void*>(ht_dispatch<true, true, false>),
                             reinterpret_cast<const void*>(ht_dispatch<false, true, false>),
                             reinterpret_cast<const void*>(ht_dispatch<true, false, true>),
                             reinterpret_cast<const void*>(ht_dispatch<false, false, true>),
                             reinterpret_cast<const void*>(ht_dispatch<true, true, true>),
                             reinterpret_cast<const void*>(ht_dispatch<false, true, true>)}) {
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(kDispatchMaxSmem));
    }
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
