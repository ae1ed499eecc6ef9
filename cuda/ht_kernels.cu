// High-throughput (HT) dispatch and combine over NVLink (R <= 8 ranks).
//
// PROTOCOL (seq = the op's call sequence number, the same on every rank; flags
// are (seq << 32 | value) words, never reset; buffers in ht_types.h)
//
// dispatch = one kernel, ht_dispatch (num_sms blocks, all resident at once;
// the first ones send, the last third receive; with one rank, or one block,
// every block sends and then does its share of the receive role):
//   1. Send plan (each sender block, in shared memory): every token's rank
//      mask (one byte; a token counts once per rank) and this rank's rows per
//      destination before each tile of W = send blocks x warps tokens (an
//      exclusive scan over the tokens, in token order).
//   2. Count exchange: block 0 zeroes tokens_per_expert, writes this rank's
//      totals into every rank's counts[p][me][*] and then sets
//      notify_flags[p][me] there (st.release.sys), p = seq parity. Every block
//      waits for every rank's flag (its own included, which orders the zeroing
//      before its adds) and reads the R x R matrix: on receiver r, source s's
//      rows start at sum_{s'<s} counts[s'][r], in source token order; rows at
//      or past the capacity are dropped (send_row = -1).
//   3. Senders: one warp per token (tokens t = warp + k*W). Token t's row on
//      rank r = r's first row for this rank + its tile's base + the tile's
//      earlier tokens for r (ballots over the masks). The warp loads the row
//      once (16-byte loads) and stores it, with its scales, source token index
//      and top-k (rewritten to the receiver's local experts), straight to its
//      final row in each peer's recv_* buffers; rows for this rank itself go
//      straight into the XLA outputs (no second copy). It writes send_row[t].
//      Every publish_tokens() tokens and after its last: __syncwarp, then lane
//      r fences (fence.acq_rel.sys) and adds each held row to peer r's
//      chunk_arrived[me][c] (red.relaxed.sys), c = (row - r's first row for
//      this rank) / kHtChunkRows.
//   4. Receivers, and senders once done: take chunks of rows from other
//      sources below the capacity in (source, chunk) order from a ticket
//      counter (ht_recv_ticket); one thread waits (bounded) until
//      chunk_arrived[s][c] reaches the chunk's row count, resets it to 0, and
//      the block copies those rows into the XLA outputs while other chunks
//      are still in flight. Receivers then zero-fill the padding. Every block
//      counts tokens per local expert of the rows it placed; the last block
//      writes num_tokens and resets the ticket.
//   The only wait on a block of this kernel is every block's wait for block
//   0's counts (block 0 publishes before it waits); a rank waits for a peer's
//   rows only in step 4.
// dispatch at one rank (R = 1; single_rank_plan): block b plans the tokens of
//   its own contiguous range [b*L, b*L + L), L = ceil(T / G), G = grid, and
//   sends them, a warp's tokens kWarps apart (expert-major: any warp sends
//   any token, below). Steps 1-2 become: block b masks its range,
//   writes counters->ht_block_rows[b] = (seq, its count) (st.release.gpu, after
//   the barrier behind block 0's zeroing of tokens_per_expert and
//   num_invalid) and waits for every block's word of this seq: the blocks
//   before j give range j's first row, all of them the total. No parity: the next
//   dispatch starts after this kernel ended. Step 4 has no chunks (no tickets
//   are taken); without the profile there is no last block: block 0 writes
//   num_tokens, num_dropped and the sequence number (after its wait, so after
//   every block has read the old one), and a fault recorded before the call
//   does not void it (the next execution fails on it in the prepare stage).
// expert-major dispatch (kExpertMajor; the pair plan, ht_pair_plan.cu, ran
// before on this stream, but at one rank): the same kernel and steps, with
//   1. at one rank, the pair plan in this kernel: block b ranks its range's
//     pairs among the range's own tokens into plan_pair_rank, writes its
//     pairs per expert into plan_block_counts[b][*], its routed tokens'
//     indices in the range into plan_token_slot and (block 0) ht_work_next =
//     (seq, 0), all before its ht_block_rows word (the block barrier, then
//     the release); once it has acquired every block's word it sums the
//     columns (volatile loads) into the totals (shared memory) and the pairs
//     of the blocks before b into plan_block_before[b][*], then sets
//     ht_range_ready[b] = (seq, 0) (block barrier, st.release.gpu). The next
//     dispatch rewrites all of them after this kernel ended; the words carry
//     seq, so none is reset.
//   2. block 0 also writes this rank's tokens per local expert of each rank r
//     (plan_expert_totals) into r's expert_counts[p][me][*] before the flags
//     (every thread, then the block barrier, then the flag). Every block,
//     once it holds the flags (at one rank: the totals of step 1), lays out
//     the groups (place_groups): group e starts at the sum of the earlier
//     groups' pair counts rounded up to A; source s's pairs of e start after
//     those of the sources before s. Block 0 writes tokens_per_expert,
//     group_sizes, num_pairs and num_dropped.
//   At one rank the send role's work is not split by block: every warp takes
//     items (tokens, then the padding rows) from ht_work_next (atomicAdd,
//     gpu scope), and before its first token of range v it acquires
//     ht_range_ready[v] (bounded); rows and pair rows come from the plan, so
//     they do not depend on which warp takes which token (dispatch_send_role).
//   3. rows for peers also carry each entry's rank (recv_pair_rank: the pair
//     plan's rank for entries choosing an expert of that peer, else -1),
//     covered by the same chunk publication; this rank's own rows go straight
//     to each of the token's pair rows below M (row loaded once, stored once
//     per pair), with the pair's expert, weight and staging row, and the
//     staging row's slot_row and rows_by_expert.
//   4. a chunk's rows are copied to their pair rows the same way (no staging
//     row is written to the outputs). Receivers zero-fill the rows holding no
//     pair (zero_pair_padding; at one rank they were taken as items, above)
//     instead of the staging padding.
//   The staging capacity is every token of every rank (C >= R * T): nothing
//   is dropped before the pairs are placed; pairs past M are dropped.
// Buffer reuse:
//   * expert_counts: as counts (below).
//   * recv_*/chunk_arrived: a peer writes them for the next dispatch only after
//     this rank's notify flag of that dispatch, which this rank sends in the
//     next dispatch kernel, after this one finished copying out (and
//     resetting the counters) (stream order).
//   * counts/notify_flags alternate by parity. A peer publishes its counts for
//     dispatch n+1 without any handshake, and it may get there while this rank
//     is still in dispatch n (a peer that receives no rows from this rank
//     never waits for this rank's sends). It can publish into parity p again
//     (dispatch n+2) only after its dispatch n+1 saw this rank's flag n+1,
//     which this rank sends after dispatch n ended.
//
// combine = two kernels:
//   ht_combine_send: received row i (source s != me, token t) goes to s's
//     combine_recv[p][me][t] (p = seq parity); then every thread fences and
//     the last block sets combine_flags[p][me] = seq on every rank. Rows
//     whose source is this rank stay where they are, in y.
//   ht_combine_recv: waits for every rank's combine flag; out[t] = sum over
//     ranks r with send_row[t][r] >= 0 of combine_recv[p][r][t] (r != me) or
//     y[send_row[t][me]] (r == me), in fp32, in rank order.
// At one rank only ht_combine_recv runs (every row is in y) and, without the
// profile, block 0 advances the sequence number (no last block).
// A combine sends without a handshake, so its buffers alternate by parity: a
// peer can write parity p again two combines later only after receiving this
// rank's rows of the combine in between, sent after this rank read parity p.
// Rows wider than the 2H-byte combine_recv rows (float32 rows, float32 weight
// columns) travel in passes of at most 2H bytes; each pass is one send and one
// receive kernel with its own sequence number and parity, as above. The sums
// run in fp32 in rank order whatever the row type (bf16, f16, f32).
//
// Faults: a timed-out wait records the fault (device_common.cuh). The
// dispatch's last block then writes num_tokens = num_dropped = -1 and
// tokens_per_expert = -1; a combine writes NaN rows for the tokens whose rows
// did not all arrive (and for every token of a faulted dispatch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_combine_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_pair_rank.cuh"
#include "cuda/ht_row_elements.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// Profiling hooks (JAX_EP_PROFILE=1; no-ops when ctx.profile is null). Slots:
// ep_types.h DeviceProfile. A role's time runs from block 0's start to the
// latest end among the role's blocks; the last block of the call closes it.
constexpr int kProfCounts = 4, kProfDispatchSend = 5, kProfDispatchRecv = 6,
              kProfCombineSend = 7, kProfCombineRecv = 8;

