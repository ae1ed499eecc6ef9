// The LL dispatch's send part (ll_dispatch.cu; steps 1-3 of docs/design.md,
// "LL protocol"): FP8 quantization, the routing pass, the slot rows, headers
// and payloads to each owner, the per-expert completion flags; and at one rank
// the sender that writes the results itself (routing table in shared memory).
// Included by ll_dispatch.cu alone.
#ifndef JAX_EP_CUDA_LL_DISPATCH_SEND_CUH_
#define JAX_EP_CUDA_LL_DISPATCH_SEND_CUH_

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ll_common.cuh"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr float kFp8Max = 448.0f;
constexpr float kMinAmax = 1e-4f;

// 16 channels (two int4 of bf16) -> 16 e4m3 bytes; *scale = the scale of their
// 128-channel group, whose 8 pieces sit on 8 consecutive lanes (lane % 8 = the
// piece's index in the group). All 32 lanes call it together: the group's
// amax is a shuffle over its 8 lanes. The formula of jax_ep/fp8.py.
__device__ __forceinline__ int4 quantize_16(const int4 (&raw)[2], float* scale) {
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(raw);
  float f[16];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    f[j] = __bfloat162float(v[j]);
    amax = fmaxf(amax, fabsf(f[j]));
  }
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset, 8));
  }
  amax = fmaxf(amax, kMinAmax);
  const float scale_inv = kFp8Max / amax;
  uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    __nv_fp8x4_e4m3 four(make_float4(f[4 * j] * scale_inv, f[4 * j + 1] * scale_inv,
                                     f[4 * j + 2] * scale_inv, f[4 * j + 3] * scale_inv));
    packed[j] = *reinterpret_cast<uint32_t*>(&four);
  }
  *scale = amax / kFp8Max;
  return make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]),
                   static_cast<int>(packed[2]), static_cast<int>(packed[3]));
}

// A message is [16-byte header: token id][payload]: the bf16 row, or the fp8
// row then its float32 scales (formula of jax_ep/fp8.py). Every thread owns
// kPiecesPerThread 16-byte pieces of the payload per round of
// kChannelsPerRound channels: it loads them (all loads in flight at once),
// converts them in registers and stores them straight to every destination;
// nothing goes through shared memory.
constexpr int kPiecesPerThread = 4;  // bf16 int4 loads per thread per round
constexpr int kChannelsPerRound = kThreads * kPiecesPerThread * 8;

template <bool kFp8>
struct RoundPieces {
  // bf16: piece u is input vector (round_vec0 + u * kThreads + tid), stored as is.
  // fp8: piece u is 16 channels (task round_task0 + u * kThreads + tid) as 16 fp8
  //      bytes; scale[u] is its 128-channel group's scale (written by sub-lane 0).
  int4 data[kFp8 ? kPiecesPerThread / 2 : kPiecesPerThread];
  float scale[kFp8 ? kPiecesPerThread / 2 : 1];
};

// Loads and converts this thread's pieces of channels [c0, c0 + kChannelsPerRound).
template <bool kFp8>
__device__ __forceinline__ RoundPieces<kFp8> load_pieces(const int4* row, int c0, int hidden) {
  RoundPieces<kFp8> p;
  if constexpr (!kFp8) {
    const int num_vec = hidden / 8;
#pragma unroll
    for (int u = 0; u < kPiecesPerThread; ++u) {
      const int v = c0 / 8 + u * kThreads + threadIdx.x;
      p.data[u] = v < num_vec ? ld_v4_no_alloc(row + v, false) : make_int4(0, 0, 0, 0);
    }
  } else {
    // 8 threads (of one warp) per 128-channel group, 16 channels each. All
    // lanes run the shuffles; lanes past the row compute on zeros.
    constexpr int kTasks = kPiecesPerThread / 2;
    const int num_tasks = hidden / 16;
    int4 raw[kTasks][2];
#pragma unroll
    for (int u = 0; u < kTasks; ++u) {
      const int task = c0 / 16 + u * kThreads + threadIdx.x;
      const bool active = task < num_tasks;
      raw[u][0] = active ? ld_v4_no_alloc(row + 2 * task, false) : make_int4(0, 0, 0, 0);
      raw[u][1] = active ? ld_v4_no_alloc(row + 2 * task + 1, false) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kTasks; ++u) p.data[u] = quantize_16(raw[u], &p.scale[u]);
  }
  return p;
}

