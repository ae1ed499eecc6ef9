// The HT dispatch's plan (ht_dispatch.cu; protocol steps 1-2 of
// docs/design.md, "HT protocol"): the send plan in shared memory, the count
// exchange, and at one rank each block's range plan; plus the row and scale
// helpers of the send role. Included by ht_dispatch.cu alone.
#ifndef JAX_EP_CUDA_HT_DISPATCH_PLAN_CUH_
#define JAX_EP_CUDA_HT_DISPATCH_PLAN_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_common.cuh"
#include "cuda/ht_pair_rank.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

// Exclusive prefix sum over the threads of the block, for each of the
// kHtMaxRanks per-thread values in `v` (in place); `totals` gets the sums.
// `s_warp` is shared scratch of [32][kHtMaxRanks]. All threads must call it.
__device__ __forceinline__ void block_exclusive_scan(int (&v)[kHtMaxRanks],
                                                     int (*s_warp)[kHtMaxRanks], int* totals) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  int inclusive[kHtMaxRanks];
#pragma unroll
  for (int r = 0; r < kHtMaxRanks; ++r) {
    inclusive[r] = v[r];
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive[r], offset);
      if (lane >= offset) inclusive[r] += other;
    }
    if (lane == kWarpSize - 1) s_warp[warp][r] = inclusive[r];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kHtMaxRanks; ++r) {
      const int own = lane < num_warps ? s_warp[lane][r] : 0;
      int running = own;
#pragma unroll
      for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, running, offset);
        if (lane >= offset) running += other;
      }
      if (lane < num_warps) s_warp[lane][r] = running - own;
      if (lane == kWarpSize - 1) totals[r] = running;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kHtMaxRanks; ++r) v[r] = inclusive[r] - v[r] + s_warp[warp][r];
}

// e / experts_per_rank without a division: __umulhi(e, ceil(2^32 / experts_per_rank))
// is exact while e * experts_per_rank < 2^32 (here E <= 8 * 1024).
struct ExpertRank {
  uint32_t magic;
  int experts_per_rank;
  __device__ __forceinline__ explicit ExpertRank(int per_rank)
      : magic(per_rank > 1 ? static_cast<uint32_t>((0x100000000ull + per_rank - 1) / per_rank)
                           : 0u),
        experts_per_rank(per_rank) {}
  __device__ __forceinline__ int operator()(int e) const {
    return experts_per_rank > 1 ? static_cast<int>(__umulhi(static_cast<uint32_t>(e), magic)) : e;
  }
};

// Rank bit of one top-k entry (0 for -1); counts entries outside [-1, E).
__device__ __forceinline__ uint32_t entry_rank_bit(int e, int num_experts,
                                                   const ExpertRank& rank_of, int* invalid) {
  if (e >= 0 && e < num_experts) return 1u << rank_of(e);
  if (e != -1) ++*invalid;
  return 0u;
}

// Bitmask of the ranks token t goes to (a token counts once per rank).
__device__ __forceinline__ uint32_t token_ranks(const int32_t* topk, int num_topk, int num_experts,
                                                const ExpertRank& rank_of, int* invalid) {
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    mask |= entry_rank_bit(topk[k], num_experts, rank_of, invalid);
  }
  return mask;
}

// Senders' dynamic shared memory: every token's rank mask (one byte: R <= 8)
// and, per tile of W = (send blocks x warps) consecutive tokens, this rank's
// rows for each destination before the tile. At most kHtMaxTokens tokens.
constexpr size_t kDispatchMaxSmem = 200 * 1024;

__host__ __device__ constexpr size_t dispatch_mask_bytes(int num_tokens) {
  return (static_cast<size_t>(num_tokens) + 15) / 16 * 16;
}
__host__ __device__ constexpr int dispatch_num_tiles(int num_tokens, int tile_tokens) {
  return (num_tokens + tile_tokens - 1) / tile_tokens;
}
// One rank: each block sends one contiguous range of ceil(T / G) tokens (G =
// grid), one tile per block.
__host__ __device__ constexpr int single_rank_tile_tokens(int num_tokens, int grid) {
  return num_tokens <= 0 ? 1 : (num_tokens + grid - 1) / grid;
}
__host__ __device__ constexpr size_t dispatch_smem_bytes(int num_tokens, int tile_tokens,
                                                         int num_ranks) {
  return dispatch_mask_bytes(num_tokens) +
         sizeof(int) * static_cast<size_t>(dispatch_num_tiles(num_tokens, tile_tokens)) * num_ranks;
}