__device__ __forceinline__ void ht_profile_start(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    ctx.profile->start[k] = global_timer_ns();
  }
}
// Thread 0 of each block of the role, once the block's part is done.
__device__ __forceinline__ void ht_profile_role_end(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    atomicMax(reinterpret_cast<unsigned long long*>(&ctx.profile->role_end[k]),
              static_cast<unsigned long long>(global_timer_ns()));
  }
}
// Thread 0 of a block: `ns` this block spent waiting for peers.
__device__ __forceinline__ void ht_profile_wait(const HtContext& ctx, int k, uint64_t ns) {
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctx.profile->wait_ns[k]),
              static_cast<unsigned long long>(ns));
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctx.profile->blocks[k]), 1ull);
  }
}
// HT dispatch timeline (DeviceProfile::ht_trace); one thread calls it.
__device__ __forceinline__ void ht_trace(const HtContext& ctx, uint32_t seq, int event,
                                         uint64_t at = 0) {
  if (ctx.profile != nullptr) {
    ctx.profile->ht_trace[seq % kHtTraceCalls][event] = at != 0 ? at : global_timer_ns();
  }
}
// One thread of the call's last block, after every block's role_end.
__device__ __forceinline__ void ht_profile_close(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr) {
    DeviceProfile* p = ctx.profile;
    if (p->role_end[k] > p->start[k]) p->total_ns[k] += p->role_end[k] - p->start[k];
    p->role_end[k] = 0;
    p->calls[k] += 1;
  }
}

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

// A sender warp publishes its rows (one fence, then the counter adds) once it
// has stored about kPublishBytes of rows since the last publication, and after
// its last token: at most kMaxHeldTokens + 1 tokens. Measured on 2x H200
// (2026-11-30, docs/benchmarks.md), BF16 / FP8 dispatch: every token 260 / 181
// us, every 2 tokens 238 / 154, every 4 234 / 157, every 8 251 / 148; the
// bytes rule picks 4 for BF16 and 8 for FP8 rows of hidden 7168. Holding more
// leaves more rows to copy out after the last publication.
constexpr size_t kPublishBytes = 64 * 1024;
constexpr int kMaxHeldTokens = 7;

__host__ __device__ constexpr int publish_tokens(size_t row_bytes) {
  const size_t tokens = row_bytes == 0 ? 1 : kPublishBytes / row_bytes;
  return tokens < 1                    ? 1
         : tokens > kMaxHeldTokens + 1 ? kMaxHeldTokens + 1
                                       : static_cast<int>(tokens);
}
static_assert(publish_tokens(7168 * 2) == 4 && publish_tokens(7168) == 8, "see above");

