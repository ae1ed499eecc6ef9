// High-throughput (HT) dispatch and combine over NVLink (R <= 8 ranks).
//
// PROTOCOL (seq = the op's call sequence number, the same on every rank; flags
// are (seq << 32 | value) words, never reset; buffers in ht_types.h)
//
// dispatch = three kernels launched back to back by one custom call:
//   ht_notify (1 block): counts this rank's tokens per destination rank
//     (a token counts once per rank), writes that row into every rank's
//     counts[me][*] and then sets notify_flags[me] there (st.release.sys).
//     It waits for every source's notify flag, reads the R x R matrix and
//     decides the layout: on receiver r, source s's rows start at
//     sum_{s'<s} counts[s'][r], in source token order; rows at or past the
//     capacity are dropped (send_row = -1). Writes send_row [T, R] and HtPlan.
//   ht_send (num_sms blocks): one warp per token pushes its row (16-byte
//     stores), scales, source token index and top-k (rewritten to the
//     receiver's local experts) straight to its final row in each
//     destination's recv_* buffers. Every thread fences; the last block sets
//     dispatch_flags[me] = seq on every rank.
//   ht_recv (num_sms blocks): waits for every source's dispatch flag, copies
//     the received rows into the XLA outputs (rows are already in (source
//     rank, source token) order), zero-fills padding, counts tokens per local
//     expert.
// Buffer reuse: a peer writes this rank's counts/recv_* for the next dispatch
// only after this rank's notify flag of that dispatch, which this rank sends
// after it finished copying out the previous one (stream order).
//
// combine = two kernels:
//   ht_combine_send: received row i (source s, token t) goes to s's
//     combine_recv[p][me][t] (p = seq parity); then every thread fences and
//     the last block sets combine_flags[p][me] = seq on every rank.
//   ht_combine_recv: waits for every rank's combine flag; out[t] = sum over
//     ranks r with send_row[t][r] >= 0 of combine_recv[p][r][t], in fp32.
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

__device__ __forceinline__ void warp_copy_bytes(char* dst, const char* src, size_t bytes,
                                                int lane) {
  for (size_t i = lane; i < bytes; i += kWarpSize) dst[i] = src[i];
}

// Bitmask of the ranks token t goes to (a token counts once per rank).
__device__ __forceinline__ uint32_t token_ranks(const int32_t* topk, int num_topk, int num_experts,
                                                int experts_per_rank, int* invalid) {
  uint32_t mask = 0;
  for (int k = 0; k < num_topk; ++k) {
    const int e = topk[k];
    if (e >= 0 && e < num_experts) {
      mask |= 1u << (e / experts_per_rank);
    } else if (e != -1) {
      ++*invalid;
    }
  }
  return mask;
}