// The count exchange, first half (block 0, threads < R, once s_total holds
// this rank's rows per destination): this rank's row of the count matrix to
// every rank, then its notify flag (st.release.sys, after the block barrier
// that followed the zeroing of tokens_per_expert, which the flag thus covers).
// Expert-major: first every thread of block 0 writes this rank's tokens per
// local expert of each rank r (the pair plan's totals) into r's
// expert_counts[p][me][*], ordered before the flag by the block barrier.
// Every thread of block 0 calls it.
template <bool kExpertMajor>
__device__ __forceinline__ void publish_counts(const HtContext& ctx, uint32_t seq,
                                               const int* s_total) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  if (blockIdx.x != 0) return;
  if constexpr (kExpertMajor) {
    const int El = d.experts_per_rank;
    int32_t* rows = ctx.buffers.expert_counts + (seq & 1) * R * El + d.rank * El;
    for (int i = threadIdx.x; i < R * El; i += blockDim.x) {
      const int r = i / El;
      static_cast<int32_t*>(transport::peer_ptr(rows, r))[i - r * El] =
          ctx.buffers.plan_expert_totals[i];
    }
    __syncthreads();
  }
  if (static_cast<int>(threadIdx.x) >= R) return;
  int32_t* counts = ctx.buffers.counts + (seq & 1) * R * R;
  uint64_t* notify_flags = ctx.buffers.notify_flags + (seq & 1) * R;
  const int r = threadIdx.x;
  auto* row = static_cast<int32_t*>(transport::peer_ptr(counts + d.rank * R, r));
  for (int j = 0; j < R; ++j) row[j] = s_total[j];
  auto* flag = static_cast<uint64_t*>(transport::peer_ptr(notify_flags + d.rank, r));
  __threadfence_system();
  st_release_sys(flag, make_flag(seq, 1));
}

// The count exchange, second half (every block): waits for every rank's
// notify flag, its own rank's included, and reads the matrix. Leaves in shared
// memory: s_prefix[s] (first row of source s here, [R] = received) and
// s_row_offset[r] (first row of this rank's tokens on r).
__device__ void receive_counts(const HtContext& ctx, uint32_t seq, int (*s_matrix)[kHtMaxRanks],
                               int* s_prefix, int* s_row_offset) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const int32_t* counts = ctx.buffers.counts + (seq & 1) * R * R;
  const uint64_t* notify_flags = ctx.buffers.notify_flags + (seq & 1) * R;
  if (threadIdx.x < R) {
    const int s = threadIdx.x;
    const uint32_t got = wait_flag(notify_flags + s, seq, ctx.timeout_ns, ctx.status,
                                   kOpHtNotify, s, 0);
    for (int j = 0; j < R; ++j) {
      s_matrix[s][j] = (got == kFlagTimedOut) ? 0 : ld_volatile_u32(
          reinterpret_cast<const uint32_t*>(counts + s * R + j));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int prefix = 0;
    for (int s = 0; s < R; ++s) {
      s_prefix[s] = prefix;
      prefix += s_matrix[s][d.rank];
    }
    s_prefix[R] = prefix;
    for (int r = 0; r < R; ++r) {
      int offset = 0;
      for (int s = 0; s < d.rank; ++s) offset += s_matrix[s][r];
      s_row_offset[r] = offset;
    }
  }
  __syncthreads();
}

// Tokens per thread and batch of mask loads (all in flight at once).
constexpr int kMaskBatch = 8;