// kSingleRank (one rank): every row goes to this rank's own outputs, so
// nothing is published and the registers of the held chunks go to a deeper
// BF16 load batch (16 vectors per lane instead of 8: at EP1 the copy is bound
// by the loads in flight per SM, not by a link).
// kExpertMajor: rows for this rank itself go straight to each of the token's
// pair rows (pair.base[me]); peers get the token-major row plus each entry's
// rank (recv_pair_rank), and place its pairs when they copy it out.
// Both (one rank, expert-major; kTaken): the work is not split by block. Each
// warp takes items from ctx.counters->ht_work_next (atomicAdd, one item
// ahead): item i < T is token i, item T + j < T + (padding rows) is padding
// row j (zero_pair_padding_row); past those the warp is done. The static
// split's blocks ended up to about 90 us apart on 400 us of expansion (SMs do
// not store at the same rate: tools/pair_combine_probe.cu, 2026-12-06); taken
// work ends them within a token or two. What goes where does not depend on
// who takes it: token t of block range v = t / L has staging row
// s_tile_base[v] + plan_token_slot[t], and its pair of expert e has row
// group_start[e] + plan_block_before[v][e] + plan_pair_rank[t][k], once the
// warp holds v's ht_range_ready word (its items only grow, so it waits for
// each range's word at most once).
template <bool kHasScales, bool kSingleRank, bool kExpertMajor>
__device__ __forceinline__ void dispatch_send_role(const HtContext& ctx, const HtDispatchArgs& args,
                                                   uint32_t seq, int send_block,
                                                   int num_send_blocks, int* s_tpe,
                                                   const int* s_row_offset,
                                                   const uint8_t* s_mask, const int* s_tile_base,
                                                   const PairSmem& pair) {
  constexpr bool kTaken = kSingleRank && kExpertMajor;
  // Where rows for rank r go: r's recv_x, or this rank's XLA output for r == me.
  __shared__ char* s_dst_x[kHtMaxRanks];
  __shared__ size_t s_dst_stride[kHtMaxRanks];
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const HtBuffers& b = ctx.buffers;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  const int scale_words = kHasScales ? static_cast<int>(args.scale_bytes / 4) : 0;
  const ExpertRank rank_of(d.experts_per_rank);
  // 16-byte vectors per lane per load batch. Between ranks 8 (16 was measured
  // no faster for BF16 and slower for FP8 on 2x H200, 2026-11-30,
  // docs/benchmarks.md). At one rank 16: a whole FP8 row (448 vectors at
  // hidden 7168) is one batch, one load round trip per token instead of two,
  // without spills; the expert-major FP8 instance stays at 8, where 16 adds
  // to its spills.
  constexpr int kUnroll = kSingleRank && !(kHasScales && kExpertMajor) ? 16 : 8;
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    const bool self = r == d.rank;
    s_dst_x[r] = self ? static_cast<char*>(args.out_x)
                      : static_cast<char*>(transport::peer_ptr(b.recv_x, r));
    s_dst_stride[r] = self ? args.out_row_stride : b.row_bytes;
  }
  __syncthreads();
  // The block's tokens: one in every tile of W = send blocks x warps tokens
  // per warp; at one rank, the block's own range (single_rank_plan), a warp's
  // tokens kWarps apart.
  const int tile_tokens = kSingleRank ? single_rank_tile_tokens(args.num_tokens, num_send_blocks)
                                      : num_send_blocks * kWarps;
  const int first_token =
      kSingleRank ? send_block * tile_tokens + warp : send_block * kWarps + warp;
  const int token_step = kSingleRank ? kWarps : tile_tokens;
  const int token_end = kSingleRank && !kTaken
                            ? min(args.num_tokens, (send_block + 1) * tile_tokens)
                            : args.num_tokens;
  // kTaken: lane 0's last word of ht_work_next (the warp's next item, in
  // flight while the current one is worked on); items past the work, and a
  // word of another call (only after a timed-out wait: the call is void),
  // end the warp's work.
  unsigned long long taken = 0ull;
  const auto take = [&] {
    if (lane == 0) {
      taken = atomicAdd(reinterpret_cast<unsigned long long*>(&ctx.counters->ht_work_next), 1ull);
    }
  };
  const auto taken_item = [&]() -> int {
    const uint64_t word = __shfl_sync(0xffffffffu, static_cast<uint64_t>(taken), 0);
    return flag_seq(word) == seq && flag_value(word) < 0x40000000u
               ? static_cast<int>(flag_value(word))
               : 0x40000000;
  };
  int ready_range = -1;  // kTaken: the latest range whose ht_range_ready word this warp holds
  int item = first_token;
  if constexpr (kTaken) {
    take();
    item = taken_item();
  }
  // Token t's rows are worked out while the loads of the token before are in
  // flight (shared-memory ballots, no global round trip on the way).
  int next_row = !kTaken && first_token < token_end
                     ? token_row(s_mask, s_tile_base, s_row_offset, first_token, tile_tokens, R,
                                 args.capacity, lane)
                     : -1;
  // This lane's chunks (on peer `lane`, -1: none) of the tokens held back for
  // the next publication; num_held of them (warp-uniform).
  int held_chunks[kMaxHeldTokens];
  int num_held = 0;
  const int tokens_per_publication = publish_tokens(args.row_bytes);
  for (; item < token_end; item = kTaken ? taken_item() : item + token_step) {
    const int t = item;
    if constexpr (kTaken) take();  // the next item, while this token's rows go out
    // Every load of token t goes out before its first store: its top-k and
    // weights (lane k), its scales and the first batch of its row. One
    // dependent load round trip per token, not one per destination and field
    // (the per-row cost the token sweep of 2026-11-30 showed).
    int my_row = next_row;
    const int range = kTaken ? t / tile_tokens : 0;
    if constexpr (kTaken) {
      if (range != ready_range) {
        if (lane == 0) {
          wait_flag(ctx.counters->ht_range_ready + range, seq, ctx.timeout_ns, ctx.status,
                    kOpHtNotify, d.rank, range, /*gpu_scope=*/true);
        }
        __syncwarp();
        ready_range = range;
      }
      // Written in this kernel by the range's block before its word: volatile
      // loads (not the L1). Past the capacity (only after a timed-out wait):
      // dropped.
      my_row = -1;
      if (lane == 0) {
        const int slot = static_cast<int>(
            ld_volatile_u32(reinterpret_cast<const uint32_t*>(b.plan_token_slot) + t));
        const int row = s_tile_base[range] + slot;
        if (slot >= 0 && row < args.capacity) my_row = row;
      }
    }
    const int expert = lane < d.num_topk ? __ldg(args.topk_idx + t * d.num_topk + lane) : -1;
    const float weight =
        lane < d.num_topk ? __ldg(args.topk_weights + t * d.num_topk + lane) : 0.0f;
    // The pair plan's rank of this entry: written by the kernel before this
    // one, or at one rank by this block, counted from its range's first token
    // (single_rank_plan; pair.base holds the blocks before; not through __ldg).
    int pair_rank = -1;
    if (kExpertMajor && lane < d.num_topk) {
      pair_rank = kSingleRank ? static_cast<int>(ld_volatile_u32(
                                    reinterpret_cast<const uint32_t*>(b.plan_pair_rank) +
                                    t * d.num_topk + lane))
                              : __ldg(b.plan_pair_rank + t * d.num_topk + lane);
    }
    const uint32_t* src_scales = nullptr;
    uint32_t scales[kScaleWordsPerLane];
    if constexpr (kHasScales) {
      src_scales = reinterpret_cast<const uint32_t*>(static_cast<const char*>(args.scales) +
                                                     static_cast<size_t>(t) * args.scale_bytes);
      load_scale_words(scales, src_scales, scale_words, lane);
    }
    const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) +
                                                    static_cast<size_t>(t) * args.x_row_stride);
    int4 batch[kUnroll];
    warp_load_batch(batch, src, 0, num_vec, lane);
    if (lane < R) args.out_send_row[t * R + lane] = my_row;
    if (!kTaken && t + token_step < token_end) {
      next_row = token_row(s_mask, s_tile_base, s_row_offset, t + token_step, tile_tokens, R,
                           args.capacity, lane);
    }
    // Expert-major: this token's own pair rows here (lane k: entry k's, if it
    // owns a kept pair), and their lanes.
    int self_pair_row = -1;
    uint32_t self_pairs = 0u;
    if constexpr (kExpertMajor) {
      const int self_row = __shfl_sync(0xffffffffu, my_row, d.rank);
      if (self_row >= 0) {
        const bool mine = lane < d.num_topk && expert >= 0 && expert < d.num_experts &&
                          rank_of(expert) == d.rank;
        if (kTaken && mine && pair_rank >= 0) {
          // The pairs of the blocks before the token's range (at one rank
          // expert = local expert; its group's start is in pair.base).
          const int before = static_cast<int>(ld_volatile_u32(
              reinterpret_cast<const uint32_t*>(b.plan_block_before) +
              static_cast<size_t>(range) * d.num_experts + expert));
          pair_rank = before >= 0 && before <= args.pairs.num_rows ? pair_rank + before : -1;
        }
        self_pair_row = place_pairs(args.pairs, pair.base + d.rank * d.experts_per_rank,
                                    self_row, mine ? expert - d.rank * d.experts_per_rank : -1,
                                    mine ? weight : 0.0f, mine ? pair_rank : -1, d.num_topk,
                                    lane);
        self_pairs = __ballot_sync(0xffffffffu, self_pair_row >= 0);
      }
    }
    // Each batch of the row is loaded once and stored to every destination.
    for (int base = 0; base < num_vec; base += kUnroll * kWarpSize) {
      if (base > 0) warp_load_batch(batch, src, base, num_vec, lane);
      for (int r = 0; r < R; ++r) {
        const int row = __shfl_sync(0xffffffffu, my_row, r);
        if (row < 0) continue;
        if (kExpertMajor && r == d.rank) {
          store_to_pairs(batch, base, num_vec, lane, self_pairs, self_pair_row,
                         static_cast<char*>(args.out_x), args.out_row_stride);
          continue;
        }
        warp_store_batch(reinterpret_cast<int4*>(s_dst_x[r] + static_cast<size_t>(row) *
                                                                  s_dst_stride[r]),
                         batch, base, num_vec, lane);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int row = __shfl_sync(0xffffffffu, my_row, r);
      if (row < 0) continue;
      const bool self = r == d.rank;
      if constexpr (kHasScales) {
        if (kExpertMajor && self) {
          store_scales_to_pairs(args, scales, src_scales, scale_words, self_pairs, self_pair_row,
                                lane);
        } else {
          void* dst_scales = self ? args.out_scales : transport::peer_ptr(b.recv_scales, r);
          store_scale_words(reinterpret_cast<uint32_t*>(static_cast<char*>(dst_scales) +
                                                        static_cast<size_t>(row) * args.scale_bytes),
                            scales, src_scales, scale_words, lane);
        }
      }
      int local = -1;
      if (lane < d.num_topk) {
        const bool mine = expert >= 0 && expert < d.num_experts && rank_of(expert) == r;
        local = mine ? expert - r * d.experts_per_rank : -1;
        if (!(kExpertMajor && self)) {  // expert-major: place_pairs wrote this rank's own
          auto* idx =
              self ? args.out_idx : static_cast<int32_t*>(transport::peer_ptr(b.recv_idx, r));
          auto* w = self ? args.out_w : static_cast<float*>(transport::peer_ptr(b.recv_w, r));
          idx[row * d.num_topk + lane] = local;
          w[row * d.num_topk + lane] = mine ? weight : 0.0f;
        }
        if (kExpertMajor && !self) {
          static_cast<int32_t*>(transport::peer_ptr(b.recv_pair_rank, r))[row * d.num_topk + lane] =
              mine ? pair_rank : -1;
        }
      }
      if (self) {
        if (lane == 0) args.out_recv_src[row] = d.rank * args.num_tokens + t;
        if (!kExpertMajor) count_row_experts(local, d.num_topk, s_tpe, lane);
      } else if (lane == 0) {
        static_cast<int32_t*>(transport::peer_ptr(b.recv_src, r))[row] = t;
      }
    }
    if constexpr (kSingleRank) continue;
    // Publication, every kPublishTokens tokens of the warp (and after its
    // last): lane r adds the rows stored for peer r since the last one to
    // their chunks' counters, behind one fence (the release pattern: the fence
    // orders every lane's stores, which __syncwarp ordered before it, before
    // the adds). A fence waits for the warp's stores to be acknowledged, a
    // round trip over NVLink; one per row cost the FP8 dispatch a sixth.
    const int chunk = lane < R && lane != d.rank && my_row >= 0
                          ? (my_row - s_row_offset[lane]) / kHtChunkRows
                          : -1;
    if (num_held + 1 < tokens_per_publication && t + token_step < token_end) {
#pragma unroll
      for (int i = 0; i < kMaxHeldTokens; ++i) {
        if (i == num_held) held_chunks[i] = chunk;
      }
      ++num_held;
      continue;
    }
    __syncwarp();
    if (lane < R && lane != d.rank) {
      fence_acq_rel_sys();
      uint32_t* counters = static_cast<uint32_t*>(
          transport::peer_ptr(b.chunk_arrived + d.rank * b.chunks_per_source, lane));
#pragma unroll
      for (int i = 0; i < kMaxHeldTokens; ++i) {
        if (i < num_held && held_chunks[i] >= 0) red_add_relaxed_sys(counters + held_chunks[i], 1u);
      }
      if (chunk >= 0) red_add_relaxed_sys(counters + chunk, 1u);
    }
    num_held = 0;
  }
  if constexpr (kTaken) {
    // The padding rows, as items after the tokens (place_groups laid them
    // out in this block's shared memory, the same in every block).
    const int num_padding = pair.pad_prefix[d.experts_per_rank + 1];
    int group = 0;
    for (; item < token_end + num_padding; item = taken_item()) {
      take();
      zero_pair_padding_row<kHasScales>(args, pair, item - token_end, &group, lane);
    }
  }
}