__global__ void __launch_bounds__(kNotifyThreads, 1)
    ht_notify(HtContext ctx, const int32_t* __restrict__ topk_idx, int num_tokens, int capacity,
              int32_t* __restrict__ out_send_row, int32_t* __restrict__ out_num_invalid,
              int32_t* __restrict__ out_tokens_per_expert) {
  __shared__ int s_count[kNotifyThreads][kHtMaxRanks];  // per-thread counts, then prefixes
  __shared__ int s_total[kHtMaxRanks];
  __shared__ int s_matrix[kHtMaxRanks][kHtMaxRanks];
  __shared__ int s_invalid;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  // Contiguous token chunk per thread keeps the per-rank order = token order.
  const int per_thread = (num_tokens + blockDim.x - 1) / blockDim.x;
  const int t0 = min(num_tokens, static_cast<int>(threadIdx.x) * per_thread);
  const int t1 = min(num_tokens, t0 + per_thread);
  if (threadIdx.x == 0) s_invalid = 0;
  for (int e = threadIdx.x; e < d.experts_per_rank; e += blockDim.x) out_tokens_per_expert[e] = 0;
  int counts[kHtMaxRanks] = {0, 0, 0, 0, 0, 0, 0, 0};
  int invalid = 0;
  for (int t = t0; t < t1; ++t) {
    const uint32_t mask = token_ranks(topk_idx + t * d.num_topk, d.num_topk, d.num_experts,
                                      d.experts_per_rank, &invalid);
#pragma unroll
    for (int r = 0; r < kHtMaxRanks; ++r) counts[r] += (mask >> r) & 1u;
  }
#pragma unroll
  for (int r = 0; r < kHtMaxRanks; ++r) s_count[threadIdx.x][r] = counts[r];
  __syncthreads();
  if (invalid) atomicAdd(&s_invalid, invalid);
  // Exclusive scan over threads, one rank per thread of warp 0.
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    int running = 0;
    for (int i = 0; i < static_cast<int>(blockDim.x); ++i) {
      const int c = s_count[i][r];
      s_count[i][r] = running;
      running += c;
    }
    s_total[r] = running;
  }
  __syncthreads();
  // Publish this rank's row of the count matrix to every rank, then its flag.
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    int32_t* row_local = ctx.buffers.counts + d.rank * R;
    auto* row = static_cast<int32_t*>(transport::peer_ptr(row_local, r));
    for (int j = 0; j < R; ++j) row[j] = s_total[j];
    auto* flag = static_cast<uint64_t*>(transport::peer_ptr(ctx.buffers.notify_flags + d.rank, r));
    __threadfence_system();
    st_release_sys(flag, make_flag(seq, 1));
  }
  // Wait for every source's row.
  if (threadIdx.x < R) {
    const int s = threadIdx.x;
    const uint32_t got = wait_flag(ctx.buffers.notify_flags + s, seq, ctx.timeout_ns, ctx.status,
                                   kOpHtNotify, s, 0);
    for (int j = 0; j < R; ++j) {
      s_matrix[s][j] = (got == kFlagTimedOut) ? 0 : ld_volatile_u32(
          reinterpret_cast<const uint32_t*>(ctx.buffers.counts + s * R + j));
    }
  }
  __syncthreads();
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
  int running[kHtMaxRanks];
#pragma unroll
  for (int r = 0; r < kHtMaxRanks; ++r) running[r] = r < R ? s_count[threadIdx.x][r] : 0;
  for (int t = t0; t < t1; ++t) {
    int dummy = 0;
    const uint32_t mask = token_ranks(topk_idx + t * d.num_topk, d.num_topk, d.num_experts,
                                      d.experts_per_rank, &dummy);
    for (int r = 0; r < R; ++r) {
      int row = -1;
      if ((mask >> r) & 1u) {
        row = s_total[r] + running[r]++;
        if (row >= capacity) row = -1;
      }
      out_send_row[t * R + r] = row;
    }
  }
}