// A sender block's first step: every token's rank mask into s_mask (one
// thread per token, a batch of tokens' 16-byte top-k loads in flight per
// thread, no atomics), then s_tile_base[k][r]: rows this rank sends to r from
// tokens before tile k, and s_total[r]: all of them (the row of the count
// matrix). Rows land in token order, so a token's row on rank r is the tile's
// base plus its earlier tokens in the tile going to r.
// Returns the block's count of top-k entries outside [-1, E).
template <bool kExpertMajor>
__device__ int build_send_plan(const HtContext& ctx, const HtDispatchArgs& args, uint32_t seq,
                               uint8_t* s_mask, int* s_tile_base, int tile_tokens,
                               int (*s_warp)[kHtMaxRanks], int* s_total) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const int T = args.num_tokens;
  const int K = d.num_topk;
  const ExpertRank rank_of(d.experts_per_rank);
  int invalid = 0;
  auto four_bits = [&](const int4& four) {
    return entry_rank_bit(four.x, d.num_experts, rank_of, &invalid) |
           entry_rank_bit(four.y, d.num_experts, rank_of, &invalid) |
           entry_rank_bit(four.z, d.num_experts, rank_of, &invalid) |
           entry_rank_bit(four.w, d.num_experts, rank_of, &invalid);
  };
  if (K % 4 == 0 && reinterpret_cast<uintptr_t>(args.topk_idx) % 16 == 0) {
    // Up to two 16-byte loads per token (K <= 8) in the first round.
    const int4* entries = reinterpret_cast<const int4*>(args.topk_idx);
    const int vec_per_token = K / 4;
    const int4 none = make_int4(-1, -1, -1, -1);
    for (int first = threadIdx.x; first < T; first += kMaskBatch * blockDim.x) {
      int4 lo[kMaskBatch], hi[kMaskBatch];
#pragma unroll
      for (int u = 0; u < kMaskBatch; ++u) {
        const int t = first + u * static_cast<int>(blockDim.x);
        lo[u] = t < T ? __ldg(entries + t * vec_per_token) : none;
        hi[u] = t < T && vec_per_token > 1 ? __ldg(entries + t * vec_per_token + 1) : none;
      }
#pragma unroll
      for (int u = 0; u < kMaskBatch; ++u) {
        const int t = first + u * static_cast<int>(blockDim.x);
        if (t >= T) continue;
        uint32_t mask = four_bits(lo[u]) | four_bits(hi[u]);
        for (int v = 2; v < vec_per_token; ++v) {
          mask |= four_bits(__ldg(entries + t * vec_per_token + v));
        }
        s_mask[t] = static_cast<uint8_t>(mask);
      }
    }
  } else {
    for (int t = threadIdx.x; t < T; t += blockDim.x) {
      s_mask[t] = static_cast<uint8_t>(
          token_ranks(args.topk_idx + t * K, K, d.num_experts, rank_of, &invalid));
    }
  }
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0) ht_trace(ctx, seq, kTraceMasks);
  // A contiguous range of tokens per thread: an exclusive scan over the
  // threads gives each range's first row per rank, then the walk over the
  // range stamps the bases of the tiles that start in it.
  const int per_thread = (T + blockDim.x - 1) / blockDim.x;
  const int t0 = min(T, static_cast<int>(threadIdx.x) * per_thread);
  const int t1 = min(T, t0 + per_thread);
  int running[kHtMaxRanks] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int t = t0; t < t1; ++t) {
    const uint32_t mask = s_mask[t];
#pragma unroll
    for (int r = 0; r < kHtMaxRanks; ++r) running[r] += (mask >> r) & 1u;
  }
  block_exclusive_scan(running, s_warp, s_total);
  if (blockIdx.x == 0 && threadIdx.x == 0) ht_trace(ctx, seq, kTraceScan);
  publish_counts<kExpertMajor>(ctx, seq, s_total);  // block 0: before the tile walk
  for (int t = t0; t < t1; ++t) {
    const uint32_t mask = s_mask[t];
    if (t % tile_tokens == 0) {
#pragma unroll
      for (int r = 0; r < kHtMaxRanks; ++r) {
        if (r < R) s_tile_base[(t / tile_tokens) * R + r] = running[r];
      }
    }
#pragma unroll
    for (int r = 0; r < kHtMaxRanks; ++r) running[r] += (mask >> r) & 1u;
  }
  __syncthreads();
  return invalid;
}

// In-place exclusive prefix sum of values[0, n) in shared memory, by warp 0
// (a contiguous run per lane); *total gets the sum. All threads call it.
__device__ void shared_exclusive_scan(int* values, int n, int* total) {
  __syncthreads();
  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    const int per_lane = (n + kWarpSize - 1) / kWarpSize;
    const int lo = min(n, lane * per_lane), hi = min(n, lo + per_lane);
    int sum = 0;
    for (int i = lo; i < hi; ++i) sum += values[i];
    int inclusive = sum;
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += other;
    }
    int running = inclusive - sum;
    for (int i = lo; i < hi; ++i) {
      const int v = values[i];
      values[i] = running;
      running += v;
    }
    if (lane == kWarpSize - 1) *total = inclusive;
  }
  __syncthreads();
}