// Rows of a chunk per warp (their top-k, weights, source and scales).
constexpr int kRowsPerWarp = kHtChunkRows / kWarps;
static_assert(kHtChunkRows % kWarps == 0, "a chunk's rows split evenly over the warps");

// Returns the time thread 0 spent waiting for chunks (profiling only; else 0).
// Chunks are handed out in (source, chunk) order by a ticket counter, so a
// sender block that is done can take the last ones. `recv_block` <
// `num_recv_blocks`: a receiver block, which also zero-fills its share of the
// padding; -1: a sender block helping.
// kExpertMajor: each row is copied to each of its kept pair rows (place_pairs
// with its source's base); the padding is the pair padding (zero_pair_padding).
template <bool kHasScales, bool kExpertMajor>
__device__ __forceinline__ uint64_t dispatch_recv_role(const HtContext& ctx,
                                                       const HtDispatchArgs& args, int recv_block,
                                                       int num_recv_blocks, int* s_tpe,
                                                       const int* s_prefix, int kept,
                                                       const PairSmem& pair) {
  __shared__ int s_item;
  uint64_t waited_ns = 0;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const HtBuffers& b = ctx.buffers;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  const int scale_words = kHasScales ? static_cast<int>(args.scale_bytes / 4) : 0;
  // Chunks of rows from other sources, below the capacity, in (source, chunk) order.
  int num_chunks[kHtMaxRanks];
  int total_chunks = 0;
  for (int s = 0; s < R; ++s) {
    const int rows = s == d.rank ? 0 : max(0, min(s_prefix[s + 1], kept) - s_prefix[s]);
    num_chunks[s] = (rows + kHtChunkRows - 1) / kHtChunkRows;
    total_chunks += num_chunks[s];
  }
  // No chunks (one rank, or nothing from peers): no ticket is taken.
  while (total_chunks > 0) {
    if (threadIdx.x == 0) {
      s_item = static_cast<int>(atomicAdd(&ctx.counters->ht_recv_ticket, 1u));
    }
    __syncthreads();
    const int item = s_item;
    if (item >= total_chunks) break;  // block-uniform
    int s = 0, c = item;
    while (c >= num_chunks[s]) c -= num_chunks[s++];
    const int first = s_prefix[s] + c * kHtChunkRows;
    const int last = min(min(s_prefix[s + 1], kept), first + kHtChunkRows);
    if (threadIdx.x == 0) {
      const uint64_t wait_start = ctx.profile != nullptr ? global_timer_ns() : 0;
      uint32_t* counter = b.chunk_arrived + s * b.chunks_per_source + c;
      // On a timeout (recorded for the host) the chunk is copied anyway: its
      // rows are in bounds, and the call's results are void.
      wait_count(counter, static_cast<uint32_t>(last - first), ctx.timeout_ns, ctx.status,
                 kOpHtDispatch, s, c);
      *counter = 0u;  // every add of this chunk has landed: ready for the next dispatch
      if (ctx.profile != nullptr) waited_ns += global_timer_ns() - wait_start;
    }
    __syncthreads();
    // The warp's rows' top-k, weights, source and scales: loaded first, so
    // their round trip overlaps the row copy instead of following it.
    int meta_idx[kRowsPerWarp], meta_src[kRowsPerWarp], meta_rank[kRowsPerWarp];
    float meta_w[kRowsPerWarp];
    uint32_t meta_scales[kRowsPerWarp][kScaleWordsPerLane];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int row = first + warp + j * kWarps;
      meta_idx[j] = -1;
      meta_w[j] = 0.0f;
      meta_src[j] = 0;
      meta_rank[j] = -1;
      if (row < last) {
        if (lane < d.num_topk) {
          meta_idx[j] = b.recv_idx[row * d.num_topk + lane];
          meta_w[j] = b.recv_w[row * d.num_topk + lane];
          if constexpr (kExpertMajor) meta_rank[j] = b.recv_pair_rank[row * d.num_topk + lane];
        }
        meta_src[j] = b.recv_src[row];
        if constexpr (kHasScales) {
          load_scale_words(meta_scales[j],
                           reinterpret_cast<const uint32_t*>(b.recv_scales) +
                               static_cast<size_t>(row) * scale_words,
                           scale_words, lane);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int row = first + warp + j * kWarps;
      if (row >= last) continue;  // warp-uniform
      if constexpr (kExpertMajor) {
        const int pair_row = place_pairs(args.pairs, pair.base + s * d.experts_per_rank, row,
                                         meta_idx[j], meta_w[j], meta_rank[j], d.num_topk, lane);
        const uint32_t pairs = __ballot_sync(0xffffffffu, pair_row >= 0);
        const int4* src =
            reinterpret_cast<const int4*>(b.recv_x + static_cast<size_t>(row) * b.row_bytes);
        for (int base = 0; base < num_vec; base += 16 * kWarpSize) {
          int4 batch[16];
          warp_load_batch(batch, src, base, num_vec, lane, /*coherent=*/true);
          store_to_pairs(batch, base, num_vec, lane, pairs, pair_row,
                         static_cast<char*>(args.out_x), args.out_row_stride);
        }
        if constexpr (kHasScales) {
          const uint32_t* in_scales = reinterpret_cast<const uint32_t*>(b.recv_scales) +
                                      static_cast<size_t>(row) * scale_words;
          store_scales_to_pairs(args, meta_scales[j], in_scales, scale_words, pairs, pair_row,
                                lane);
        }
        if (lane == 0) args.out_recv_src[row] = s * args.num_tokens + meta_src[j];
        continue;
      }
      // 16 vectors per lane in flight (128 KB per SM): the copy-out is bound
      // by load latency, as the combine receive was. Coherent loads: a peer
      // wrote the row during this kernel, published by the chunk counter
      // thread 0 acquired before the block barrier.
      warp_copy<16, /*kCoherent=*/true>(
          reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                  static_cast<size_t>(row) * args.out_row_stride),
          reinterpret_cast<const int4*>(b.recv_x + static_cast<size_t>(row) * b.row_bytes),
          num_vec, lane);
      if constexpr (kHasScales) {
        const uint32_t* in_scales = reinterpret_cast<const uint32_t*>(b.recv_scales) +
                                    static_cast<size_t>(row) * scale_words;
        store_scale_words(reinterpret_cast<uint32_t*>(static_cast<char*>(args.out_scales) +
                                                      static_cast<size_t>(row) * args.scale_bytes),
                          meta_scales[j], in_scales, scale_words, lane);
      }
      if (lane < d.num_topk) {
        args.out_idx[row * d.num_topk + lane] = meta_idx[j];
        args.out_w[row * d.num_topk + lane] = meta_w[j];
      }
      count_row_experts(meta_idx[j], d.num_topk, s_tpe, lane);
      if (lane == 0) args.out_recv_src[row] = s * args.num_tokens + meta_src[j];
    }
    __syncthreads();  // thread 0 moves on to the next chunk's wait only after the copies
  }
  if (recv_block < 0) return waited_ns;
  if constexpr (kExpertMajor) {
    // At one rank the send role's warps took the padding rows (work items).
    zero_pair_padding<kHasScales>(ctx, args, pair, kept, recv_block * kWarps + warp,
                                  num_recv_blocks * kWarps, lane, /*padding_rows_taken=*/R == 1);
  } else {
    // Padding rows [kept, capacity).
    for (int row = kept + recv_block * kWarps + warp; row < args.capacity;
         row += num_recv_blocks * kWarps) {
      int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                          static_cast<size_t>(row) * args.out_row_stride);
      for (int v = lane; v < num_vec; v += kWarpSize) dst[v] = make_int4(0, 0, 0, 0);
      if constexpr (kHasScales) {
        auto* scales = reinterpret_cast<uint32_t*>(static_cast<char*>(args.out_scales) +
                                                   static_cast<size_t>(row) * args.scale_bytes);
        for (int i = lane; i < static_cast<int>(args.scale_bytes / 4); i += kWarpSize) {
          scales[i] = 0u;
        }
      }
      if (lane < d.num_topk) {
        args.out_idx[row * d.num_topk + lane] = -1;
        args.out_w[row * d.num_topk + lane] = 0.0f;
      }
      if (lane == 0) args.out_recv_src[row] = -1;
    }
  }
  return waited_ns;
}

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

