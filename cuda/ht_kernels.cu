// High-throughput (HT) dispatch and combine over NVLink (R <= 8 ranks).
//
// PROTOCOL (seq = the op's call sequence number, the same on every rank; flags
// are (seq << 32 | value) words, never reset; buffers in ht_types.h)
//
// dispatch = two kernels launched back to back by one custom call:
//   ht_notify (1 block): counts this rank's tokens per destination rank
//     (a token counts once per rank; every token's rank mask is built once in
//     shared memory from coalesced loads), writes that row into every rank's
//     counts[me][*] and then sets notify_flags[me] there (st.release.sys).
//     It waits for every source's notify flag, reads the R x R matrix and
//     decides the layout: on receiver r, source s's rows start at
//     sum_{s'<s} counts[s'][r], in source token order; rows at or past the
//     capacity are dropped (send_row = -1). Writes send_row [T, R] and HtPlan.
//   ht_dispatch (num_sms blocks, two roles running at the same time):
//     senders (the first blocks): one warp per token loads its row once
//       (16-byte loads) and stores it, with its scales, source token index
//       and top-k (rewritten to the receiver's local experts), straight to its
//       final row in each destination's recv_* buffers; the rows for this rank
//       itself go straight into the XLA outputs instead (no second copy).
//       After each remote row: __syncwarp, then one red.release.sys add of 1
//       to the receiver's chunk_arrived[me][c], c = (row - first row of this
//       rank there) / kHtChunkRows.
//     receivers (the last blocks, about a third): for every chunk of rows
//       from another source below the capacity, one thread waits (bounded)
//       until chunk_arrived[s][c] equals the chunk's row count (known from
//       the count exchange), resets it to 0, and the block copies those rows
//       into the XLA outputs, while the other chunks are still in flight;
//       then zero-fill the padding. Every block counts tokens per local
//       expert of the rows it placed. The last block writes num_tokens.
//     Senders never wait, so no block waits for one of its own kernel.
// Buffer reuse:
//   * recv_*/chunk_arrived: a peer writes them for the next dispatch only after
//     this rank's notify flag of that dispatch, which this rank sends after it
//     finished copying out (and resetting the counters of) this one (stream
//     order).
//   * counts/notify_flags alternate by the parity p of seq. A peer publishes
//     its counts for dispatch n+1 without any handshake, and it may get there
//     while this rank is still in notify n: a peer that receives no rows from
//     this rank never waits for this rank's sends. It can publish into parity p
//     again (dispatch n+2) only after notify n+1 saw this rank's flag n+1, which
//     this rank sends after it finished notify n.
//
// combine = two kernels:
//   ht_combine_send: received row i (source s != me, token t) goes to s's
//     combine_recv[p][me][t] (p = seq parity); then every thread fences and
//     the last block sets combine_flags[p][me] = seq on every rank. Rows
//     whose source is this rank stay where they are, in y.
//   ht_combine_recv: waits for every rank's combine flag; out[t] = sum over
//     ranks r with send_row[t][r] >= 0 of combine_recv[p][r][t] (r != me) or
//     y[send_row[t][me]] (r == me), in fp32, in rank order.
// A combine sends without a handshake, so its buffers alternate by parity: a
// peer can write parity p again two combines later only after receiving this
// rank's rows of the combine in between, sent after this rank read parity p.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// Profiling hooks (JAX_EP_PROFILE=1; no-ops when ctx.profile is null). Slots:
// ep_types.h DeviceProfile. A role's time runs from block 0's start to the
// latest end among the role's blocks; the last block of the call closes it.
constexpr int kProfNotify = 4, kProfDispatchSend = 5, kProfDispatchRecv = 6,
              kProfCombineSend = 7, kProfCombineRecv = 8;

