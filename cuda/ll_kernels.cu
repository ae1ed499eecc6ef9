// Low-latency (LL) dispatch and combine.
//
// PROTOCOL (R ranks, E experts, E_local = E/R per rank, T = max tokens per rank,
// p = parity of the call's sequence number seq; buffers in ep_types.h LlBuffers)
//
// dispatch send (on every source rank s, kernel ll_dispatch_send):
//   1. For each token t and each distinct valid expert e of t (owner r = e/E_local,
//      local expert le = e%E_local): slot = atomicAdd(slot_counters[e]) (device
//      memory, this rank only). The message [header: t][payload] is written to
//      r's dispatch_recv[p][le][s][slot] (NVLink: direct 16-byte stores; RDMA:
//      staged in dispatch_stage[t], then put on QP le).
//   2. Every thread fences (system scope); the last block to arrive reads and
//      zeroes slot_counters[e] = n_e and sets r's dispatch_flags[p][le][s] =
//      (seq, n_e) for every e (NVLink: st.release.sys; RDMA: signal on QP le
//      after the data). It also counts invalid top-k entries and advances the
//      send sequence number.
// dispatch recv (on every owner rank r, kernel ll_dispatch_recv):
//   3. For each local expert le: wait (bounded) for dispatch_flags[p][le][s] to
//      carry seq, for every source s; n_s rows arrived in arbitrary slot order.
//   4. Rows of source s are placed at offset sum_{s'<s} n_s' plus the rank of
//      their token index among that source's tokens (a bitmap of token ids in
//      shared memory), so the output order is (source rank, source token):
//      deterministic whatever order the atomics gave.
// combine send (on r, kernel ll_combine_send):
//   5. Row i < count[le] of expert le came from source s, token t (recv_src):
//      y[le][i] goes to s's combine_recv[p][r*E_local+le][t]; after all of
//      expert le's rows, (seq, 0) is set in combine_flags[p][r*E_local+le] on
//      every rank (NVLink: fence + st.release.sys; RDMA: signal on QP le).
// combine recv (on s, kernel ll_combine_recv):
//   6. Wait for combine_flags[p][e] = seq for every e; out[t] = sum over valid k
//      of w[t,k] * combine_recv[p][e_k][t], accumulated in fp32.
//
// Rank masking (ctx.masked, 1 = masked; set by the host between calls, or by a
// kernel on a timeout with mask_on_timeout): senders skip pairs whose expert
// lives on a masked rank and rows whose source is masked, and never write a
// masked rank's flags; receivers do not wait for a masked rank and leave its
// rows and experts out (count 0, no contribution).
//
// Pairing: a send hands its sequence number to its recv as a ticket in device
// memory (the fused one-call ops launch both kernels from one custom call), so
// XLA may reorder independent jax_ep calls freely as long as every rank runs the
// same program. At most one LL send of each kind may await its recv; a second
// is recorded as a protocol fault (kStatusProtocol).
//
// Why no resets: flags carry the call's sequence number (device_common.cuh), and
// buffers alternate by parity. A peer can write parity p again only two calls
// later, and it can get there only after it received this rank's data of the
// call in between, which this rank sends after finishing with parity p.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kMaxTopk = 32;
constexpr int kMaxRanks = 1024;
constexpr float kFp8Max = 448.0f;
constexpr size_t kMaxDynamicSmem = 200 * 1024;
constexpr float kMinAmax = 1e-4f;

// Profiling hooks (no-ops when ctx.profile is null).
__device__ __forceinline__ void profile_start(const LlContext& ctx, int k) {
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    const uint64_t now = global_timer_ns();
    ctx.profile->start[k] = now;
    if (k % 2 == 1) ctx.profile->gap_ns[k] += now - ctx.profile->end[k - 1];
  }
}
__device__ __forceinline__ void profile_waited(const LlContext& ctx, int k) {
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    ctx.profile->wait_ns[k] += global_timer_ns() - ctx.profile->start[k];
  }
}
__device__ __forceinline__ void profile_end(const LlContext& ctx, int k) {  // last block only
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    const uint64_t now = global_timer_ns();
    ctx.profile->end[k] = now;
    ctx.profile->total_ns[k] += now - ctx.profile->start[k];
    ctx.profile->calls[k] += 1;
  }
}