// One pass of an HT combine: bytes [offset, offset + bytes) of every row
// (a 16-byte multiple, at most the receive buffers' 2H-byte rows).
struct CombinePass {
  size_t row_stride;  // bytes per row of y and out (W * element size)
  size_t offset;
  size_t bytes;
};

__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_send(HtContext ctx, HtCombineArgs args, CombinePass pass) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  ht_profile_start(ctx, kProfCombineSend);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const size_t buffer_row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int valid = min(*args.num_tokens, args.capacity);  // -1 after a faulted dispatch
  for (int i = blockIdx.x * kWarps + warp; i < valid; i += gridDim.x * kWarps) {
    const int src = args.recv_src[i];
    if (src < 0 || args.num_local_tokens <= 0) continue;
    const int s = src / args.num_local_tokens, t = src % args.num_local_tokens;
    if (s >= R || s == d.rank) continue;  // own rows are read from y by ht_combine_recv
    char* dst = static_cast<char*>(transport::peer_ptr(recv_base, s)) +
                (static_cast<size_t>(d.rank) * d.max_tokens + t) * buffer_row_bytes;
    warp_copy(reinterpret_cast<int4*>(dst),
              reinterpret_cast<const int4*>(static_cast<const char*>(args.y) +
                                            i * pass.row_stride + pass.offset),
              static_cast<int>(pass.bytes / 16), lane);
  }
  if (arrive_is_last_block(&ctx.counters->ht_combine_send_done)) {
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      transport::set_flag(flags + d.rank, make_flag(seq, 1), r, nullptr, 0);
    }
    ht_profile_role_end(ctx, kProfCombineSend);
    if (threadIdx.x == 0) ht_profile_close(ctx, kProfCombineSend);
  }
}