// `after`: the slot whose last end precedes this kernel on the stream (its
// gap_ns gets this start minus that end), or -1.
__device__ __forceinline__ void ht_profile_start(const HtContext& ctx, int k, int after = -1) {
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    const uint64_t now = global_timer_ns();
    ctx.profile->start[k] = now;
    if (after >= 0) {
      const uint64_t before = ctx.profile->end[after];
      if (before != 0 && before < now) ctx.profile->gap_ns[k] += now - before;
    }
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
// One thread of the call's last block, after every block's role_end.
__device__ __forceinline__ void ht_profile_close(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr) {
    DeviceProfile* p = ctx.profile;
    if (p->role_end[k] > p->start[k]) p->total_ns[k] += p->role_end[k] - p->start[k];
    p->end[k] = max(p->role_end[k], global_timer_ns());
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

// Rank bit of one top-k entry (0 for -1); counts entries outside [-1, E).
__device__ __forceinline__ uint32_t entry_rank_bit(int e, int num_experts, int experts_per_rank,
                                                   int* invalid) {
  if (e >= 0 && e < num_experts) return 1u << (e / experts_per_rank);
  if (e != -1) ++*invalid;
  return 0u;
}

// Bitmask of the ranks token t goes to (a token counts once per rank).
__device__ __forceinline__ uint32_t token_ranks(const int32_t* topk, int num_topk, int num_experts,
                                                int experts_per_rank, int* invalid) {
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    mask |= entry_rank_bit(topk[k], num_experts, experts_per_rank, invalid);
  }
  return mask;
}

// Dynamic shared memory of ht_notify: one rank mask per token, up to this size
// (beyond it the masks are recomputed from global memory, the slow path).
constexpr size_t kNotifyMaxSmem = 200 * 1024;

__global__ void __launch_bounds__(kNotifyThreads, 1)
    ht_notify(HtContext ctx, const int32_t* __restrict__ topk_idx, int num_tokens, int capacity,
              int32_t* __restrict__ out_send_row, int32_t* __restrict__ out_num_invalid,
              int32_t* __restrict__ out_tokens_per_expert, bool masks_in_smem) {
  extern __shared__ uint32_t s_token_ranks[];  // [num_tokens] when masks_in_smem
  __shared__ int s_warp[kWarpSize][kHtMaxRanks];  // scan scratch
  __shared__ int s_total[kHtMaxRanks];
  __shared__ int s_matrix[kHtMaxRanks][kHtMaxRanks];
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  ht_profile_start(ctx, kProfNotify, kProfDispatchRecv);
  // Parity buffers (see "Buffer reuse" above).
  int32_t* counts = ctx.buffers.counts + (seq & 1) * R * R;
  uint64_t* notify_flags = ctx.buffers.notify_flags + (seq & 1) * R;
  // Contiguous token chunk per thread keeps the per-rank order = token order.
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int t0 = min(num_tokens, static_cast<int>(threadIdx.x) * per_thread);
  const int t1 = min(num_tokens, t0 + per_thread);
  if (threadIdx.x == 0) s_invalid = 0;
  for (int e = threadIdx.x; e < d.experts_per_rank; e += blockDim.x) out_tokens_per_expert[e] = 0;
  int invalid = 0;
  if (masks_in_smem) {
    // Every token's rank mask, from coalesced loads all in flight at once
    // (the per-token loop below would wait for one load at a time).
    for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) s_token_ranks[t] = 0u;
    __syncthreads();
    const int num_entries = num_tokens * d.num_topk;
    if (d.num_topk % 4 == 0 && reinterpret_cast<uintptr_t>(topk_idx) % 16 == 0) {
      // Four entries of one token per 16-byte load.
      constexpr int kBatch = 8;
      const int4* entries = reinterpret_cast<const int4*>(topk_idx);
      const int num_vec = num_entries / 4;
      for (int base = threadIdx.x; base < num_vec; base += kBatch * blockDim.x) {
        int4 four[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * static_cast<int>(blockDim.x);
          four[u] = v < num_vec ? __ldg(entries + v) : make_int4(-1, -1, -1, -1);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * static_cast<int>(blockDim.x);
          const uint32_t mask =
              entry_rank_bit(four[u].x, d.num_experts, d.experts_per_rank, &invalid) |
              entry_rank_bit(four[u].y, d.num_experts, d.experts_per_rank, &invalid) |
              entry_rank_bit(four[u].z, d.num_experts, d.experts_per_rank, &invalid) |
              entry_rank_bit(four[u].w, d.num_experts, d.experts_per_rank, &invalid);
          if (mask != 0u) atomicOr(s_token_ranks + (4 * v) / d.num_topk, mask);
        }
      }
    } else {
#pragma unroll 8
      for (int i = threadIdx.x; i < num_entries; i += blockDim.x) {
        const uint32_t bit = entry_rank_bit(__ldg(topk_idx + i), d.num_experts,
                                            d.experts_per_rank, &invalid);
        if (bit != 0u) atomicOr(s_token_ranks + i / d.num_topk, bit);
      }
    }
    __syncthreads();
  }
  // Ranks of token t (the slow path counts invalid entries here instead).
  auto ranks_of = [&](int t, int* invalid_count) {
    return masks_in_smem ? s_token_ranks[t]
                         : token_ranks(topk_idx + t * d.num_topk, d.num_topk, d.num_experts,
                                       d.experts_per_rank, invalid_count);
  };
  int running[kHtMaxRanks] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int t = t0; t < t1; ++t) {
    const uint32_t mask = ranks_of(t, &invalid);
#pragma unroll
    for (int r = 0; r < kHtMaxRanks; ++r) running[r] += (mask >> r) & 1u;
  }
  __syncthreads();  // s_invalid initialised
  if (invalid) atomicAdd(&s_invalid, invalid);
  // running[r] becomes this thread's first row among this rank's rows for r.
  block_exclusive_scan(running, s_warp, s_total);
  // Publish this rank's row of the count matrix to every rank, then its flag.
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    int32_t* row_local = counts + d.rank * R;
    auto* row = static_cast<int32_t*>(transport::peer_ptr(row_local, r));
    for (int j = 0; j < R; ++j) row[j] = s_total[j];
    auto* flag = static_cast<uint64_t*>(transport::peer_ptr(notify_flags + d.rank, r));
    __threadfence_system();
    st_release_sys(flag, make_flag(seq, 1));
  }
  // Wait for every source's row.
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
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    ht_profile_wait(ctx, kProfNotify, global_timer_ns() - ctx.profile->start[kProfNotify]);
  }
  if (threadIdx.x == 0) {
    HtPlan* plan = ctx.plan;
    int prefix = 0;
    for (int s = 0; s < R; ++s) {
      plan->recv_prefix[s] = prefix;
      plan->recv_count[s] = s_matrix[s][d.rank];
      prefix += s_matrix[s][d.rank];
    }
    plan->recv_prefix[R] = prefix;
    for (int r = 0; r < R; ++r) {
      int offset = 0;
      for (int s = 0; s < d.rank; ++s) offset += s_matrix[s][r];
      plan->row_offset[r] = offset;
      s_total[r] = offset;  // reused: row offset on receiver r
    }
    *out_num_invalid = s_invalid;
  }
  __syncthreads();
  for (int t = t0; t < t1; ++t) {
    int dummy = 0;
    const uint32_t mask = ranks_of(t, &dummy);
    for (int r = 0; r < R; ++r) {
      int row = -1;
      if ((mask >> r) & 1u) {
        row = s_total[r] + running[r]++;
        if (row >= capacity) row = -1;
      }
      out_send_row[t * R + r] = row;
    }
  }
  __syncthreads();
  ht_profile_role_end(ctx, kProfNotify);
  if (threadIdx.x == 0) ht_profile_close(ctx, kProfNotify);
}