template <bool kHasScales>
__global__ void __launch_bounds__(kThreads, 1)
    ht_send(HtContext ctx, HtDispatchArgs args) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  const HtBuffers& b = ctx.buffers;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int global_warp = blockIdx.x * kWarps + warp;
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  for (int t = global_warp; t < args.num_tokens; t += gridDim.x * kWarps) {
    const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(args.x) +
                                                    static_cast<size_t>(t) * args.row_bytes);
    for (int r = 0; r < R; ++r) {
      const int row = args.out_send_row[t * R + r];
      if (row < 0) continue;
      char* base = static_cast<char*>(transport::peer_ptr(b.recv_x, r));
      warp_copy(reinterpret_cast<int4*>(base + static_cast<size_t>(row) * b.row_bytes), src,
                num_vec, lane);
      if constexpr (kHasScales) {
        char* scales = static_cast<char*>(transport::peer_ptr(b.recv_scales, r));
        warp_copy_bytes(scales + static_cast<size_t>(row) * args.scale_bytes,
                        static_cast<const char*>(args.scales) +
                            static_cast<size_t>(t) * args.scale_bytes,
                        args.scale_bytes, lane);
      }
      if (lane < d.num_topk) {
        const int e = args.topk_idx[t * d.num_topk + lane];
        const bool mine = e >= 0 && e < d.num_experts && e / d.experts_per_rank == r;
        auto* idx = static_cast<int32_t*>(transport::peer_ptr(b.recv_idx, r));
        auto* w = static_cast<float*>(transport::peer_ptr(b.recv_w, r));
        idx[row * d.num_topk + lane] = mine ? e - r * d.experts_per_rank : -1;
        w[row * d.num_topk + lane] = mine ? args.topk_weights[t * d.num_topk + lane] : 0.0f;
      }
      if (lane == 0) static_cast<int32_t*>(transport::peer_ptr(b.recv_src, r))[row] = t;
    }
  }
  if (arrive_is_last_block(&ctx.counters->ht_send_done)) {
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      transport::set_flag(b.dispatch_flags + d.rank, make_flag(seq, 1), r, nullptr, 0);
    }
  }
}