// The rows a lane loads for token t's sum: each rank's copy (r == me: y, else
// combine_recv), or null when that rank holds none.
__device__ __forceinline__ const int4* combine_source(const HtContext& ctx,
                                                      const HtCombineArgs& args,
                                                      const CombinePass& pass,
                                                      const char* recv_base, int row, int r,
                                                      int t, int valid) {
  if (row < 0) return nullptr;
  if (r == ctx.dims.rank) {
    if (row >= valid) return nullptr;
    return reinterpret_cast<const int4*>(static_cast<const char*>(args.y) +
                                         static_cast<size_t>(row) * pass.row_stride +
                                         pass.offset);
  }
  return reinterpret_cast<const int4*>(
      recv_base +
      (static_cast<size_t>(r) * ctx.dims.max_tokens + t) * static_cast<size_t>(ctx.dims.hidden) * 2);
}

// kSources = 2 (R = 2): both ranks' loads are in flight together and summed
// without an accumulator array, which leaves registers for twice the bytes in
// flight per SM (the sum is bound by load latency, by Little's law: about
// 64 KB in flight per SM gave 1.5 TB/s at 24 SMs). kSources = 1 (R = 1): the
// rank's own rows only, those registers as one load batch twice as deep, and
// no flag to wait for (nothing is sent: LaunchCombinePass skips
// ht_combine_send). kSources = 0: any R. Sums run in rank order from 0.0f in
// every path, so all give the same bits. A token whose rows did not all
// arrive (a peer's flag timed out, or the dispatch itself faulted) gets NaN.
template <typename T, int kSources>
__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_recv(HtContext ctx, HtCombineArgs args, CombinePass pass) {
  using E = RowElements<T>;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  ht_profile_start(ctx, kProfCombineRecv);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int first_token = blockIdx.x * kWarps + warp;
  const int token_stride = gridDim.x * kWarps;
  // The warp's next token's rows, loaded one token ahead (the first now, with
  // the fault word), so no token's row loads wait for its send_row.
  int next_row = lane < R && first_token < args.num_local_tokens
                     ? args.send_row[first_token * R + lane]
                     : -1;
  const uint32_t lost =
      combine_lost_ranks(ctx, flags, seq, args.num_tokens, /*wait_peers=*/kSources != 1);
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    ht_profile_wait(ctx, kProfCombineRecv,
                    global_timer_ns() - ctx.profile->start[kProfCombineRecv]);
  }
  const int num_vec = static_cast<int>(pass.bytes / 16);
  const int valid = min(*args.num_tokens, args.capacity);
  // One warp per token; kBatch independent 16-byte loads per lane and source
  // in flight.
  constexpr int kBatch = 8;
  for (int t = first_token; t < args.num_local_tokens; t += token_stride) {
    const int my_row = next_row;
    if (t + token_stride < args.num_local_tokens) {
      next_row = lane < R ? args.send_row[(t + token_stride) * R + lane] : -1;
    }
    int4* out_row = reinterpret_cast<int4*>(static_cast<char*>(args.out) +
                                            static_cast<size_t>(t) * pass.row_stride +
                                            pass.offset);
    const uint32_t needed = __ballot_sync(0xffffffffu, my_row >= 0);
    if ((needed & lost) != 0u) {
      store_nan_row<T>(out_row, num_vec, lane);
      continue;
    }
    if constexpr (kSources == 1) {
      constexpr int kOneBatch = 2 * kBatch;
      const int4* src = combine_source(ctx, args, pass, recv_base,
                                       __shfl_sync(0xffffffffu, my_row, 0), 0, t, valid);
      for (int base = 0; base < num_vec; base += kOneBatch * kWarpSize) {
        int4 raw[kOneBatch];
        if (src != nullptr) warp_load_batch(raw, src, base, num_vec, lane);  // y: read-only
#pragma unroll
        for (int u = 0; u < kOneBatch; ++u) {
          const int v = base + u * kWarpSize + lane;
          if (v >= num_vec) continue;
          st_na_v4(out_row + v, src != nullptr ? E::plus_zero(raw[u]) : make_int4(0, 0, 0, 0));
        }
      }
    } else if constexpr (kSources == 2) {
      const int4* src0 = combine_source(ctx, args, pass, recv_base,
                                        __shfl_sync(0xffffffffu, my_row, 0), 0, t, valid);
      const int4* src1 =
          R > 1 ? combine_source(ctx, args, pass, recv_base,
                                 __shfl_sync(0xffffffffu, my_row, 1), 1, t, valid)
                : nullptr;
      for (int base = 0; base < num_vec; base += kBatch * kWarpSize) {
        int4 raw0[kBatch], raw1[kBatch];
        // A peer's row (combine_recv, written during this kernel) needs coherent
        // loads; this rank's own (y) is read-only here.
        if (src0 != nullptr) warp_load_batch(raw0, src0, base, num_vec, lane, 0 != d.rank);
        if (src1 != nullptr) warp_load_batch(raw1, src1, base, num_vec, lane, 1 != d.rank);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * kWarpSize + lane;
          if (v >= num_vec) continue;
          int4 packed;
#pragma unroll
          for (int j = 0; j < E::kPerVector; ++j) {
            float sum = 0.0f;
            if (src0 != nullptr) sum += E::get(raw0[u], j);
            if (src1 != nullptr) sum += E::get(raw1[u], j);
            E::set(packed, j, sum);
          }
          out_row[v] = packed;
        }
      }
    } else {
      for (int base = 0; base < num_vec; base += kBatch * kWarpSize) {
        float acc[kBatch][E::kPerVector];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
#pragma unroll
          for (int j = 0; j < E::kPerVector; ++j) acc[u][j] = 0.0f;
        }
        for (int r = 0; r < R; ++r) {
          const int4* src = combine_source(ctx, args, pass, recv_base,
                                           __shfl_sync(0xffffffffu, my_row, r), r, t, valid);
          if (src == nullptr) continue;
          int4 raw[kBatch];
          warp_load_batch(raw, src, base, num_vec, lane, /*coherent=*/r != d.rank);
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
#pragma unroll
            for (int j = 0; j < E::kPerVector; ++j) acc[u][j] += E::get(raw[u], j);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * kWarpSize + lane;
          if (v >= num_vec) continue;
          int4 packed;
#pragma unroll
          for (int j = 0; j < E::kPerVector; ++j) E::set(packed, j, acc[u][j]);
          out_row[v] = packed;
        }
      }
    }
  }
  // One rank, unprofiled: only the sequence number to advance, read by later
  // kernels: block 0 alone, no last block (no system fences after the stores).
  if (runs_epilogue(&ctx.counters->ht_combine_recv_done,
                    kSources == 1 && ctx.profile == nullptr)) {
    ctx.counters->ht_combine_seq = seq;
    ht_profile_role_end(ctx, kProfCombineRecv);
    ht_profile_close(ctx, kProfCombineRecv);
  }
}

