// The HT dispatch's two roles (ht_dispatch.cu; protocol steps 3-4 of
// docs/design.md, "HT protocol"): senders store rows straight to their final
// rows on each peer and publish them by chunk counters; receivers take chunks
// by ticket, wait for their rows and copy them out. Included by ht_dispatch.cu
// alone.
#ifndef JAX_EP_CUDA_HT_DISPATCH_ROLES_CUH_
#define JAX_EP_CUDA_HT_DISPATCH_ROLES_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_dispatch_pairs.cuh"
#include "cuda/ht_dispatch_plan.cuh"
#include "cuda/ht_row_elements.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

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

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_DISPATCH_ROLES_CUH_