// Counts each local expert of a row once (first occurrence among the lanes
// < num_topk holding it); `local` is the lane's local expert or -1.
__device__ __forceinline__ void count_row_experts(int local, int num_topk, int* s_tpe, int lane) {
  bool first = local >= 0;
  for (int j = 0; j < num_topk; ++j) {
    const int other = __shfl_sync(0xffffffffu, local, j);
    if (j < lane && other == local) first = false;
  }
  if (first && local < 1024) atomicAdd(&s_tpe[local], 1);
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

template <bool kHasScales>
__device__ __forceinline__ void dispatch_send_role(const HtContext& ctx, const HtDispatchArgs& args,
                                                   int send_block, int num_send_blocks,
                                                   int* s_tpe, const int* s_row_offset) {
  // Where rows for rank r go: r's recv_x, or this rank's XLA output for r == me.
  __shared__ char* s_dst_x[kHtMaxRanks];
  __shared__ size_t s_dst_stride[kHtMaxRanks];
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const HtBuffers& b = ctx.buffers;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  const int scale_words = kHasScales ? static_cast<int>(args.scale_bytes / 4) : 0;
  // 16-byte vectors per lane per load batch (16 was measured no faster for
  // BF16 and slower for FP8 in sessions 4 and 5).
  constexpr int kUnroll = 8;
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    const bool self = r == d.rank;
    s_dst_x[r] = self ? static_cast<char*>(args.out_x)
                      : static_cast<char*>(transport::peer_ptr(b.recv_x, r));
    s_dst_stride[r] = self ? args.row_bytes : b.row_bytes;
  }
  __syncthreads();
  for (int t = send_block * kWarps + warp; t < args.num_tokens; t += num_send_blocks * kWarps) {
    // Every load of token t goes out before its first store: its row on each
    // rank (lane r), its top-k and weights (lane k), its scales and the first
    // batch of its row. One dependent load round trip per token, not one per
    // destination and field (the per-row cost the session-3 token sweep saw).
    const int my_row = lane < R ? __ldg(args.out_send_row + t * R + lane) : -1;
    const int expert = lane < d.num_topk ? __ldg(args.topk_idx + t * d.num_topk + lane) : -1;
    const float weight =
        lane < d.num_topk ? __ldg(args.topk_weights + t * d.num_topk + lane) : 0.0f;
    const uint32_t* src_scales = nullptr;
    uint32_t scales[kScaleWordsPerLane];
    if constexpr (kHasScales) {
      src_scales = reinterpret_cast<const uint32_t*>(static_cast<const char*>(args.scales) +
                                                     static_cast<size_t>(t) * args.scale_bytes);
      load_scale_words(scales, src_scales, scale_words, lane);
    }
    const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) +
                                                    static_cast<size_t>(t) * args.row_bytes);
    // Each batch of the row is loaded once and stored to every destination.
    for (int base = 0; base < num_vec; base += kUnroll * kWarpSize) {
      int4 batch[kUnroll];
      warp_load_batch(batch, src, base, num_vec, lane);
      for (int r = 0; r < R; ++r) {
        const int row = __shfl_sync(0xffffffffu, my_row, r);
        if (row < 0) continue;
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
        void* dst_scales = self ? args.out_scales : transport::peer_ptr(b.recv_scales, r);
        store_scale_words(reinterpret_cast<uint32_t*>(static_cast<char*>(dst_scales) +
                                                      static_cast<size_t>(row) * args.scale_bytes),
                          scales, src_scales, scale_words, lane);
      }
      int local = -1;
      if (lane < d.num_topk) {
        const bool mine = expert >= 0 && expert < d.num_experts && expert / d.experts_per_rank == r;
        local = mine ? expert - r * d.experts_per_rank : -1;
        auto* idx = self ? args.out_idx : static_cast<int32_t*>(transport::peer_ptr(b.recv_idx, r));
        auto* w = self ? args.out_w : static_cast<float*>(transport::peer_ptr(b.recv_w, r));
        idx[row * d.num_topk + lane] = local;
        w[row * d.num_topk + lane] = mine ? weight : 0.0f;
      }
      if (self) {
        if (lane == 0) args.out_recv_src[row] = d.rank * args.num_tokens + t;
        count_row_experts(local, d.num_topk, s_tpe, lane);
      } else {
        if (lane == 0) static_cast<int32_t*>(transport::peer_ptr(b.recv_src, r))[row] = t;
        __syncwarp();  // every lane's stores of this row come before the release below
        if (lane == 0) {
          const int chunk = (row - s_row_offset[r]) / kHtChunkRows;
          red_add_release_sys(static_cast<uint32_t*>(transport::peer_ptr(
                                  b.chunk_arrived + d.rank * b.chunks_per_source + chunk, r)),
                              1u);
        }
      }
    }
  }
}