// Stores this thread's pieces of the round into a row: `payload` (bf16 or
// e4m3) and, with FP8, `scales` (the row's float32 scales, one per 128 channels).
template <bool kFp8>
__device__ __forceinline__ void store_pieces_to(int4* payload, float* scales,
                                                const RoundPieces<kFp8>& p, int c0, int hidden) {
  if constexpr (!kFp8) {
#pragma unroll
    for (int u = 0; u < kPiecesPerThread; ++u) {
      const int v = c0 / 8 + u * kThreads + threadIdx.x;
      if (v < hidden / 8) st_na_v4(payload + v, p.data[u]);
    }
  } else {
#pragma unroll
    for (int u = 0; u < kPiecesPerThread / 2; ++u) {
      const int task = c0 / 16 + u * kThreads + threadIdx.x;
      if (task < hidden / 16) {
        st_na_v4(payload + task, p.data[u]);
        if (task % 8 == 0) scales[task / 8] = p.scale[u];
      }
    }
  }
}

// Stores this thread's pieces of the round into the message at `msg`.
template <bool kFp8>
__device__ __forceinline__ void store_pieces(char* msg, const RoundPieces<kFp8>& p, int c0,
                                             int hidden) {
  store_pieces_to<kFp8>(reinterpret_cast<int4*>(msg + 16),
                        reinterpret_cast<float*>(msg + 16 + hidden), p, c0, hidden);
}

// Dynamic shared memory of the dispatch send part: the routing of all tokens
// ([num_tokens][K], entries that are not sent = -1), rows_per_expert [E] and
// rows_before [E].
size_t DispatchSendSmem(int num_tokens, const EpDims& d) {
  return sizeof(int) * (static_cast<size_t>(num_tokens) * d.num_topk +
                        2 * static_cast<size_t>(d.num_experts));
}

// Token t's entries into kSlots registers (-1 past K), by int4 loads where
// vector_idx (K a multiple of 4, topk_idx 16-byte aligned).
template <int kSlots>
__device__ __forceinline__ void load_token_entries(const int32_t* topk_idx, int t, int num_topk,
                                                   bool vector_idx, int (&entries)[kSlots]) {
  static_assert(kSlots % 4 == 0, "whole int4 loads");
  const int32_t* token_idx = topk_idx + static_cast<size_t>(t) * num_topk;
  if (vector_idx) {
#pragma unroll
    for (int q = 0; q < kSlots / 4; ++q) {
      const int4 four = 4 * q < num_topk ? __ldg(reinterpret_cast<const int4*>(token_idx) + q)
                                         : make_int4(-1, -1, -1, -1);
      entries[4 * q] = four.x;
      entries[4 * q + 1] = four.y;
      entries[4 * q + 2] = four.z;
      entries[4 * q + 3] = four.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kSlots; ++k) entries[k] = k < num_topk ? __ldg(token_idx + k) : -1;
  }
}

