// The LL dispatch's receive part (ll_dispatch.cu; step 4 of docs/design.md,
// "LL protocol"): wait for every (expert, source) flag and copy the rows out
// in (source rank, source token) order; and at one rank the dispatch that
// asks the routing only for each block's token and experts (no table).
// Included by ll_dispatch.cu alone.
#ifndef JAX_EP_CUDA_LL_DISPATCH_RECV_CUH_
#define JAX_EP_CUDA_LL_DISPATCH_RECV_CUH_

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ll_common.cuh"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"
#include "cuda/ll_dispatch_send.cuh"

namespace jax_ep::cuda {
namespace {

// rows past count get source -1 and weight 0, pairs land in token order.
constexpr int kQueryTopk = 8;     // K at most, for this path
constexpr int kQueryExperts = 4;  // experts per block at most (E <= 528 at 132 blocks)
constexpr int kQueryWarps = kThreads / kWarpSize;
constexpr int kQueries = kQueryTopk + kQueryExperts;
constexpr int kQueryWords = kQueries / 4;  // 8-bit answer fields, 4 per word
static_assert(kQueries % 4 == 0 && kQueryWords + 1 == 4, "the answers and invalid: one int4");

__host__ __device__ constexpr bool OneRankQueryFits(int num_tokens, int num_topk,
                                                    int num_experts, int grid) {
  return num_tokens <= grid && num_tokens <= 255 && num_tokens <= kThreads &&
         num_topk <= kQueryTopk && (num_experts + grid - 1) / grid <= kQueryExperts;
}

// A token's K entries (padded with -1 to kQueryTopk), or all -1 past the batch.
__device__ __forceinline__ void load_query_entries(const int32_t* topk_idx, int t, int num_tokens,
                                                   int num_topk, bool vector_idx,
                                                   int (&entries)[kQueryTopk]) {
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) entries[k] = -1;
  if (t < num_tokens) load_token_entries(topk_idx, t, num_topk, vector_idx, entries);
}

// The entries a token keeps: valid and the first naming their expert; -1 else.
__device__ __forceinline__ void kept_entries(const int (&entries)[kQueryTopk], int num_experts,
                                             int (&kept)[kQueryTopk]) {
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) {
    bool keep = valid_expert(entries[k], num_experts);
#pragma unroll
    for (int j = 0; j < k; ++j) keep &= entries[j] != entries[k];
    kept[k] = keep ? entries[k] : -1;
    // Opaque to the compiler, so that it computes `kept` once, here, instead
    // of again inside every question's branch (it did, 2026-12-02: about 70
    // instructions per question).
    asm volatile("" : "+r"(kept[k]));
  }
}

// Whether a token with these kept entries keeps `expert` (>= 0).
__device__ __forceinline__ uint32_t keeps(const int (&kept)[kQueryTopk], int expert) {
  uint32_t found = 0u;
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) found |= static_cast<uint32_t>(kept[k] == expert);
  return found;
}

// Answer q's field of the warps' summed words.
__device__ __forceinline__ int answer(const uint4& sums, int q) {
  const uint32_t word = q / 4 == 0 ? sums.x : q / 4 == 1 ? sums.y : sums.z;
  return static_cast<int>((word >> (8 * (q % 4))) & 0xffu);
}