// Rows of a chunk per warp (their top-k, weights, source and scales).
constexpr int kRowsPerWarp = kHtChunkRows / kWarps;
static_assert(kHtChunkRows % kWarps == 0, "a chunk's rows split evenly over the warps");

// Returns the time thread 0 spent waiting for chunks (profiling only; else 0).
template <bool kHasScales>
__device__ __forceinline__ uint64_t dispatch_recv_role(const HtContext& ctx,
                                                       const HtDispatchArgs& args, int recv_block,
                                                       int num_recv_blocks, int* s_tpe,
                                                       const int* s_prefix, int kept) {
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
  for (int item = recv_block; item < total_chunks; item += num_recv_blocks) {
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
    int meta_idx[kRowsPerWarp], meta_src[kRowsPerWarp];
    float meta_w[kRowsPerWarp];
    uint32_t meta_scales[kRowsPerWarp][kScaleWordsPerLane];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int row = first + warp + j * kWarps;
      meta_idx[j] = -1;
      meta_w[j] = 0.0f;
      meta_src[j] = 0;
      if (row < last) {
        if (lane < d.num_topk) {
          meta_idx[j] = b.recv_idx[row * d.num_topk + lane];
          meta_w[j] = b.recv_w[row * d.num_topk + lane];
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
      // 16 vectors per lane in flight (128 KB per SM): the copy-out is bound
      // by load latency, as the combine receive was. Coherent loads: a peer
      // wrote the row during this kernel, published by the chunk counter
      // thread 0 acquired before the block barrier.
      warp_copy<16, /*kCoherent=*/true>(
          reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                  static_cast<size_t>(row) * args.row_bytes),
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
  // Padding rows [kept, capacity).
  for (int row = kept + recv_block * kWarps + warp; row < args.capacity;
       row += num_recv_blocks * kWarps) {
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                        static_cast<size_t>(row) * args.row_bytes);
    for (int v = lane; v < num_vec; v += kWarpSize) dst[v] = make_int4(0, 0, 0, 0);
    if constexpr (kHasScales) {
      auto* scales = reinterpret_cast<uint32_t*>(static_cast<char*>(args.out_scales) +
                                                 static_cast<size_t>(row) * args.scale_bytes);
      for (int i = lane; i < static_cast<int>(args.scale_bytes / 4); i += kWarpSize) scales[i] = 0u;
    }
    if (lane < d.num_topk) {
      args.out_idx[row * d.num_topk + lane] = -1;
      args.out_w[row * d.num_topk + lane] = 0.0f;
    }
    if (lane == 0) args.out_recv_src[row] = -1;
  }
  return waited_ns;
}

template <bool kHasScales>
__global__ void __launch_bounds__(kThreads, 1)
    ht_dispatch(HtContext ctx, HtDispatchArgs args, int num_send_blocks) {
  __shared__ int s_prefix[kHtMaxRanks + 1];
  __shared__ int s_row_offset[kHtMaxRanks];
  __shared__ int s_tpe[1024];
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  ht_profile_start(ctx, kProfDispatchSend, kProfNotify);
  ht_profile_start(ctx, kProfDispatchRecv);
  uint64_t waited_ns = 0;  // thread 0 of a receiver block (profiling)
  for (int i = threadIdx.x; i <= R; i += blockDim.x) s_prefix[i] = ctx.plan->recv_prefix[i];
  for (int r = threadIdx.x; r < R; r += blockDim.x) s_row_offset[r] = ctx.plan->row_offset[r];
  for (int e = threadIdx.x; e < d.experts_per_rank && e < 1024; e += blockDim.x) s_tpe[e] = 0;
  __syncthreads();
  const int received = s_prefix[R];
  const int kept = min(received, args.capacity);
  // With a single block, it sends first and then receives.
  const bool single = gridDim.x == 1;
  if (single || static_cast<int>(blockIdx.x) < num_send_blocks) {
    dispatch_send_role<kHasScales>(ctx, args, blockIdx.x, num_send_blocks, s_tpe, s_row_offset);
  }
  if (single || static_cast<int>(blockIdx.x) >= num_send_blocks) {
    const int recv_block = single ? 0 : blockIdx.x - num_send_blocks;
    const int num_recv_blocks = single ? 1 : gridDim.x - num_send_blocks;
    waited_ns = dispatch_recv_role<kHasScales>(ctx, args, recv_block, num_recv_blocks, s_tpe,
                                               s_prefix, kept);
  }
  __syncthreads();
  if (single || static_cast<int>(blockIdx.x) >= num_send_blocks) {
    ht_profile_wait(ctx, kProfDispatchRecv, waited_ns);
    ht_profile_role_end(ctx, kProfDispatchRecv);
  } else {
    ht_profile_role_end(ctx, kProfDispatchSend);
  }
  for (int e = threadIdx.x; e < d.experts_per_rank && e < 1024; e += blockDim.x) {
    if (s_tpe[e]) atomicAdd(args.out_tokens_per_expert + e, s_tpe[e]);
  }
  if (arrive_is_last_block(&ctx.counters->ht_dispatch_done) && threadIdx.x == 0) {
    *args.out_num_tokens = kept;
    *args.out_num_dropped = received - kept;
    ctx.counters->ht_dispatch_seq = seq;
    ht_profile_close(ctx, kProfDispatchSend);
    ht_profile_close(ctx, kProfDispatchRecv);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_send(HtContext ctx, HtCombineArgs args) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  ht_profile_start(ctx, kProfCombineSend);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int valid = min(*args.num_tokens, args.capacity);
  for (int i = blockIdx.x * kWarps + warp; i < valid; i += gridDim.x * kWarps) {
    const int src = args.recv_src[i];
    if (src < 0 || args.num_local_tokens <= 0) continue;
    const int s = src / args.num_local_tokens, t = src % args.num_local_tokens;
    if (s >= R || s == d.rank) continue;  // own rows are read from y by ht_combine_recv
    char* dst = static_cast<char*>(transport::peer_ptr(recv_base, s)) +
                (static_cast<size_t>(d.rank) * d.max_tokens + t) * row_bytes;
    warp_copy(reinterpret_cast<int4*>(dst),
              reinterpret_cast<const int4*>(static_cast<const char*>(args.y) + i * row_bytes),
              static_cast<int>(row_bytes / 16), lane);
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
                                                      const char* recv_base, int row, int r,
                                                      int t, int valid, size_t row_bytes) {
  if (row < 0) return nullptr;
  if (r == ctx.dims.rank) {
    if (row >= valid) return nullptr;
    return reinterpret_cast<const int4*>(static_cast<const char*>(args.y) +
                                         static_cast<size_t>(row) * row_bytes);
  }
  return reinterpret_cast<const int4*>(
      recv_base + (static_cast<size_t>(r) * ctx.dims.max_tokens + t) * row_bytes);
}

// kTwoSources (R <= 2): both ranks' loads are in flight together and summed
// without an accumulator array, which leaves registers for twice the bytes in
// flight per SM (the sum is bound by load latency, by Little's law: about
// 64 KB in flight per SM gave 1.5 TB/s at 24 SMs). Sums run in rank order from
// 0.0f either way, so both paths give the same bits.
template <bool kTwoSources>
__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_recv(HtContext ctx, HtCombineArgs args) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  ht_profile_start(ctx, kProfCombineRecv);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    wait_flag(flags + r, seq, ctx.timeout_ns, ctx.status, kOpHtCombine, r, 0);
  }
  __syncthreads();
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    ht_profile_wait(ctx, kProfCombineRecv,
                    global_timer_ns() - ctx.profile->start[kProfCombineRecv]);
  }
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;
  const int valid = min(*args.num_tokens, args.capacity);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  // One warp per token; kBatch independent 16-byte loads per lane and source
  // in flight.
  constexpr int kBatch = 8;
  for (int t = blockIdx.x * kWarps + warp; t < args.num_local_tokens; t += gridDim.x * kWarps) {
    const int my_row = lane < R ? args.send_row[t * R + lane] : -1;
    int4* out_row = reinterpret_cast<int4*>(static_cast<char*>(args.out) +
                                            static_cast<size_t>(t) * row_bytes);
    if constexpr (kTwoSources) {
      const int4* src0 = combine_source(ctx, args, recv_base, __shfl_sync(0xffffffffu, my_row, 0),
                                        0, t, valid, row_bytes);
      const int4* src1 =
          R > 1 ? combine_source(ctx, args, recv_base, __shfl_sync(0xffffffffu, my_row, 1), 1, t,
                                 valid, row_bytes)
                : nullptr;
      for (int base = 0; base < num_vec; base += kBatch * kWarpSize) {
        int4 raw0[kBatch], raw1[kBatch];
        if (src0 != nullptr) warp_load_batch(raw0, src0, base, num_vec, lane);
        if (src1 != nullptr) warp_load_batch(raw1, src1, base, num_vec, lane);
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * kWarpSize + lane;
          if (v >= num_vec) continue;
          const __nv_bfloat16* vals0 = reinterpret_cast<const __nv_bfloat16*>(&raw0[u]);
          const __nv_bfloat16* vals1 = reinterpret_cast<const __nv_bfloat16*>(&raw1[u]);
          int4 packed;
          __nv_bfloat16* outv = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            float sum = 0.0f;
            if (src0 != nullptr) sum += __bfloat162float(vals0[j]);
            if (src1 != nullptr) sum += __bfloat162float(vals1[j]);
            outv[j] = __float2bfloat16_rn(sum);
          }
          out_row[v] = packed;
        }
      }
    } else {
      for (int base = 0; base < num_vec; base += kBatch * kWarpSize) {
        float acc[kBatch][8];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
        }
        for (int r = 0; r < R; ++r) {
          const int4* src = combine_source(ctx, args, recv_base,
                                           __shfl_sync(0xffffffffu, my_row, r), r, t, valid,
                                           row_bytes);
          if (src == nullptr) continue;
          int4 raw[kBatch];
          warp_load_batch(raw, src, base, num_vec, lane);
#pragma unroll
          for (int u = 0; u < kBatch; ++u) {
            const __nv_bfloat16* vals = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[u][j] += __bfloat162float(vals[j]);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int v = base + u * kWarpSize + lane;
          if (v >= num_vec) continue;
          int4 packed;
          __nv_bfloat16* outv = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
          for (int j = 0; j < 8; ++j) outv[j] = __float2bfloat16_rn(acc[u][j]);
          out_row[v] = packed;
        }
      }
    }
  }
  if (arrive_is_last_block(&ctx.counters->ht_combine_recv_done) && threadIdx.x == 0) {
    ctx.counters->ht_combine_seq = seq;
    ht_profile_role_end(ctx, kProfCombineRecv);
    ht_profile_close(ctx, kProfCombineRecv);
  }
}

}  // namespace