// 1. Routing of all tokens (every block of a dispatch's send part), one
//    thread per token with its K entries in registers (a token's repeats are
//    found there, not by reloading them): which (token, expert) pairs are
//    sent (routing[t][k] = e, or -1: invalid, masked, or a repeat of an
//    earlier k), rows_per_expert[e] (tokens sent to e) and rows_before[e]
//    (those before first_token; rows_before = rows_per_expert + E: both are
//    cleared as one array). Block 0 writes num_invalid. Has a block barrier
//    before its first read of `masked` and one at its end.
__device__ __forceinline__ void route_tokens(const EpDims& d, const LlDispatchArgs& args,
                                             const int* masked, int* routing,
                                             int* rows_per_expert, int* rows_before,
                                             int first_token, int* s_invalid) {
  const int num_topk = d.num_topk;
  const int num_tokens = args.num_tokens;
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  // The thread's first token's entries are loaded before the barrier.
  const bool vector_idx =
      num_topk % 4 == 0 && (reinterpret_cast<uintptr_t>(topk_idx) & 15u) == 0;
  int entries[kMaxTopk];
  auto load_entries = [&](int t) { load_token_entries(topk_idx, t, num_topk, vector_idx, entries); };
  if (static_cast<int>(threadIdx.x) < num_tokens) load_entries(threadIdx.x);
  for (int i = threadIdx.x; i < 2 * d.num_experts; i += blockDim.x) rows_per_expert[i] = 0;
  if (threadIdx.x == 0) *s_invalid = 0;
  __syncthreads();
  int invalid = 0;
  for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
    if (t != static_cast<int>(threadIdx.x)) load_entries(t);
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      if (k >= num_topk) break;
      const int e = entries[k];
      invalid += (e < -1 || e >= d.num_experts) ? 1 : 0;
      bool keep = valid_expert(e, d.num_experts) && masked[e / d.experts_per_rank] == 0;
#pragma unroll
      for (int j = 0; j < k; ++j) keep &= entries[j] != e;
      routing[static_cast<size_t>(t) * num_topk + k] = keep ? e : -1;
      if (keep) {
        atomicAdd(rows_per_expert + e, 1);
        if (t < first_token) atomicAdd(rows_before + e, 1);
      }
    }
  }
  if (blockIdx.x == 0 && invalid != 0) atomicAdd(s_invalid, invalid);
  __syncthreads();
  if (blockIdx.x == 0 && threadIdx.x == 0 && args.num_invalid != nullptr) {
    *args.num_invalid = *s_invalid;
  }
}

// A block's next token t (its previous one was t - grid): adds the tokens in
// between, [t - grid, t), to rows_before, then a block barrier.
__device__ __forceinline__ void advance_rows_before(const int* routing, int* rows_before, int t,
                                                    int num_topk) {
  for (int i = threadIdx.x; i < static_cast<int>(gridDim.x) * num_topk; i += blockDim.x) {
    const int e = routing[static_cast<size_t>(t - gridDim.x) * num_topk + i];
    if (e >= 0) atomicAdd(rows_before + e, 1);
  }
  __syncthreads();
}

// The weight of pair (t, e), e first named at entry k: every entry of the token
// naming e (entry k and its repeats), summed in k order; 0 without weights.
__device__ __forceinline__ float pair_weight(const int32_t* topk_idx, const float* topk_weights,
                                             int t, int k, int e, int num_topk) {
  float weight = 0.0f;
  if (topk_weights != nullptr) {
    for (int j = k; j < num_topk; ++j) {
      if (__ldg(topk_idx + t * num_topk + j) == e) weight += __ldg(topk_weights + t * num_topk + j);
    }
  }
  return weight;
}