// The one-rank expert-major dispatch's pair plan, in dynamic shared memory
// after the pair placement (PairSmem): running [E] (the block's pairs per
// expert, counted by rank_pair_range from 0), totals [E] (every block's pairs
// per expert, after the wait), bits [E][words] (a sub-tile of
// rank_pair_range). Unused (null) elsewhere.
struct OneRankPairPlan {
  int* running;
  int* totals;
  uint32_t* bits;
  int words;
};
__host__ __device__ constexpr size_t one_rank_pair_plan_bytes(int num_experts, int words) {
  return sizeof(int) * static_cast<size_t>(num_experts) * (2 + static_cast<size_t>(words));
}

// plan_token_slot[t] for the tokens t of [lo, hi): t's index among the
// range's tokens with s_mask[t] != 0 (in token order), -1 for the others. All
// threads call it; it ends on a barrier.
__device__ void write_token_slots(const uint8_t* s_mask, int lo, int hi, int32_t* token_slot) {
  __shared__ int s_warp_routed[kWarps];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  int running = 0;  // the range's routed tokens before `first` (every thread)
  for (int first = lo; first < hi; first += blockDim.x) {  // block-uniform
    const int t = first + static_cast<int>(threadIdx.x);
    const bool routed = t < hi && s_mask[t] != 0u;
    const uint32_t ballot = __ballot_sync(0xffffffffu, routed);
    if (lane == 0) s_warp_routed[warp] = __popc(ballot);
    __syncthreads();
    int before = running + __popc(ballot & ((1u << lane) - 1u));
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += s_warp_routed[w];
      running += s_warp_routed[w];
    }
    if (t < hi) token_slot[t] = routed ? before : -1;
    __syncthreads();  // s_warp_routed is rewritten by the next step
  }
  __syncthreads();  // an empty range: still a barrier
}