// A send's bookkeeping (one thread of its last block): the protocol check (one
// outstanding send per kind), the new sequence number and the recv's ticket.
__device__ __forceinline__ void finish_send(const LlContext& ctx, uint32_t* outstanding,
                                            uint32_t* seq_counter, uint32_t seq,
                                            uint32_t* ticket_out, uint32_t op) {
  if (*outstanding != 0u) record_fault(ctx.status, kStatusProtocol, op, ctx.dims.rank, 0);
  *outstanding = 1u;
  *seq_counter = seq;
  if (ticket_out != nullptr) *ticket_out = seq;
}

__device__ __forceinline__ bool valid_expert(int e, int num_experts) {
  return e >= 0 && e < num_experts;
}

__device__ __forceinline__ bool rank_masked(const LlContext& ctx, int rank) {
  return ctx.masked != nullptr && ld_volatile_u32(ctx.masked + rank) != 0u;
}

// Waits for a peer's flag; a masked peer is not waited for (kFlagTimedOut).
// With mask_on_timeout a timeout masks the peer instead of recording a fault.
__device__ __forceinline__ uint32_t ll_wait(const LlContext& ctx, const uint64_t* flag,
                                            uint32_t seq, uint32_t op, int peer, int detail) {
  if (rank_masked(ctx, peer)) return kFlagTimedOut;
  if (!ctx.mask_on_timeout || ctx.masked == nullptr) {
    return wait_flag(flag, seq, ctx.timeout_ns, ctx.status, op, peer, detail);
  }
  // Masks the peer (both copies) instead of recording a fault; a peer masked
  // meanwhile (by another wait) ends the wait too.
  auto mask_peer = [&] {
    atomicExch(ctx.masked + peer, 1u);
    if (ctx.masked_mirror != nullptr) {
      *reinterpret_cast<volatile uint32_t*>(ctx.masked_mirror + peer) = 1u;
    }
    __threadfence_system();
  };
  uint64_t value = 0;
  const bool arrived = bounded_wait(
      [&] {
        value = ld_acquire_sys(flag);
        return flag_seq(value) == seq || rank_masked(ctx, peer);
      },
      ctx.timeout_ns, ctx.status, mask_peer);
  return arrived && flag_seq(value) == seq ? flag_value(value) : kFlagTimedOut;
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
      p.data[u] = v < num_vec ? ld_nc_v4(row + v) : make_int4(0, 0, 0, 0);
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
      raw[u][0] = active ? ld_nc_v4(row + 2 * task) : make_int4(0, 0, 0, 0);
      raw[u][1] = active ? ld_nc_v4(row + 2 * task + 1) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kTasks; ++u) {
      const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(raw[u]);
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
      p.data[u] = make_int4(static_cast<int>(packed[0]), static_cast<int>(packed[1]),
                            static_cast<int>(packed[2]), static_cast<int>(packed[3]));
      p.scale[u] = amax / kFp8Max;
    }
  }
  return p;
}