// kDirectSelf (one-call BF16 op): the pairs this rank sends itself get only
// their header (t, 2, w); the receive part reads their payload from x, so no
// copy of it goes through dispatch_tokens.
template <bool kFp8, bool kDirectSelf>
__device__ __forceinline__ void dispatch_send_part(const LlContext& ctx, uint32_t seq,
                                                   const LlDispatchArgs& args,
                                                   const int* masked, int* smem) {
  __shared__ int s_expert[kMaxTopk];
  __shared__ int s_total[kMaxTopk];
  __shared__ int s_slot[kMaxTopk];
  __shared__ int s_weight_bits[kMaxTopk];  // the pair's weight, as carried in its header
  __shared__ char* s_dst[kMaxTopk];  // the pair's slot on its owner; null: RDMA
  // NVLink: the token's payload on the owner of expert k, for the first k of
  // each owner (null otherwise): one copy per (token, rank), not per expert.
  __shared__ char* s_token_dst[kMaxTopk];
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const int num_topk = d.num_topk;
  const int num_tokens = args.num_tokens;
  const auto* __restrict__ x = static_cast<const __nv_bfloat16*>(args.x);
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  const float* __restrict__ topk_weights = args.topk_weights;
  int* routing = smem;
  int* rows_per_expert = routing + static_cast<size_t>(num_tokens) * num_topk;
  int* rows_before = rows_per_expert + d.num_experts;
  auto* done = reinterpret_cast<uint32_t*>(ctx.slot_counters);
  char* recv_base = ctx.buffers.dispatch_recv[seq & 1];
  char* tokens_base = ctx.buffers.dispatch_tokens[seq & 1];
  uint64_t* flags = ctx.buffers.dispatch_flags[seq & 1];
  const size_t msg_bytes = ctx.buffers.message_bytes;
  const int first_token = blockIdx.x;
  auto token_row = [&](int t) {
    return reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * d.hidden);
  };

  // The first row's loads go out before the routing pass, unless no row can
  // leave the rank's own x (one rank, direct self pairs).
  const bool may_send_payload = !kDirectSelf || d.num_ranks > 1;
  RoundPieces<kFp8> pieces;
  if (may_send_payload && first_token < num_tokens) {
    pieces = load_pieces<kFp8>(token_row(first_token), 0, d.hidden);
  }

  route_tokens(d, args, masked, routing, rows_per_expert, rows_before, first_token, &s_invalid);

  // Experts that no token of this rank uses get (seq, 0) now, from block e % grid.
  for (int e = blockIdx.x + threadIdx.x * gridDim.x; e < d.num_experts;
       e += blockDim.x * gridDim.x) {
    const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
    if (rows_per_expert[e] == 0 && masked[r] == 0) {
      publish_flag(ctx, flags + static_cast<size_t>(le) * d.num_ranks + d.rank, make_flag(seq, 0),
                   r, le);
    }
  }

  // 2-3. This block's tokens, in increasing order.
  for (int t = first_token; t < num_tokens; t += gridDim.x) {
    if (t != first_token) {
      if (may_send_payload) pieces = load_pieces<kFp8>(token_row(t), 0, d.hidden);
      advance_rows_before(routing, rows_before, t, num_topk);
    }
    if (threadIdx.x < num_topk) {
      const int k = threadIdx.x;
      const int e = routing[static_cast<size_t>(t) * num_topk + k];
      s_expert[k] = e;
      if (e >= 0) {
        const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
        const int slot = rows_before[e];
        s_slot[k] = slot;
        s_total[k] = rows_per_expert[e];
        s_weight_bits[k] = __float_as_int(pair_weight(topk_idx, topk_weights, t, k, e, num_topk));
        char* dst_local = recv_base +
            ((static_cast<size_t>(le) * d.num_ranks + d.rank) * d.ll_max_tokens + slot) * msg_bytes;
        const bool own = r == d.rank;
        s_dst[k] = own ? dst_local : static_cast<char*>(transport::peer_ptr(dst_local, r));
        // The first of the token's experts on r (in k order) carries the payload.
        bool first_of_rank = !(kDirectSelf && own);
        for (int j = 0; j < k; ++j) {
          const int other = routing[static_cast<size_t>(t) * num_topk + j];
          first_of_rank &= other < 0 || other / d.experts_per_rank != r;
        }
        char* token_local =
            tokens_base + (static_cast<size_t>(d.rank) * d.ll_max_tokens + t) * msg_bytes;
        s_token_dst[k] = !first_of_rank || s_dst[k] == nullptr ? nullptr
                         : own ? token_local
                               : static_cast<char*>(transport::peer_ptr(token_local, r));
        // NVLink slots get only their header (y = 1: the payload is in the
        // source's dispatch_tokens row of token t on that rank; y = 2: in x).
        if (s_dst[k] != nullptr) {
          st_na_v4(reinterpret_cast<int4*>(s_dst[k]),
                   make_int4(t, kDirectSelf && own ? 2 : 1, s_weight_bits[k], 0));
        }
      }
    }
    __syncthreads();
    // Block-uniform (the routing lives in shared memory): whether the token's
    // payload goes to an RDMA stage and/or to a peer's dispatch_tokens.
    bool needs_stage = false, needs_payload = false;
    for (int k = 0; k < num_topk; ++k) {
      needs_stage |= s_expert[k] >= 0 && s_dst[k] == nullptr;
      needs_payload |= s_expert[k] >= 0 && (s_dst[k] == nullptr || s_token_dst[k] != nullptr);
    }
    // RDMA puts need a symmetric source: the message is staged once per token.
    char* stage = needs_stage ? ctx.buffers.dispatch_stage + static_cast<size_t>(t) * msg_bytes
                              : nullptr;
    const int4* row = token_row(t);
    for (int c0 = 0; needs_payload && c0 < d.hidden; c0 += kChannelsPerRound) {
      if (c0 > 0 || !may_send_payload) pieces = load_pieces<kFp8>(row, c0, d.hidden);
      for (int k = 0; k < num_topk; ++k) {
        if (s_expert[k] < 0 || s_token_dst[k] == nullptr) continue;
        store_pieces<kFp8>(s_token_dst[k], pieces, c0, d.hidden);
      }
      if (stage != nullptr) {
        store_pieces<kFp8>(stage, pieces, c0, d.hidden);
        if (c0 == 0 && threadIdx.x == 0) *reinterpret_cast<int4*>(stage) = make_int4(t, 0, 0, 0);
      }
    }
    if (stage != nullptr) {
      __syncthreads();  // the staged message is complete
      if (threadIdx.x / kWarpSize == 0) {
        for (int k = 0; k < num_topk; ++k) {
          const int e = s_expert[k];
          if (e < 0 || s_dst[k] != nullptr) continue;
          const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
          char* dst_local = recv_base +
              ((static_cast<size_t>(le) * d.num_ranks + d.rank) * d.ll_max_tokens + s_slot[k]) *
                  msg_bytes;
          if (topk_weights == nullptr) {
            transport::put_warp(dst_local, stage, msg_bytes, r, ctx.qp_handles, le);
          } else {
            // The pair's own header (its weight) from its own staging slot, then
            // the shared payload; both on QP le, so its signal follows both.
            int4* header = reinterpret_cast<int4*>(ctx.buffers.dispatch_header_stage) +
                           static_cast<size_t>(t) * num_topk + k;
            if (threadIdx.x == 0) *header = make_int4(t, 0, s_weight_bits[k], 0);
            __syncwarp();
            transport::put_warp(dst_local, header, 16, r, ctx.qp_handles, le);
            transport::put_warp(dst_local + 16, stage + 16, msg_bytes - 16, r, ctx.qp_handles, le);
          }
        }
      }
    }
    transport::complete_block_puts(needs_stage, ctx.qp_handles, ctx.status);
    __syncthreads();  // every row of token t is written (or its put issued)
    if (threadIdx.x < num_topk) {
      const int k = threadIdx.x;
      const int e = s_expert[k];
      if (e >= 0 && atom_add_acq_rel_gpu(done + e, 1u) + 1u == static_cast<uint32_t>(s_total[k])) {
        // The last of e's rows: publish them all.
        done[e] = 0u;
        const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
        publish_flag(ctx, flags + static_cast<size_t>(le) * d.num_ranks + d.rank,
                     make_flag(seq, static_cast<uint32_t>(s_total[k])), r, le);
      }
    }
  }
}