// One rank's send plan and count exchange, in place of build_send_plan and
// the R x R count exchange (every row is this rank's own): block b masks the
// tokens of its own range [lo, lo + L), L = single_rank_tile_tokens, in
// s_mask (1: the token has a valid expert), publishes its count of them as
// ht_block_rows[b] = (seq, count) (st.release.gpu, after the barrier that
// follows block 0's zeroing of tokens_per_expert and num_invalid), and waits
// (bounded) for every block's word of this seq: block j's first row (the
// counts of the blocks before it) in s_tile_base[j], for every j, and the
// total (s_prefix). No parity:
// the next dispatch's kernel starts after this one ended (stream order).
// Each block adds the out-of-range top-k entries of its range to num_invalid.
// A timed-out wait counts that block as 0 rows (the fault is recorded).
// Expert-major (kExpertMajor), in place of the pair plan's kernels: block b
// also ranks its range's pairs among the range's own tokens into
// plan_pair_rank (rank_pair_range, from 0: before the wait, which then holds
// only what needs the other blocks), and writes its pairs per expert to
// plan_block_counts[b][*], each routed token's index among the range's routed
// tokens to plan_token_slot (write_token_slots) and, block 0, ht_work_next =
// (seq, 0), all before its word (the block barrier, then the release); once
// it holds every block's word it sums the columns: the blocks before b into
// plan_block_before[b][*], then (block barrier, st.release.gpu)
// ht_range_ready[b] = (seq, 0); all of them into pair.totals. Every warp of
// every block may then take tokens of b's range (dispatch_send_role). A
// timed-out word leaves that block's counts of an earlier call in the sums
// (zero before the first call): non-negative, so every pair row stays in
// [0, M) or is dropped (place_pairs).
// All threads must call it.
template <bool kExpertMajor>
__device__ void single_rank_plan(const HtContext& ctx, const HtDispatchArgs& args, uint32_t seq,
                                 uint8_t* s_mask, int* s_tile_base, int tile_tokens,
                                 int* s_prefix, int* s_row_offset, const OneRankPairPlan& pair) {
  __shared__ int s_count, s_total, s_invalid_here;
  const EpDims d = ctx.dims;
  const int T = args.num_tokens;
  const int K = d.num_topk;
  const int E = d.num_experts;  // = experts_per_rank at one rank
  const int lo = min(T, static_cast<int>(blockIdx.x) * tile_tokens);
  const int hi = min(T, lo + tile_tokens);
  const ExpertRank rank_of(d.experts_per_rank);
  if (threadIdx.x == 0) s_count = s_invalid_here = 0;
  if constexpr (kExpertMajor) {
    for (int e = threadIdx.x; e < E; e += blockDim.x) pair.running[e] = 0;
  }
  __syncthreads();
  int invalid = 0, routed = 0;
  const bool vector_idx = K % 4 == 0 && reinterpret_cast<uintptr_t>(args.topk_idx) % 16 == 0;
  for (int t = lo + threadIdx.x; t < hi; t += blockDim.x) {
    uint32_t mask = 0;
    if (vector_idx) {
      const int4* entries = reinterpret_cast<const int4*>(args.topk_idx) + t * (K / 4);
      for (int v = 0; v < K / 4; ++v) {
        const int4 four = __ldg(entries + v);
        mask |= entry_rank_bit(four.x, d.num_experts, rank_of, &invalid) |
                entry_rank_bit(four.y, d.num_experts, rank_of, &invalid) |
                entry_rank_bit(four.z, d.num_experts, rank_of, &invalid) |
                entry_rank_bit(four.w, d.num_experts, rank_of, &invalid);
      }
    } else {
      mask = token_ranks(args.topk_idx + t * K, K, d.num_experts, rank_of, &invalid);
    }
    s_mask[t] = static_cast<uint8_t>(mask);
    routed += mask != 0u ? 1 : 0;
  }
  routed = __reduce_add_sync(0xffffffffu, routed);
  invalid = __reduce_add_sync(0xffffffffu, invalid);
  if (threadIdx.x % kWarpSize == 0) {
    if (routed) atomicAdd(&s_count, routed);
    if (invalid) atomicAdd(&s_invalid_here, invalid);
  }
  __syncthreads();  // s_mask, s_count, pair.running; block 0: the zeroing before it
  if constexpr (kExpertMajor) {
    // The range's pairs ranked among the range's own tokens (running from 0:
    // nothing here waits for another block); on return pair.running holds
    // the range's pairs per expert. The blocks before this one come in
    // through plan_block_before once their counts are in.
    rank_pair_range(args.topk_idx, lo, hi, K, E, pair.words, pair.running, pair.bits,
                    ctx.buffers.plan_pair_rank);
    __syncthreads();  // an empty range returns without a barrier
    int32_t* row = ctx.buffers.plan_block_counts + static_cast<size_t>(blockIdx.x) * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) row[e] = pair.running[e];
    write_token_slots(s_mask, lo, hi, ctx.buffers.plan_token_slot);  // ends on a barrier
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      // Before block 0's word below (same thread, then the release): a warp
      // takes its first item only after it holds every block's word.
      ctx.counters->ht_work_next = make_flag(seq, 0u);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) ht_trace(ctx, seq, kTraceMasks);
  if (threadIdx.x == 0) {
    st_release_gpu(ctx.counters->ht_block_rows + blockIdx.x,
                   make_flag(seq, static_cast<uint32_t>(s_count)));
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    ht_trace(ctx, seq, kTraceScan);  // no scan at one rank: the block's count is out
    ht_trace(ctx, seq, kTracePlanBuilt);
  }
  // Every block's count, then their exclusive scan: s_tile_base[j] is block
  // j's first row (the expert-major warps take tokens of every range).
  const int num_blocks = static_cast<int>(gridDim.x);
  for (int j = threadIdx.x; j < num_blocks; j += blockDim.x) {
    const uint32_t got = wait_flag(ctx.counters->ht_block_rows + j, seq, ctx.timeout_ns,
                                   ctx.status, kOpHtNotify, d.rank, j, /*gpu_scope=*/true);
    s_tile_base[j] = got == kFlagTimedOut ? 0 : static_cast<int>(got);
  }
  shared_exclusive_scan(s_tile_base, num_blocks, &s_total);  // barriers before and after
  if (threadIdx.x == 0) {
    s_prefix[0] = 0;
    s_prefix[1] = s_total;
    s_row_offset[0] = 0;
    if (s_invalid_here) atomicAdd(args.out_num_invalid, s_invalid_here);
  }
  if constexpr (kExpertMajor) {
    // The columns of plan_block_counts (written in this kernel by the blocks
    // whose words were acquired above: volatile loads, not the L1), up to
    // kColumnLoads loads in flight per step (one step at 24 SMs: this sits
    // between the wait and the first row store). The blocks before this one
    // go to plan_block_before[b] (then its ht_range_ready word), all of them
    // into pair.totals.
    constexpr int kColumnLoads = 24;
    const int me = static_cast<int>(blockIdx.x);
    int32_t* before_row = ctx.buffers.plan_block_before + static_cast<size_t>(me) * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const uint32_t* column =
          reinterpret_cast<const uint32_t*>(ctx.buffers.plan_block_counts + e);
      int before = 0, all = 0;
      for (int other = 0; other < num_blocks; other += kColumnLoads) {
        int part[kColumnLoads];
#pragma unroll
        for (int i = 0; i < kColumnLoads; ++i) {
          const size_t row = static_cast<size_t>(other + i) * E;
          part[i] = other + i < num_blocks ? static_cast<int>(ld_volatile_u32(column + row)) : 0;
        }
#pragma unroll
        for (int i = 0; i < kColumnLoads; ++i) {
          all += part[i];
          if (other + i < me) before += part[i];
        }
      }
      before_row[e] = before;
      pair.totals[e] = all;
    }
  }
  __syncthreads();
  if (kExpertMajor && threadIdx.x == 0) {
    st_release_gpu(ctx.counters->ht_range_ready + blockIdx.x, make_flag(seq, 0u));
  }
}