// Returns whether the call is void (a split send awaits its receive).
template <bool kFp8>
__device__ __forceinline__ bool dispatch_single_rank_by_queries(const LlContext& ctx,
                                                                const LlDispatchArgs& args) {
  __shared__ uint4 s_warp_words[kQueryWarps];  // per warp: 3 answer words, invalid
  __shared__ uint32_t s_void_call, s_rank_masked;
  const EpDims d = ctx.dims;
  const int num_topk = d.num_topk, num_experts = d.num_experts;
  const int num_tokens = args.num_tokens;
  const int rows_per_expert = d.ll_max_tokens;  // R * T_ll, R = 1
  const int grid = gridDim.x, b = blockIdx.x;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const auto* __restrict__ x = static_cast<const __nv_bfloat16*>(args.x);
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  auto token_row = [&](int t) {
    return reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * d.hidden);
  };
  // The loads go out together: this thread's token's entries, the block's
  // token's entries (broadcast), and thread 0's pairing word and rank mask.
  // Plain loads: nothing in this kernel writes those words, and they were
  // written before it (by the host or by earlier kernels). Strong
  // system-scope loads of them cost 0.05 us per no-rows launch (3.14 against
  // 3.09 us, 2026-12-02, docs/benchmarks.md).
  const bool vector_idx =
      num_topk % 4 == 0 && (reinterpret_cast<uintptr_t>(topk_idx) & 15u) == 0;
  int entries[kQueryTopk], asked[kQueryTopk];
  load_query_entries(topk_idx, threadIdx.x, num_tokens, num_topk, vector_idx, entries);
  load_query_entries(topk_idx, b, num_tokens, num_topk, vector_idx, asked);
  uint32_t void_word = 0u, mask_word = 0u;
  if (threadIdx.x == 0) {
    void_word = ctx.counters->ll_dispatch_outstanding;
    if (ctx.masked != nullptr) mask_word = *ctx.masked;
  }
  // Only warps with a valid entry ask (the others' answers are 0), only
  // those holding a token before b ask for rows, and only for a token that
  // sends something. The questions have no branch between them (bitwise &,
  // not ?: or &&, which the compiler made into one branch per question,
  // 2026-12-02), so their compares overlap; then one reduction per word.
  uint32_t words[kQueryWords + 1] = {};
  uint32_t any_valid = 0u, any_asked = 0u;
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) {
    any_valid |= static_cast<uint32_t>(valid_expert(entries[k], num_experts));
    any_asked |= static_cast<uint32_t>(valid_expert(asked[k], num_experts));
  }
  // The token's row, only when it goes somewhere (a masked rank is known only
  // after the barrier), now that its entries are here. Loaded at the start of
  // every block, its 14 KB per block cost a no-rows launch 0.1 us (3.25 ->
  // 3.14 us; not loading it at all: 3.06, 2026-12-02, docs/benchmarks.md).
  RoundPieces<kFp8> pieces;
  if (any_asked != 0u) pieces = load_pieces<kFp8>(token_row(b), 0, d.hidden);
  if (__any_sync(0xffffffffu, any_valid != 0u)) {
    int kept[kQueryTopk];
    kept_entries(entries, num_experts, kept);
    if (warp * kWarpSize < b && any_asked != 0u) {
      const uint32_t before = static_cast<int>(threadIdx.x) < b ? 1u : 0u;
#pragma unroll
      for (int k = 0; k < kQueryTopk; ++k) {  // asked[k] = -1 past K
        const uint32_t hit = before & static_cast<uint32_t>(asked[k] >= 0) & keeps(kept, asked[k]);
        words[k / 4] |= hit << (8 * (k % 4));
      }
    }
#pragma unroll
    for (int j = 0; j < kQueryExperts; ++j) {
      const int e = b + j * grid;
      const uint32_t hit = static_cast<uint32_t>(e < num_experts) & keeps(kept, e);
      words[(kQueryTopk + j) / 4] |= hit << (8 * ((kQueryTopk + j) % 4));
    }
#pragma unroll
    for (int w = 0; w < kQueryWords; ++w) words[w] = __reduce_add_sync(0xffffffffu, words[w]);
  }
  if (b == 0) {
#pragma unroll
    for (int k = 0; k < kQueryTopk; ++k) {
      words[kQueryWords] += static_cast<uint32_t>(k < num_topk) &
                            static_cast<uint32_t>(entries[k] < -1 || entries[k] >= num_experts);
    }
    words[kQueryWords] = __reduce_add_sync(0xffffffffu, words[kQueryWords]);
  }
  if (lane == 0) s_warp_words[warp] = make_uint4(words[0], words[1], words[2], words[3]);
  if (threadIdx.x == 0) {
    s_void_call = void_word;
    s_rank_masked = mask_word;
  }
  __syncthreads();
  uint4 sums = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int w = 0; w < kQueryWarps; ++w) {
    const uint4 v = s_warp_words[w];
    sums.x += v.x;
    sums.y += v.y;
    sums.z += v.z;
    sums.w += v.w;
  }
  const bool masked = s_rank_masked != 0u, void_call = s_void_call != 0u;
  if (b == 0 && threadIdx.x == 0 && args.num_invalid != nullptr) {
    *args.num_invalid = static_cast<int>(sums.w);
  }
  // The block's experts: count, then the rows past it (a rolled loop: less
  // code to run past, see below).