// One rank, one call (kOneRankTable): every pair is the rank's own, so the
// sender writes the results itself: pair (t, e) goes straight to output row
// rows_before[e] of expert e (the tokens before t choosing e), with its source
// and weight; no messages, flags or receive part. Block e % grid writes
// count[e] (-1 when `*void_call`, shared memory written by thread 0 before the
// routing pass's first barrier) and the rows past it (source -1, weight 0).
template <bool kFp8>
__device__ __forceinline__ void dispatch_single_rank(const LlContext& ctx,
                                                     const LlDispatchArgs& args,
                                                     const int* masked, int* smem,
                                                     const uint32_t* void_call) {
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const int num_topk = d.num_topk;
  const int num_tokens = args.num_tokens;
  const int rows_per_expert = d.ll_max_tokens;  // R * T_ll, R = 1
  const auto* __restrict__ x = static_cast<const __nv_bfloat16*>(args.x);
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  const float* __restrict__ topk_weights = args.topk_weights;
  int* routing = smem;
  int* rows_per_expert_of = routing + static_cast<size_t>(num_tokens) * num_topk;  // [E]
  int* rows_before = rows_per_expert_of + d.num_experts;
  const int first_token = blockIdx.x;
  auto token_row = [&](int t) {
    return reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * d.hidden);
  };
  RoundPieces<kFp8> pieces;  // the first row's loads go out before the routing pass
  if (first_token < num_tokens) pieces = load_pieces<kFp8>(token_row(first_token), 0, d.hidden);
  route_tokens(d, args, masked, routing, rows_per_expert_of, rows_before, first_token,
               &s_invalid);
  for (int e = blockIdx.x; e < d.experts_per_rank; e += gridDim.x) {
    const int count = rows_per_expert_of[e];
    if (threadIdx.x == 0) args.out_count[e] = *void_call != 0u ? -1 : count;
    for (int row = count + threadIdx.x; row < rows_per_expert; row += blockDim.x) {
      const size_t out_row = static_cast<size_t>(e) * rows_per_expert + row;
      args.out_recv_src[out_row] = -1;
      if (args.out_weights != nullptr) args.out_weights[out_row] = 0.0f;
    }
  }
  // routing[t] and rows_before hold still from here (or from
  // advance_rows_before's barrier) to the barrier at the token's end, so every
  // thread reads a pair's expert and row from them (broadcast reads) and a
  // block with one token has no barrier in this loop.
  for (int t = first_token; t < num_tokens; t += gridDim.x) {
    if (t != first_token) {
      pieces = load_pieces<kFp8>(token_row(t), 0, d.hidden);
      advance_rows_before(routing, rows_before, t, num_topk);
    }
    const int* token_routing = routing + static_cast<size_t>(t) * num_topk;
    if (threadIdx.x < num_topk) {
      const int k = threadIdx.x;
      const int e = token_routing[k];
      if (e >= 0) {
        const int row = e * rows_per_expert + rows_before[e];
        args.out_recv_src[row] = t;  // source rank 0
        if (args.out_weights != nullptr) {
          args.out_weights[row] = pair_weight(topk_idx, topk_weights, t, k, e, num_topk);
        }
      }
    }
    const int4* row = token_row(t);
    for (int c0 = 0; c0 < d.hidden; c0 += kChannelsPerRound) {
      if (c0 > 0) pieces = load_pieces<kFp8>(row, c0, d.hidden);
      for (int k = 0; k < num_topk; ++k) {
        const int e = token_routing[k];
        if (e < 0) continue;
        const size_t out_row = static_cast<size_t>(e) * rows_per_expert + rows_before[e];
        if constexpr (kFp8) {
          store_pieces_to<kFp8>(
              reinterpret_cast<int4*>(static_cast<uint8_t*>(args.out_x) + out_row * d.hidden),
              args.out_scales + out_row * (d.hidden / 128), pieces, c0, d.hidden);
        } else {
          store_pieces_to<kFp8>(reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(args.out_x) +
                                                        out_row * d.hidden),
                                nullptr, pieces, c0, d.hidden);
        }
      }
    }
    // rows_before moves on for the block's next token.
    if (t + static_cast<int>(gridDim.x) < num_tokens) __syncthreads();
  }
}

// One rank, one call, few tokens (OneRankQueryFits: at most one token per
// block, K <= kQueryTopk, at most kQueryExperts experts per block). A block
// needs only kQueries numbers of the routing: for each expert of its token
// (token b = blockIdx.x), the tokens before b keeping it (the pair's row), and
// for each of its experts (b, b + G, ...), the tokens keeping it (count). So
// there is no routing table, no shared-memory counter to clear and no atomic:
// thread t holds token t's kept entries (valid, first occurrence) in
// registers and answers every question with compares; the answers (0 or 1)
// are packed 4 per word in 8-bit fields, each warp adds its 32 threads' words
// with kQueryWords + 1 reductions (the last word: block 0's invalid entries),
// and one block barrier publishes the warps' sums (and thread 0's pairing word
// and rank mask). A field's total is at most T <= 255, so no field carries
// into the next. The same results as dispatch_single_rank: a masked rank keeps
// nothing, a void call (a split send awaiting its receive) writes count -1,

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LL_DISPATCH_SEND_CUH_