cudaError_t LaunchHtDispatch(const HtContext& ctx, const HtDispatchArgs& args,
                             cudaStream_t stream) {
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.experts_per_rank > 1024 ||
      args.row_bytes % 16 != 0 || args.row_bytes > ctx.buffers.row_bytes ||
      ctx.dims.num_topk > kWarpSize) {
    return cudaErrorInvalidValue;
  }
  const size_t mask_bytes = sizeof(uint32_t) * static_cast<size_t>(args.num_tokens);
  const bool masks_in_smem = mask_bytes <= kNotifyMaxSmem;
  ht_notify<<<1, kNotifyThreads, masks_in_smem ? mask_bytes : 0, stream>>>(
      ctx, args.topk_idx, args.num_tokens, args.capacity, args.out_send_row,
      args.out_num_invalid, args.out_tokens_per_expert, masks_in_smem);
  // One SM budget for both roles: about a third of the blocks receive.
  const int grid = std::max(1, ctx.num_sms);
  // ctx.recv_divisor (3; JAX_EP_HT_RECV_DIVISOR, an experiment) sets the
  // share of receiver blocks: grid / divisor.
  const int num_send_blocks =
      grid == 1 ? 1 : grid - std::max(1, grid / std::max(2, ctx.recv_divisor));
  if (args.scales != nullptr) {
    ht_dispatch<true><<<grid, kThreads, 0, stream>>>(ctx, args, num_send_blocks);
  } else {
    ht_dispatch<false><<<grid, kThreads, 0, stream>>>(ctx, args, num_send_blocks);
  }
  return cudaGetLastError();
}

cudaError_t LaunchHtCombine(const HtContext& ctx, const HtCombineArgs& args, cudaStream_t stream) {
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.hidden % 8 != 0) return cudaErrorInvalidValue;
  const int grid = std::max(1, ctx.num_sms);
  ht_combine_send<<<grid, kThreads, 0, stream>>>(ctx, args);
  if (ctx.dims.num_ranks <= 2) {
    ht_combine_recv<true><<<grid, kThreads, 0, stream>>>(ctx, args);
  } else {
    ht_combine_recv<false><<<grid, kThreads, 0, stream>>>(ctx, args);
  }
  return cudaGetLastError();
}

cudaError_t PrepareHtKernels() {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaFuncSetAttribute(ht_notify, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kNotifyMaxSmem));
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_notify);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_dispatch<true>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_dispatch<false>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_send);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_recv<true>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_recv<false>);
  return err;
}

}  // namespace jax_ep::cuda