#pragma unroll 1
  for (int j = 0; j < kQueryExperts; ++j) {
    const int e = b + j * grid;
    if (e < num_experts) {
      const int count = masked ? 0 : answer(sums, kQueryTopk + j);
      if (threadIdx.x == 0) args.out_count[e] = void_call ? -1 : count;
      for (int row = count + threadIdx.x; row < rows_per_expert; row += blockDim.x) {
        const size_t out_row = static_cast<size_t>(e) * rows_per_expert + row;
        args.out_recv_src[out_row] = -1;
        if (args.out_weights != nullptr) args.out_weights[out_row] = 0.0f;
      }
    }
  }
  // A token that sends nothing stops here. Run with no pair, the code below
  // (unrolled per pair, every part behind a branch) took thread 0 0.9 us of
  // a no-rows launch; stopping here cut the launch 3.12 -> 2.43 us
  // (2026-12-02, docs/benchmarks.md). Why so long is not placed.
  if (b >= num_tokens || masked || any_asked == 0u) return void_call;
  // The block's token: each kept pair's output row.
  int asked_kept[kQueryTopk];
  kept_entries(asked, num_experts, asked_kept);
  size_t out_rows[kQueryTopk];
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) {
    out_rows[k] = asked_kept[k] >= 0 ? static_cast<size_t>(asked_kept[k]) * rows_per_expert +
                                           answer(sums, k)
                                     : 0;
  }
#pragma unroll
  for (int k = 0; k < kQueryTopk; ++k) {
    if (asked_kept[k] >= 0 && static_cast<int>(threadIdx.x) == k) {
      args.out_recv_src[out_rows[k]] = b;  // source rank 0
      if (args.out_weights != nullptr) {
        args.out_weights[out_rows[k]] =
            pair_weight(topk_idx, args.topk_weights, b, k, asked_kept[k], num_topk);
      }
    }
  }
  const int4* row = token_row(b);
  for (int c0 = 0; c0 < d.hidden; c0 += kChannelsPerRound) {
    if (c0 > 0) pieces = load_pieces<kFp8>(row, c0, d.hidden);
#pragma unroll
    for (int k = 0; k < kQueryTopk; ++k) {
      if (asked_kept[k] < 0) continue;
      if constexpr (kFp8) {
        store_pieces_to<kFp8>(
            reinterpret_cast<int4*>(static_cast<uint8_t*>(args.out_x) + out_rows[k] * d.hidden),
            args.out_scales + out_rows[k] * (d.hidden / 128), pieces, c0, d.hidden);
      } else {
        store_pieces_to<kFp8>(reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.out_x) +
                                                      out_rows[k] * d.hidden),
                              nullptr, pieces, c0, d.hidden);
      }
    }
  }
  return void_call;
}

// The receive part's share of this block. With at least as many local experts
// as blocks, block b receives experts b, b + G, b + 2G, ... (G = grid), all
// of them at once: their rows are one flattened list over the block's warps.
// With fewer, each expert is received by G / E_local blocks (splits), which
// all wait for its flags and take every splits-th row of it, so that few
// experts still spread their rows over the GPU.
struct RecvShare {
  int first_expert;   // local expert of the block's first
  int expert_stride;  // between the block's experts
  int num_experts;    // the block's experts (0: none)
  int splits;         // blocks sharing each expert
  int split;          // this block's index among them
};