// Token t's row on each rank (lane r < R; -1 where it does not go or lands
// past the capacity): its tile's base plus the tile's earlier tokens that go
// to r (ballots over their masks), on top of this rank's first row there.
__device__ __forceinline__ int token_row(const uint8_t* s_mask, const int* s_tile_base,
                                         const int* s_row_offset, int t, int tile_tokens, int R,
                                         int capacity, int lane) {
  const int tile_first = t - t % tile_tokens;
  int before = 0;
  for (int base = tile_first; base < t; base += kWarpSize) {
    const int other = base + lane;
    const uint32_t mask = other < t ? s_mask[other] : 0u;
    for (int r = 0; r < R; ++r) {
      const int count = __popc(__ballot_sync(0xffffffffu, (mask >> r) & 1u));
      if (lane == r) before += count;
    }
  }
  if (lane >= R || ((s_mask[t] >> lane) & 1u) == 0u) return -1;
  const int row = s_row_offset[lane] + s_tile_base[(t / tile_tokens) * R + lane] + before;
  return row < capacity ? row : -1;
}

// Counts each local expert of a row once (first occurrence among the lanes
// < num_topk holding it); `local` is the lane's local expert or -1.
__device__ __forceinline__ void count_row_experts(int local, int num_topk, int* s_tpe, int lane) {
  bool first = local >= 0;
  for (int j = 0; j < num_topk; ++j) {
    const int other = __shfl_sync(0xffffffffu, local, j);
    if (j < lane && other == local) first = false;
  }
  if (first && local < kHtMaxExpertsPerRank) atomicAdd(&s_tpe[local], 1);
}

// Scale words per lane a role keeps in registers (H <= 16384 at one float32
// scale per 128 channels); words past that are copied directly.
constexpr int kScaleWordsPerLane = 4;

// Scales of one row: the lane's words, loaded (all in flight) ...
__device__ __forceinline__ void load_scale_words(uint32_t (&words)[kScaleWordsPerLane],
                                                 const uint32_t* src, int num_words, int lane) {
#pragma unroll
  for (int u = 0; u < kScaleWordsPerLane; ++u) {
    const int i = lane + u * kWarpSize;
    words[u] = i < num_words ? src[i] : 0u;
  }
}
// ... and stored; `src` again for the words past kScaleWordsPerLane per lane.
__device__ __forceinline__ void store_scale_words(uint32_t* dst,
                                                  const uint32_t (&words)[kScaleWordsPerLane],
                                                  const uint32_t* src, int num_words, int lane) {
#pragma unroll
  for (int u = 0; u < kScaleWordsPerLane; ++u) {
    const int i = lane + u * kWarpSize;
    if (i < num_words) dst[i] = words[u];
  }
  for (int i = lane + kScaleWordsPerLane * kWarpSize; i < num_words; i += kWarpSize) {
    dst[i] = src[i];
  }
}

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_DISPATCH_PLAN_CUH_