template <bool kHasScales>
__global__ void __launch_bounds__(kThreads, 1)
    ht_recv(HtContext ctx, HtDispatchArgs args) {
  __shared__ int s_prefix[kHtMaxRanks + 1];
  __shared__ int s_tpe[1024];
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_dispatch_seq) + 1;
  const HtBuffers& b = ctx.buffers;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  for (int s = threadIdx.x; s < R; s += blockDim.x) {
    wait_flag(b.dispatch_flags + s, seq, ctx.timeout_ns, ctx.status, kOpHtDispatch, s, 0);
  }
  for (int i = threadIdx.x; i <= R; i += blockDim.x) s_prefix[i] = ctx.plan->recv_prefix[i];
  for (int e = threadIdx.x; e < d.experts_per_rank && e < 1024; e += blockDim.x) s_tpe[e] = 0;
  __syncthreads();
  const int received = s_prefix[R];
  const int kept = min(received, args.capacity);
  const int num_vec = static_cast<int>(args.row_bytes / 16);
  for (int row = blockIdx.x * kWarps + warp; row < args.capacity; row += gridDim.x * kWarps) {
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(args.out_x) +
                                        static_cast<size_t>(row) * args.row_bytes);
    if (row < kept) {
      warp_copy(dst, reinterpret_cast<const int4*>(b.recv_x + static_cast<size_t>(row) * b.row_bytes),
                num_vec, lane);
      if constexpr (kHasScales) {
        warp_copy_bytes(static_cast<char*>(args.out_scales) + static_cast<size_t>(row) * args.scale_bytes,
                        reinterpret_cast<const char*>(b.recv_scales) +
                            static_cast<size_t>(row) * args.scale_bytes,
                        args.scale_bytes, lane);
      }
      int local = -1;
      if (lane < d.num_topk) {
        local = b.recv_idx[row * d.num_topk + lane];
        args.out_idx[row * d.num_topk + lane] = local;
        args.out_w[row * d.num_topk + lane] = b.recv_w[row * d.num_topk + lane];
      }
      // Count each local expert once per row.
      bool first = local >= 0;
      for (int j = 0; j < d.num_topk; ++j) {
        const int other = __shfl_sync(0xffffffffu, local, j);
        if (j < lane && other == local) first = false;
      }
      if (first && local < 1024) atomicAdd(&s_tpe[local], 1);
      if (lane == 0) {
        int s = 0;
        while (s + 1 < R && row >= s_prefix[s + 1]) ++s;
        args.out_recv_src[row] = s * args.num_tokens + b.recv_src[row];
      }
    } else {
      for (int v = lane; v < num_vec; v += kWarpSize) dst[v] = make_int4(0, 0, 0, 0);
      if constexpr (kHasScales) {
        for (size_t i = lane; i < args.scale_bytes; i += kWarpSize) {
          static_cast<char*>(args.out_scales)[static_cast<size_t>(row) * args.scale_bytes + i] = 0;
        }
      }
      if (lane < d.num_topk) {
        args.out_idx[row * d.num_topk + lane] = -1;
        args.out_w[row * d.num_topk + lane] = 0.0f;
      }
      if (lane == 0) args.out_recv_src[row] = -1;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < d.experts_per_rank && e < 1024; e += blockDim.x) {
    if (s_tpe[e]) atomicAdd(args.out_tokens_per_expert + e, s_tpe[e]);
  }
  if (arrive_is_last_block(&ctx.counters->ht_recv_done) && threadIdx.x == 0) {
    *args.out_num_tokens = kept;
    *args.out_num_dropped = received - kept;
    ctx.counters->ht_dispatch_seq = seq;
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_send(HtContext ctx, HtCombineArgs args) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int valid = min(*args.num_tokens, args.capacity);
  for (int i = blockIdx.x * kWarps + warp; i < valid; i += gridDim.x * kWarps) {
    const int src = args.recv_src[i];
    if (src < 0 || args.num_local_tokens <= 0) continue;
    const int s = src / args.num_local_tokens, t = src % args.num_local_tokens;
    if (s >= R) continue;
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
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    ht_combine_recv(HtContext ctx, HtCombineArgs args) {
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    wait_flag(flags + r, seq, ctx.timeout_ns, ctx.status, kOpHtCombine, r, 0);
  }
  __syncthreads();
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;
  const int total = args.num_local_tokens * num_vec;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int t = i / num_vec, v = i % num_vec;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int r = 0; r < R; ++r) {
      if (args.send_row[t * R + r] < 0) continue;
      const int4 raw = ld_nc_v4(reinterpret_cast<const int4*>(
          recv_base + (static_cast<size_t>(r) * d.max_tokens + t) * row_bytes) + v);
      const __nv_bfloat16* vals = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] += __bfloat162float(vals[j]);
    }
    int4 packed;
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __float2bfloat16_rn(acc[j]);
    reinterpret_cast<int4*>(static_cast<char*>(args.out) + static_cast<size_t>(t) * row_bytes)[v] =
        packed;
  }
  if (arrive_is_last_block(&ctx.counters->ht_combine_recv_done) && threadIdx.x == 0) {
    ctx.counters->ht_combine_seq = seq;
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
  ht_notify<<<1, kNotifyThreads, 0, stream>>>(ctx, args.topk_idx, args.num_tokens, args.capacity,
                                              args.out_send_row, args.out_num_invalid,
                                              args.out_tokens_per_expert);
  const int grid = std::max(1, ctx.num_sms);
  if (args.scales != nullptr) {
    ht_send<true><<<grid, kThreads, 0, stream>>>(ctx, args);
    ht_recv<true><<<grid, kThreads, 0, stream>>>(ctx, args);
  } else {
    ht_send<false><<<grid, kThreads, 0, stream>>>(ctx, args);
    ht_recv<false><<<grid, kThreads, 0, stream>>>(ctx, args);
  }
  return cudaGetLastError();
}

cudaError_t LaunchHtCombine(const HtContext& ctx, const HtCombineArgs& args, cudaStream_t stream) {
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.hidden % 8 != 0) return cudaErrorInvalidValue;
  const int grid = std::max(1, ctx.num_sms);
  ht_combine_send<<<grid, kThreads, 0, stream>>>(ctx, args);
  ht_combine_recv<<<grid, kThreads, 0, stream>>>(ctx, args);
  return cudaGetLastError();
}

cudaError_t PrepareHtKernels() {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaFuncGetAttributes(&attrs, ht_notify);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_send<true>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_send<false>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_recv<true>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_recv<false>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_send);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, ht_combine_recv);
  return err;
}

}  // namespace jax_ep::cuda