__device__ __forceinline__ RecvShare recv_share(int experts_per_rank) {
  const int num_blocks = gridDim.x, b = blockIdx.x;
  if (experts_per_rank >= num_blocks) {
    return RecvShare{b, num_blocks, b < experts_per_rank ? (experts_per_rank - 1 - b) / num_blocks + 1
                                                         : 0,
                     1, 0};
  }
  const int splits = num_blocks / experts_per_rank;
  return RecvShare{b % experts_per_rank, experts_per_rank, b < experts_per_rank * splits ? 1 : 0,
                   splits, b / experts_per_rank};
}

// Shared memory of a group of the block's experts received together: each
// expert's R + 1 source offsets, and the flattened list's expert starts.
constexpr int kRecvOffsetInts = 2048;
constexpr int kMaxGroupExperts = 64;

// Bf16 vectors per lane in flight when a receiver copies a row: a whole
// row of hidden 7168 (896 vectors) in one batch.
constexpr int kRowCopyUnroll = 28;

// Returns true if a wait of this block lost data (a fault): the call's
// results are void.
template <bool kFp8, bool kDirectSelf>
__device__ __forceinline__ bool dispatch_recv_part(const LlContext& ctx, uint32_t seq,
                                                   const LlDispatchArgs& args,
                                                   const int* s_masked) {
  __shared__ int s_offsets[kRecvOffsetInts];       // [group expert][R + 1]
  __shared__ int s_starts[kMaxGroupExperts + 1];   // flattened start of each group expert
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const int num_tokens = args.num_tokens;
  void* __restrict__ out_x = args.out_x;
  float* __restrict__ out_scales = args.out_scales;
  int32_t* __restrict__ out_count = args.out_count;
  int32_t* __restrict__ out_recv_src = args.out_recv_src;
  float* __restrict__ out_weights = args.out_weights;
  const auto* __restrict__ x = static_cast<const __nv_bfloat16*>(args.x);
  const char* recv_base = ctx.buffers.dispatch_recv[seq & 1];
  const char* tokens_base = ctx.buffers.dispatch_tokens[seq & 1];
  const uint64_t* flags = ctx.buffers.dispatch_flags[seq & 1];
  const size_t msg_bytes = ctx.buffers.message_bytes;
  const int rows_per_expert = R * d.ll_max_tokens;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  const RecvShare share = recv_share(d.experts_per_rank);
  const int group_size = max(1, min(kMaxGroupExperts, kRecvOffsetInts / (R + 1)));
  bool lost = false;

  for (int g0 = 0; g0 < share.num_experts; g0 += group_size) {
    const int group = min(group_size, share.num_experts - g0);
    auto expert_of = [&](int j) { return share.first_expert + (g0 + j) * share.expert_stride; };
    // Every (expert, source) flag of the group, one thread each: no expert
    // waits for the one before.
    for (int i = threadIdx.x; i < group * R; i += blockDim.x) {
      const int j = i / R, s = i % R, le = expert_of(j);
      const uint32_t n = ll_wait(ctx, s_masked, flags + static_cast<size_t>(le) * R + s, seq,
                                 kOpLlDispatch, s, le);
      if (n == kFlagTimedOut) lost |= wait_lost(ctx, s_masked, s);
      s_offsets[j * (R + 1) + s + 1] =
          n == kFlagTimedOut ? 0 : static_cast<int>(min(n, static_cast<uint32_t>(num_tokens)));
    }
    __syncthreads();
    if (g0 == 0) profile_waited(ctx, 1);
    for (int j = threadIdx.x; j < group; j += blockDim.x) {
      int* offsets = s_offsets + j * (R + 1);
      offsets[0] = 0;
      for (int s = 0; s < R; ++s) offsets[s + 1] += offsets[s];
      if (share.split == 0) out_count[expert_of(j)] = offsets[R];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      s_starts[0] = 0;
      for (int j = 0; j < group; ++j) s_starts[j + 1] = s_starts[j] + s_offsets[j * (R + 1) + R];
    }
    // Rows past count: no source (-1), weight 0; shared by the splits.
    for (int j = 0; j < group; ++j) {
      const size_t base = static_cast<size_t>(expert_of(j)) * rows_per_expert;
      for (int row = s_offsets[j * (R + 1) + R] + share.split * blockDim.x + threadIdx.x;
           row < rows_per_expert; row += share.splits * blockDim.x) {
        out_recv_src[base + row] = -1;
        if (out_weights != nullptr) out_weights[base + row] = 0.0f;
      }
    }
    __syncthreads();
    // One warp per output row, over the group's rows flattened in (expert,
    // source, slot) order.
    const int group_rows = s_starts[group];
    for (int f = share.split * num_warps + warp; f < group_rows; f += share.splits * num_warps) {
      int j = 0, hi = group - 1;  // the last group expert whose rows start at or before f
      while (j < hi) {
        const int mid = (j + hi + 1) / 2;
        if (s_starts[mid] <= f) j = mid; else hi = mid - 1;
      }
      const int le = expert_of(j), row = f - s_starts[j];
      const int* offsets = s_offsets + j * (R + 1);
      int s = 0;  // the last source whose rows start at or before `row`
      hi = R - 1;
      while (s < hi) {
        const int mid = (s + hi + 1) / 2;
        if (offsets[mid] <= row) s = mid; else hi = mid - 1;
      }
      const char* message =
          recv_base + ((static_cast<size_t>(le) * R + s) * d.ll_max_tokens + (row - offsets[s])) *
                          msg_bytes;
      // Every lane reads the header (one broadcast load): it says where the
      // payload is: in this slot (RDMA, y = 0), in the source's token row
      // (NVLink, y = 1) or in this call's x (the rank's own pairs, y = 2).
      const int4 header = ld_v4_no_alloc(reinterpret_cast<const int4*>(message), true);
      const int t = header.x;
      const bool known_token = t >= 0 && t < num_tokens;
      const size_t out_row = static_cast<size_t>(le) * rows_per_expert + row;
      if (lane == 0) {
        out_recv_src[out_row] = known_token ? s * num_tokens + t : -1;
        if (out_weights != nullptr) out_weights[out_row] = known_token ? __int_as_float(header.z) : 0.0f;
      }
      if (!kFp8 && kDirectSelf && header.y == 2 && s == d.rank && known_token) {
        warp_copy<kRowCopyUnroll>(
            reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(out_x) + out_row * d.hidden),
            reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * d.hidden), d.hidden / 8,
            lane);
        continue;
      }
      if (header.y != 0) {  // a bad token index reads token 0's row: in bounds, marked -1
        message = tokens_base +
            (static_cast<size_t>(s) * d.ll_max_tokens + (known_token ? t : 0)) * msg_bytes;
      }
      const int4* payload = reinterpret_cast<const int4*>(message + 16);
      if constexpr (!kFp8) {
        warp_copy<kRowCopyUnroll, /*kCoherent=*/true>(
            reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(out_x) + out_row * d.hidden),
            payload, d.hidden / 8, lane);
      } else {
        warp_copy<16, /*kCoherent=*/true>(
            reinterpret_cast<int4*>(static_cast<uint8_t*>(out_x) + out_row * d.hidden), payload,
            d.hidden / 16, lane);
        const float* scales = reinterpret_cast<const float*>(message + 16 + d.hidden);
        float* scales_out = out_scales + out_row * (d.hidden / 128);
        for (int g = lane; g < d.hidden / 128; g += kWarpSize) scales_out[g] = scales[g];
      }
    }
    __syncthreads();  // s_offsets and s_starts are rewritten for the next group
  }
  return __syncthreads_or(lost);
}

// kParts = kSendPart (split send: ticket_out), kRecvPart (split recv: ticket_in)
// or kBothParts (one-call op, whose own pairs skip dispatch_tokens: kDirectSelf).
// kOneRank (one-call op at one rank): dispatch_single_rank (kOneRankTable) or,
// where OneRankQueryFits, dispatch_single_rank_by_queries (kOneRankQueries)
// instead of both parts.

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LL_DISPATCH_RECV_CUH_