template <typename T>
void LaunchCombinePass(const HtContext& ctx, const HtCombineArgs& args, const CombinePass& pass,
                       int grid, cudaStream_t stream) {
  if (ctx.dims.num_ranks == 1) {  // nothing to send: every row is this rank's own
    ht_combine_recv<T, 1><<<grid, kThreads, 0, stream>>>(ctx, args, pass);
    return;
  }
  ht_combine_send<<<grid, kThreads, 0, stream>>>(ctx, args, pass);
  if (ctx.dims.num_ranks == 2) {
    ht_combine_recv<T, 2><<<grid, kThreads, 0, stream>>>(ctx, args, pass);
  } else {
    ht_combine_recv<T, 0><<<grid, kThreads, 0, stream>>>(ctx, args, pass);
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

cudaError_t LaunchHtCombine(const HtContext& ctx, const HtCombineArgs& args, cudaStream_t stream) {
  const size_t element_bytes = args.row_type == HtRowType::kF32 ? 4 : 2;
  const size_t row_bytes = static_cast<size_t>(args.num_columns) * element_bytes;
  const size_t buffer_row_bytes = static_cast<size_t>(ctx.dims.hidden) * 2;
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.hidden % 8 != 0 || row_bytes % 16 != 0 ||
      args.num_columns <= 0) {
    return cudaErrorInvalidValue;
  }
  const int grid = std::max(1, ctx.num_sms);
  for (size_t offset = 0; offset < row_bytes; offset += buffer_row_bytes) {
    const CombinePass pass{row_bytes, offset, std::min(buffer_row_bytes, row_bytes - offset)};
    switch (args.row_type) {
      case HtRowType::kBf16: LaunchCombinePass<__nv_bfloat16>(ctx, args, pass, grid, stream); break;
      case HtRowType::kF16: LaunchCombinePass<__half>(ctx, args, pass, grid, stream); break;
      case HtRowType::kF32: LaunchCombinePass<float>(ctx, args, pass, grid, stream); break;
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

cudaError_t PrepareHtKernels() {
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
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_send);
  for (const void* kernel : {reinterpret_cast<const void*>(ht_combine_recv<__nv_bfloat16, 1>),
                             reinterpret_cast<const void*>(ht_combine_recv<__nv_bfloat16, 2>),
                             reinterpret_cast<const void*>(ht_combine_recv<__nv_bfloat16, 0>),
                             reinterpret_cast<const void*>(ht_combine_recv<__half, 1>),
                             reinterpret_cast<const void*>(ht_combine_recv<__half, 2>),
                             reinterpret_cast<const void*>(ht_combine_recv<__half, 0>),
                             reinterpret_cast<const void*>(ht_combine_recv<float, 1>),
                             reinterpret_cast<const void*>(ht_combine_recv<float, 2>),
                             reinterpret_cast<const void*>(ht_combine_recv<float, 0>)}) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