// Stores this thread's pieces of the round into the message at `msg`.
template <bool kFp8>
__device__ __forceinline__ void store_pieces(char* msg, const RoundPieces<kFp8>& p, int c0,
                                             int hidden) {
  int4* payload = reinterpret_cast<int4*>(msg + 16);
  if constexpr (!kFp8) {
#pragma unroll
    for (int u = 0; u < kPiecesPerThread; ++u) {
      const int v = c0 / 8 + u * kThreads + threadIdx.x;
      if (v < hidden / 8) st_na_v4(payload + v, p.data[u]);
    }
  } else {
    float* scales = reinterpret_cast<float*>(msg + 16 + hidden);
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

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    ll_dispatch_send(LlContext ctx, const __nv_bfloat16* __restrict__ x,
                     const int32_t* __restrict__ topk_idx, int num_tokens,
                     int32_t* __restrict__ num_invalid_out, uint32_t* __restrict__ ticket_out) {
  __shared__ int s_expert[kMaxTopk];
  __shared__ int s_slot[kMaxTopk];
  __shared__ char* s_dst[kMaxTopk];  // the message's address on its owner; null: RDMA
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ll_dispatch_seq) + 1;
  char* recv_base = ctx.buffers.dispatch_recv[seq & 1];
  uint64_t* flags = ctx.buffers.dispatch_flags[seq & 1];
  const size_t msg_bytes = ctx.buffers.message_bytes;
  bool used_rdma = false;
  profile_start(ctx, 0);

  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int4* row = reinterpret_cast<const int4*>(x + static_cast<size_t>(t) * d.hidden);
    // The first round's loads go out before the slot atomics return.
    RoundPieces<kFp8> pieces = load_pieces<kFp8>(row, 0, d.hidden);
    if (threadIdx.x < d.num_topk) {
      const int k = threadIdx.x;
      const int e = topk_idx[t * d.num_topk + k];
      bool first = valid_expert(e, d.num_experts) && !rank_masked(ctx, e / d.experts_per_rank);
      for (int j = 0; j < k && first; ++j) first = topk_idx[t * d.num_topk + j] != e;
      const int slot = first ? atomicAdd(ctx.slot_counters + e, 1) : -1;
      s_expert[k] = first ? e : -1;
      s_slot[k] = slot;
      if (first) {
        const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
        char* dst_local = recv_base +
            ((static_cast<size_t>(le) * d.num_ranks + d.rank) * d.max_tokens + slot) * msg_bytes;
        s_dst[k] = static_cast<char*>(transport::peer_ptr(dst_local, r));
      }
    }
    __syncthreads();
    bool needs_stage = false;  // block-uniform: the routing lives in shared memory
    for (int k = 0; k < d.num_topk; ++k) needs_stage |= s_expert[k] >= 0 && s_dst[k] == nullptr;
    // RDMA puts need a symmetric source: the message is staged once per token.
    char* stage = needs_stage ? ctx.buffers.dispatch_stage + static_cast<size_t>(t) * msg_bytes
                              : nullptr;
    for (int c0 = 0; c0 < d.hidden; c0 += kChannelsPerRound) {
      if (c0 > 0) pieces = load_pieces<kFp8>(row, c0, d.hidden);
      for (int k = 0; k < d.num_topk; ++k) {
        if (s_expert[k] < 0 || s_dst[k] == nullptr) continue;
        store_pieces<kFp8>(s_dst[k], pieces, c0, d.hidden);
        if (c0 == 0 && threadIdx.x == 0) {
          st_na_v4(reinterpret_cast<int4*>(s_dst[k]), make_int4(t, 0, 0, 0));
        }
      }
      if (stage != nullptr) {
        store_pieces<kFp8>(stage, pieces, c0, d.hidden);
        if (c0 == 0 && threadIdx.x == 0) *reinterpret_cast<int4*>(stage) = make_int4(t, 0, 0, 0);
      }
    }
    if (stage != nullptr) {
      __syncthreads();  // the staged message is complete
      if (threadIdx.x / kWarpSize == 0) {
        for (int k = 0; k < d.num_topk; ++k) {
          const int e = s_expert[k];
          if (e < 0 || s_dst[k] != nullptr) continue;
          const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
          char* dst_local = recv_base +
              ((static_cast<size_t>(le) * d.num_ranks + d.rank) * d.max_tokens + s_slot[k]) *
                  msg_bytes;
          transport::put_warp(dst_local, stage, msg_bytes, r, ctx.qp_handles, le);
        }
      }
      used_rdma = true;
    }
    __syncthreads();  // s_expert/s_slot/s_dst are rewritten for the next token
  }
  transport::complete_block_puts(__syncthreads_or(used_rdma), ctx.qp_handles);

  if (arrive_is_last_block(&ctx.counters->ll_dispatch_send_done)) {
    for (int e = threadIdx.x; e < d.num_experts; e += blockDim.x) {
      const int r = e / d.experts_per_rank, le = e % d.experts_per_rank;
      const uint32_t count = static_cast<uint32_t>(atomicExch(ctx.slot_counters + e, 0));
      if (rank_masked(ctx, r)) continue;  // a masked rank's memory is never written
      transport::set_flag(flags + static_cast<size_t>(le) * d.num_ranks + d.rank,
                          make_flag(seq, count), r, ctx.qp_handles, le);
    }
    if (threadIdx.x == 0) s_invalid = 0;
    __syncthreads();
    int invalid = 0;
    for (int i = threadIdx.x; i < num_tokens * d.num_topk; i += blockDim.x) {
      const int e = topk_idx[i];
      invalid += (e < -1 || e >= d.num_experts) ? 1 : 0;
    }
    if (invalid) atomicAdd(&s_invalid, invalid);
    __syncthreads();
    if (threadIdx.x == 0) {
      *num_invalid_out = s_invalid;
      finish_send(ctx, &ctx.counters->ll_dispatch_outstanding, &ctx.counters->ll_dispatch_seq,
                  seq, ticket_out, kOpLlDispatch);
    }
    profile_end(ctx, 0);
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    ll_dispatch_recv(LlContext ctx, const uint32_t* __restrict__ ticket, int num_tokens,
                     void* __restrict__ out_x,
                     float* __restrict__ out_scales, int32_t* __restrict__ out_count,
                     int32_t* __restrict__ out_recv_src) {
  // Per source s: bitmap[s][words] of arrived token ids, prefix[s][words]
  // (popcount of the words before) -> a row's output position without sorting.
  extern __shared__ uint32_t smem_words[];
  __shared__ int s_count[kMaxRanks];
  __shared__ int s_offset[kMaxRanks + 1];
  const EpDims d = ctx.dims;
  const uint32_t seq = ld_volatile_u32(ticket);
  const char* recv_base = ctx.buffers.dispatch_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.dispatch_flags[seq & 1];
  const size_t msg_bytes = ctx.buffers.message_bytes;
  const int rows_per_expert = d.num_ranks * d.max_tokens;
  const int words = (num_tokens + 31) / 32;
  uint32_t* bitmap = smem_words;
  uint32_t* prefix = smem_words + d.num_ranks * words;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  profile_start(ctx, 1);

  for (int le = blockIdx.x; le < d.experts_per_rank; le += gridDim.x) {
    const char* expert_base = recv_base + static_cast<size_t>(le) * d.num_ranks * d.max_tokens * msg_bytes;
    for (int i = threadIdx.x; i < d.num_ranks * words; i += blockDim.x) bitmap[i] = 0u;
    for (int s = threadIdx.x; s < d.num_ranks; s += blockDim.x) {
      const uint32_t n = ll_wait(ctx, flags + static_cast<size_t>(le) * d.num_ranks + s, seq,
                                 kOpLlDispatch, s, le);
      s_count[s] = (n == kFlagTimedOut) ? 0 : static_cast<int>(min(n, static_cast<uint32_t>(num_tokens)));
    }
    __syncthreads();
    if (le == blockIdx.x) profile_waited(ctx, 1);
    if (threadIdx.x == 0) {
      int total = 0;
      for (int s = 0; s < d.num_ranks; ++s) {
        s_offset[s] = total;
        total += s_count[s];
      }
      s_offset[d.num_ranks] = total;
      out_count[le] = total;
    }
    // Token ids of every arrived row, all sources at once.
    for (int s = 0; s < d.num_ranks; ++s) {
      const char* block = expert_base + static_cast<size_t>(s) * d.max_tokens * msg_bytes;
      for (int i = threadIdx.x; i < s_count[s]; i += blockDim.x) {
        const int t = ld_nc_v4(reinterpret_cast<const int4*>(block + i * msg_bytes)).x;
        if (t >= 0 && t < num_tokens) atomicOr(bitmap + s * words + t / 32, 1u << (t % 32));
      }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < d.num_ranks; s += blockDim.x) {
      uint32_t running = 0;
      for (int i = 0; i < words; ++i) {
        prefix[s * words + i] = running;
        running += __popc(bitmap[s * words + i]);
      }
    }
    const int total = s_offset[d.num_ranks];
    int32_t* recv_src = out_recv_src + static_cast<size_t>(le) * rows_per_expert;
    for (int row = total + threadIdx.x; row < rows_per_expert; row += blockDim.x) recv_src[row] = -1;
    __syncthreads();
    // One warp per row, all sources at once.
    for (int s = 0; s < d.num_ranks; ++s) {
      const char* block = expert_base + static_cast<size_t>(s) * d.max_tokens * msg_bytes;
      const uint32_t* bits = bitmap + s * words;
      for (int i = warp; i < s_count[s]; i += num_warps) {
        const char* message = block + i * msg_bytes;
        const int t = ld_nc_v4(reinterpret_cast<const int4*>(message)).x;
        if (t < 0 || t >= num_tokens) continue;
        const int pos = prefix[s * words + t / 32] + __popc(bits[t / 32] & ((1u << (t % 32)) - 1u));
        const size_t out_row = static_cast<size_t>(le) * rows_per_expert + s_offset[s] + pos;
        if (lane == 0) recv_src[s_offset[s] + pos] = s * num_tokens + t;
        const int4* payload = reinterpret_cast<const int4*>(message + 16);
        if constexpr (!kFp8) {
          warp_copy(reinterpret_cast<int4*>(static_cast<__nv_bfloat16*>(out_x) + out_row * d.hidden),
                    payload, d.hidden / 8, lane);
        } else {
          warp_copy(reinterpret_cast<int4*>(static_cast<uint8_t*>(out_x) + out_row * d.hidden),
                    payload, d.hidden / 16, lane);
          const float* scales = reinterpret_cast<const float*>(message + 16 + d.hidden);
          float* scales_out = out_scales + out_row * (d.hidden / 128);
          for (int g = lane; g < d.hidden / 128; g += kWarpSize) scales_out[g] = scales[g];
        }
      }
    }
    __syncthreads();  // shared state is rewritten for the next expert
  }
  if (arrive_is_last_block(&ctx.counters->ll_dispatch_recv_done) && threadIdx.x == 0) {
    ctx.counters->ll_dispatch_outstanding = 0u;
    profile_end(ctx, 1);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ll_combine_send(LlContext ctx, const __nv_bfloat16* __restrict__ y,
                    const int32_t* __restrict__ recv_src, const int32_t* __restrict__ count,
                    int num_tokens, uint32_t* __restrict__ ticket_out) {
  const EpDims d = ctx.dims;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ll_combine_seq) + 1;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int rows_per_expert = d.num_ranks * d.max_tokens;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  bool used_rdma = false;
  profile_start(ctx, 2);

  for (int le = blockIdx.x; le < d.experts_per_rank; le += gridDim.x) {
    const int e = d.rank * d.experts_per_rank + le;
    const int n = min(count[le], rows_per_expert);
    for (int i = warp; i < n; i += kWarps) {
      const int src = recv_src[static_cast<size_t>(le) * rows_per_expert + i];
      if (src < 0 || num_tokens <= 0) continue;
      const int s = src / num_tokens, t = src % num_tokens;
      if (s >= d.num_ranks || rank_masked(ctx, s)) continue;
      const int4* row = reinterpret_cast<const int4*>(
          y + (static_cast<size_t>(le) * rows_per_expert + i) * d.hidden);
      char* dst_local = recv_base + (static_cast<size_t>(e) * d.max_tokens + t) * row_bytes;
      auto* dst = static_cast<int4*>(transport::peer_ptr(dst_local, s));
      if (dst != nullptr) {
        warp_copy(dst, row, d.hidden / 8, lane);
      } else {
        auto* stage = reinterpret_cast<int4*>(
            ctx.buffers.combine_stage + (static_cast<size_t>(le) * rows_per_expert + i) * row_bytes);
        for (int v = lane; v < d.hidden / 8; v += kWarpSize) stage[v] = __ldg(row + v);
        __syncwarp();
        transport::put_warp(dst_local, stage, row_bytes, s, ctx.qp_handles, le);
        used_rdma = true;
      }
    }
    transport::complete_block_puts(__syncthreads_or(used_rdma), ctx.qp_handles);
    __threadfence_system();
    __syncthreads();
    for (int r = threadIdx.x; r < d.num_ranks; r += blockDim.x) {
      if (!rank_masked(ctx, r)) transport::set_flag(flags + e, make_flag(seq, 0), r, ctx.qp_handles, le);
    }
  }
  if (arrive_is_last_block(&ctx.counters->ll_combine_send_done) && threadIdx.x == 0) {
    finish_send(ctx, &ctx.counters->ll_combine_outstanding, &ctx.counters->ll_combine_seq, seq,
                ticket_out, kOpLlCombine);
    profile_end(ctx, 2);
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ll_combine_recv(LlContext ctx, const uint32_t* __restrict__ ticket,
                    const int32_t* __restrict__ topk_idx,
                    const float* __restrict__ topk_weights, int num_tokens,
                    __nv_bfloat16* __restrict__ out) {
  __shared__ int s_expert[kMaxTopk];
  __shared__ float s_weight[kMaxTopk];
  const EpDims d = ctx.dims;
  const uint32_t seq = ld_volatile_u32(ticket);
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  profile_start(ctx, 3);

  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    if (threadIdx.x < d.num_topk) {
      // Wait only for the experts this token uses (few pollers: polling every
      // flag from every block slows the peers' incoming NVLink writes).
      const int e = topk_idx[t * d.num_topk + threadIdx.x];
      bool valid = valid_expert(e, d.num_experts) && !rank_masked(ctx, e / d.experts_per_rank);
      if (valid && ll_wait(ctx, flags + e, seq, kOpLlCombine, e / d.experts_per_rank,
                           e % d.experts_per_rank) == kFlagTimedOut &&
          rank_masked(ctx, e / d.experts_per_rank)) {
        valid = false;  // masked on this timeout: its experts contribute nothing
      }
      s_expert[threadIdx.x] = valid ? e : -1;
      s_weight[threadIdx.x] = valid ? topk_weights[t * d.num_topk + threadIdx.x] : 0.0f;
    }
    __syncthreads();
    if (t == blockIdx.x) profile_waited(ctx, 3);
    for (int v = threadIdx.x; v < d.hidden / 8; v += blockDim.x) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      // kBatch experts' loads in flight at once, then summed in k order.
      constexpr int kBatch = 8;
      for (int k0 = 0; k0 < d.num_topk; k0 += kBatch) {
        int4 raw[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          const int e = k < d.num_topk ? s_expert[k] : -1;
          if (e >= 0) {
            raw[j] = ld_nc_v4(reinterpret_cast<const int4*>(
                recv_base + (static_cast<size_t>(e) * d.max_tokens + t) * row_bytes) + v);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          if (k >= d.num_topk || s_expert[k] < 0) continue;
          const __nv_bfloat16* vals = reinterpret_cast<const __nv_bfloat16*>(&raw[j]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] += s_weight[k] * __bfloat162float(vals[i]);
        }
      }
      int4 packed;
      __nv_bfloat16* outv = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) outv[j] = __float2bfloat16_rn(acc[j]);
      reinterpret_cast<int4*>(out + static_cast<size_t>(t) * d.hidden)[v] = packed;
    }
    __syncthreads();
  }
  if (arrive_is_last_block(&ctx.counters->ll_combine_recv_done) && threadIdx.x == 0) {
    ctx.counters->ll_combine_outstanding = 0u;
    profile_end(ctx, 3);
  }
}

int GridSize(const LlContext& ctx, int work) {
  return std::max(1, std::min(work, ctx.num_sms));
}

}  // namespace

cudaError_t LaunchLlDispatchSend(const LlContext& ctx, const void* x, const int32_t* topk_idx,
                                 int num_tokens, bool use_fp8, int32_t* num_invalid,
                                 uint32_t* ticket, cudaStream_t stream) {
  const int grid = GridSize(ctx, num_tokens);
  const auto* rows = static_cast<const __nv_bfloat16*>(x);
  if (use_fp8) {
    ll_dispatch_send<true><<<grid, kThreads, 0, stream>>>(ctx, rows, topk_idx, num_tokens,
                                                          num_invalid, ticket);
  } else {
    ll_dispatch_send<false><<<grid, kThreads, 0, stream>>>(ctx, rows, topk_idx, num_tokens,
                                                           num_invalid, ticket);
  }
  return cudaGetLastError();
}

cudaError_t LaunchLlDispatchRecv(const LlContext& ctx, const uint32_t* ticket, int num_tokens,
                                 bool use_fp8, void* out_x, float* out_scales, int32_t* out_count,
                                 int32_t* out_recv_src, cudaStream_t stream) {
  if (ticket == nullptr) ticket = &ctx.counters->ll_dispatch_seq;
  const size_t smem = 2 * sizeof(uint32_t) * ctx.dims.num_ranks * ((num_tokens + 31) / 32);
  if (smem > kMaxDynamicSmem) return cudaErrorInvalidConfiguration;
  const int grid = GridSize(ctx, ctx.dims.experts_per_rank);
  if (use_fp8) {
    ll_dispatch_recv<true><<<grid, kThreads, smem, stream>>>(ctx, ticket, num_tokens, out_x,
                                                             out_scales, out_count, out_recv_src);
  } else {
    ll_dispatch_recv<false><<<grid, kThreads, smem, stream>>>(ctx, ticket, num_tokens, out_x,
                                                              out_scales, out_count, out_recv_src);
  }
  return cudaGetLastError();
}

cudaError_t LaunchLlCombineSend(const LlContext& ctx, const void* y, const int32_t* recv_src,
                                const int32_t* count, int num_tokens, uint32_t* ticket,
                                cudaStream_t stream) {
  const int grid = GridSize(ctx, ctx.dims.experts_per_rank);
  ll_combine_send<<<grid, kThreads, 0, stream>>>(ctx, static_cast<const __nv_bfloat16*>(y),
                                                 recv_src, count, num_tokens, ticket);
  return cudaGetLastError();
}

cudaError_t LaunchLlCombineRecv(const LlContext& ctx, const uint32_t* ticket,
                                const int32_t* topk_idx, const float* topk_weights,
                                int num_tokens, void* out, cudaStream_t stream) {
  if (ticket == nullptr) ticket = &ctx.counters->ll_combine_seq;
  const int grid = GridSize(ctx, std::max(num_tokens, 1));
  ll_combine_recv<<<grid, kThreads, 0, stream>>>(ctx, ticket, topk_idx, topk_weights, num_tokens,
                                                 static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

cudaError_t PrepareLlKernels() {
  // Load every kernel now (not lazily inside a call while peers spin) and
  // allow large dynamic shared memory for the receive bitmaps.
  const int max_smem = static_cast<int>(kMaxDynamicSmem);
  cudaError_t err = cudaSuccess;
  for (const void* kernel : {reinterpret_cast<const void*>(ll_dispatch_send<false>),
                             reinterpret_cast<const void*>(ll_dispatch_send<true>),
                             reinterpret_cast<const void*>(ll_dispatch_recv<false>),
                             reinterpret_cast<const void*>(ll_dispatch_recv<true>)}) {
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
    }
  }
  cudaFuncAttributes attrs;
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ll_combine_send);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ll_combine_recv);
  return err;
}

}  // namespace jax_ep::cuda
