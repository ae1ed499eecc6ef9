// Low-latency (LL) combine: one kernel, ll_combine, with a send and a
// receive part (as the dispatch: one-call op both, split ops one each). The
// protocol in full: docs/design.md, "LL protocol" (steps 5-7);
// tests/cpu/protocol_model.py models it. In short (p: parity of seq):
//   5. Row i of local expert le came from source s, token t (recv_src): y[le][i]
//      goes to s's combine_recv[p][r*E_local+le][t] (and/or its value to
//      combine_values); the one-call op keeps this rank's own rows in y. After
//      expert le's rows, (seq, 0) goes to combine_flags[p][r*E_local+le] on
//      every rank (st.release.sys; a signal on QP le over RDMA).
//   6. For each token, wait (bounded) for the flags of its valid experts;
//      out[t] = sum over valid k of w[t,k] * row, in fp32 in k order (no fused
//      multiply-add).
//   7. Reuse credit: block 0 also waits for every unmasked peer's flag of its
//      local expert 0, needed or not, so that no peer rewrites parity p early.
// A flag that never comes gives NaN for the tokens that needed it; masked
// ranks contribute nothing.

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

template <bool kDirectSelf>
__device__ __forceinline__ void combine_send_part(const LlContext& ctx, uint32_t seq,
                                                  const LlCombineArgs& args, const int* s_masked,
                                                  int first_count) {
  constexpr int kUnroll = 16;  // vectors per lane in flight
  const EpDims d = ctx.dims;
  const auto* __restrict__ y = static_cast<const __nv_bfloat16*>(args.y);
  const float* __restrict__ row_values = args.row_values;
  const int32_t* __restrict__ recv_src = args.recv_src;
  const int num_tokens = args.num_tokens;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  float* values_base = ctx.buffers.combine_values[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;
  const int rows_per_expert = d.num_ranks * d.ll_max_tokens;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int num_warps = blockDim.x / kWarpSize;
  bool used_rdma = false;

  for (int le = blockIdx.x; le < d.experts_per_rank; le += gridDim.x) {
    const int e = d.rank * d.experts_per_rank + le;
    const int32_t* expert_src = recv_src + static_cast<size_t>(le) * rows_per_expert;
    auto row_of = [&](int i) {
      return reinterpret_cast<const int4*>(
          y + (static_cast<size_t>(le) * rows_per_expert + i) * d.hidden);
    };
    // -1 (a faulted dispatch): none. The block's first count was loaded at the
    // kernel's start; only rows below it are loaded (a row past count is never
    // stored, and most of an expert's R*T_ll rows are past it).
    const int n = min(le == static_cast<int>(blockIdx.x) ? first_count : args.count[le],
                      rows_per_expert);
    for (int i = warp; i < n; i += num_warps) {
      const int src = expert_src[i];
      if (src < 0 || num_tokens <= 0) continue;
      const int s = src / num_tokens, t = src % num_tokens;
      if (s >= d.num_ranks || s_masked[s] != 0) continue;
      const size_t pair = static_cast<size_t>(e) * d.ll_max_tokens + t;  // on rank s
      const bool own = s == d.rank;
      if (kDirectSelf && own) continue;
      if (y != nullptr) {
        const int4* row = row_of(i);
        char* dst_local = recv_base + pair * row_bytes;
        if (auto* dst = static_cast<int4*>(own ? dst_local : transport::peer_ptr(dst_local, s))) {
          int4 batch[kUnroll];
          for (int base = 0; base < num_vec; base += kUnroll * kWarpSize) {
            warp_load_batch(batch, row, base, num_vec, lane);
            warp_store_batch(dst, batch, base, num_vec, lane);
          }
        } else {
          auto* stage = reinterpret_cast<int4*>(
              ctx.buffers.combine_stage +
              (static_cast<size_t>(le) * rows_per_expert + i) * row_bytes);
          for (int v = lane; v < num_vec; v += kWarpSize) stage[v] = __ldg(row + v);
          __syncwarp();
          transport::put_warp(dst_local, stage, row_bytes, s, ctx.qp_handles, le);
          used_rdma = true;
        }
      }
      if (row_values != nullptr) {
        const float value = row_values[static_cast<size_t>(le) * rows_per_expert + i];
        auto* dst = static_cast<float*>(own ? values_base + pair
                                            : transport::peer_ptr(values_base + pair, s));
        if (dst != nullptr) {
          if (lane == 0) *dst = value;
        } else {
          float* stage = ctx.buffers.combine_values_stage +
                         static_cast<size_t>(le) * rows_per_expert + i;
          if (lane == 0) *stage = value;
          __syncwarp();
          transport::put_warp(values_base + pair, stage, sizeof(float), s, ctx.qp_handles, le);
          used_rdma = true;
        }
      }
    }
    transport::complete_block_puts(__syncthreads_or(used_rdma), ctx.qp_handles, ctx.status);
    __syncthreads();  // every row of expert le is written (or its put issued)
    for (int r = threadIdx.x; r < d.num_ranks; r += blockDim.x) {
      if (s_masked[r] == 0 && !(kDirectSelf && r == d.rank)) {
        publish_flag(ctx, flags + e, make_flag(seq, 0), r, le);
      }
    }
  }
}

// kDirectSelf: the index in y of the row of this rank's own (token t, local
// expert le), source value src = rank * T + t: recv_src[le][0 .. count)
// ascends (rows arrive in (source rank, source token) order), so a binary
// search finds it; -1 when it is not there (a faulted dispatch: count -1).
__device__ __forceinline__ int own_row(const LlCombineArgs& args, int le, int rows_per_expert,
                                       int src) {
  const int n = min(__ldg(args.count + le), rows_per_expert);
  const int32_t* rows = args.recv_src + static_cast<size_t>(le) * rows_per_expert;
  int lo = 0, hi = n > 0 ? n : 0;  // the first i with rows[i] >= src
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (__ldg(rows + mid) < src) lo = mid + 1; else hi = mid;
  }
  return lo < n && __ldg(rows + lo) == src ? lo : -1;
}

// Waits (thread k < K of the block) for the flag of token t's k-th expert;
// returns the expert if its rows are here, -1 if it is invalid or masked, and
// kExpertLost if the wait timed out (a fault: the token's result is void).
constexpr int kExpertLost = -2;
__device__ __forceinline__ int arrived_expert(const LlContext& ctx, const uint64_t* flags,
                                              uint32_t seq, int e, const int* s_masked) {
  const EpDims& d = ctx.dims;
  if (!valid_expert(e, d.num_experts) || s_masked[e / d.experts_per_rank] != 0) return -1;
  if (ll_wait(ctx, s_masked, flags + e, seq, kOpLlCombine, e / d.experts_per_rank,
              e % d.experts_per_rank) != kFlagTimedOut) {
    return e;
  }
  // Masked on this timeout (mask_on_timeout): its experts contribute nothing.
  return rank_masked(ctx, e / d.experts_per_rank) ? -1 : kExpertLost;
}

// kDirectSelf: the rows (and row values) of this rank's own experts are read
// from y (row_values) at the index own_row finds, without a flag.
template <bool kDirectSelf>
__device__ __forceinline__ void combine_recv_part(const LlContext& ctx, uint32_t seq,
                                                  const LlCombineArgs& args, const int* s_masked,
                                                  int first_expert, float first_weight) {
  __shared__ int s_expert[kMaxTopk];
  __shared__ float s_weight[kMaxTopk];
  __shared__ const int4* s_row[kMaxTopk];  // where the row of (t, e_k) is read
  __shared__ int s_lost;
  const EpDims d = ctx.dims;
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  const float* __restrict__ topk_weights = args.topk_weights;
  const int num_tokens = args.num_tokens;
  auto* __restrict__ out = static_cast<__nv_bfloat16*>(args.out);
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const float* values_base = ctx.buffers.combine_values[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;
  const int rows_per_expert = d.num_ranks * d.ll_max_tokens;
  const auto* __restrict__ y = static_cast<const __nv_bfloat16*>(args.y);

  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    if (threadIdx.x == 0) s_lost = 0;
    __syncthreads();
    if (threadIdx.x < d.num_topk) {
      // Wait only for the experts this token uses (few pollers: polling every
      // flag from every block slows the peers' incoming NVLink writes).
      // The block's first token's routing was loaded at the kernel's start.
      const bool first = t == static_cast<int>(blockIdx.x);
      const int k = threadIdx.x;
      const int raw = first ? first_expert : topk_idx[t * d.num_topk + k];
      const int le = raw - d.rank * d.experts_per_rank;
      const bool own = kDirectSelf && valid_expert(raw, d.num_experts) &&
                       raw / d.experts_per_rank == d.rank && s_masked[d.rank] == 0;
      const int own_i = own ? own_row(args, le, rows_per_expert, d.rank * num_tokens + t) : -1;
      const int e = !own ? arrived_expert(ctx, flags, seq, raw, s_masked)
                         : own_i >= 0 ? raw : kExpertLost;
      if (e == kExpertLost) s_lost = 1;
      s_expert[k] = e >= 0 ? e : -1;
      const size_t own_row_index =
          own_i >= 0 ? static_cast<size_t>(le) * rows_per_expert + static_cast<size_t>(own_i) : 0;
      if (e >= 0 && out != nullptr) {
        s_row[k] = own ? reinterpret_cast<const int4*>(y + own_row_index * d.hidden)
                       : reinterpret_cast<const int4*>(
                             recv_base + (static_cast<size_t>(e) * d.ll_max_tokens + t) * row_bytes);
      }
      s_weight[k] = e >= 0 && topk_weights != nullptr
                        ? (first ? first_weight : topk_weights[t * d.num_topk + k])
                        : 0.0f;
      if (args.out_pair_values != nullptr) {
        // The value of the row of (t, e_k) (a repeated expert: the same row).
        const float value = e < 0 ? 0.0f
                            : own  ? __ldg(args.row_values + own_row_index)
                                   : ld_volatile_f32(values_base +
                                                     static_cast<size_t>(e) * d.ll_max_tokens + t);
        args.out_pair_values[t * d.num_topk + k] = e == kExpertLost ? __int_as_float(0x7fc00000)
                                                                    : value;
      }
    }
    __syncthreads();
    if (t == blockIdx.x) profile_waited(ctx, 3);
    if (out == nullptr) continue;
    if (s_lost) {  // a void result must not look valid: NaN
      const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
      for (int v = threadIdx.x; v < num_vec; v += blockDim.x) {
        reinterpret_cast<int4*>(out + static_cast<size_t>(t) * d.hidden)[v] = nan;
      }
      __syncthreads();
      continue;
    }
    // kVecs vectors x kBatch experts of loads in flight per thread, then
    // summed in k order (the oracle's order, so results match it bit for bit).
    constexpr int kVecs = 4;  // 1024 vectors per round: a hidden-7168 row in one
    constexpr int kBatch = 8;
    for (int v0 = threadIdx.x; v0 < num_vec; v0 += kVecs * blockDim.x) {
      float acc[kVecs][8];
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
      }
      for (int k0 = 0; k0 < d.num_topk; k0 += kBatch) {
        int4 raw[kVecs][kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          const int e = k < d.num_topk ? s_expert[k] : -1;
          if (e < 0) continue;
          const int4* src = s_row[k];
#pragma unroll
          for (int u = 0; u < kVecs; ++u) {
            const int v = v0 + u * blockDim.x;
            if (v < num_vec) raw[u][j] = ld_v4_no_alloc(src + v, true);
          }
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int k = k0 + j;
          if (k >= d.num_topk || s_expert[k] < 0) continue;
#pragma unroll
          for (int u = 0; u < kVecs; ++u) {
            const __nv_bfloat16* vals = reinterpret_cast<const __nv_bfloat16*>(&raw[u][j]);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              // The contract's two roundings (product, then sum), not one fused
              // multiply-add: the same bits as the oracle and the portable backend.
              acc[u][i] = __fadd_rn(acc[u][i], __fmul_rn(s_weight[k], __bfloat162float(vals[i])));
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        const int v = v0 + u * blockDim.x;
        if (v >= num_vec) continue;
        int4 packed;
        __nv_bfloat16* outv = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
        for (int i = 0; i < 8; ++i) outv[i] = __float2bfloat16_rn(acc[u][i]);
        reinterpret_cast<int4*>(out + static_cast<size_t>(t) * d.hidden)[v] = packed;
      }
    }
    __syncthreads();  // s_expert/s_weight are rewritten for the next token
  }
  // Peers' flags of their local expert 0: the reuse credit (step 7).
  wait_reuse_credits(ctx, s_masked, flags, d.experts_per_rank, seq, kOpLlCombine);
}

template <int kParts>
__global__ void __launch_bounds__(kThreads, 1) ll_combine(LlContext ctx, LlCombineArgs args) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  // One-call op: the rank's own rows are read from y, not copied (the split
  // receive has no y).
  constexpr bool kDirectSelf = kSend && kRecv;
  __shared__ int s_masked[kLlMaxRanks];
  DeviceCounters* counters = ctx.counters;
  const uint32_t seq = call_seq<kSend>(&counters->ll_combine_seq, args.ticket_in);
  // One rank, one call: no send part and no grid-wide epilogue (see
  // ll_dispatch); block 0 checks the pairing word at its start.
  const bool single_rank = kDirectSelf && ctx.dims.num_ranks == 1;
  const bool split_send_outstanding = single_rank && blockIdx.x == 0 && threadIdx.x == 0 &&
                                      ld_volatile_u32(&counters->ll_combine_outstanding) != 0u;
  // Loaded now, used later: the rank mask, the count of the block's first
  // expert and the routing of the block's first token.
  const int first_count = kSend && static_cast<int>(blockIdx.x) < ctx.dims.experts_per_rank
                              ? args.count[blockIdx.x]
                              : 0;
  int first_expert = -1;
  float first_weight = 0.0f;
  if (kRecv && threadIdx.x < ctx.dims.num_topk &&
      static_cast<int>(blockIdx.x) < args.num_tokens) {
    first_expert = args.topk_idx[blockIdx.x * ctx.dims.num_topk + threadIdx.x];
    if (args.topk_weights != nullptr) {
      first_weight = args.topk_weights[blockIdx.x * ctx.dims.num_topk + threadIdx.x];
    }
  }
  load_rank_mask(ctx, s_masked);
  __syncthreads();
  if constexpr (kSend) {
    profile_start(ctx, 2);
    // One rank, one call: every row is its own, read in place; nothing to send.
    if (!single_rank) combine_send_part<kDirectSelf>(ctx, seq, args, s_masked, first_count);
    if constexpr (kRecv) profile_end_block0(ctx, 2);
  }
  if constexpr (kRecv) {
    profile_start(ctx, 3);
    combine_recv_part<kDirectSelf>(ctx, seq, args, s_masked, first_expert, first_weight);
  }
  if (single_rank) {
    finish_single_rank_call(ctx, seq, split_send_outstanding, &counters->ll_combine_seq,
                            kOpLlCombine, 3);
    return;
  }
  finish_call<kParts>(ctx, seq, &counters->ll_combine_send_done, &counters->ll_combine_recv_done,
                      &counters->ll_combine_outstanding, &counters->ll_combine_seq,
                      args.ticket_out, kOpLlCombine, 2);
}

template <int kParts>
cudaError_t LaunchCombineParts(const LlContext& ctx, LlCombineArgs args, cudaStream_t stream) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  if (kRecv && !kSend && args.ticket_in == nullptr) {
    args.ticket_in = &ctx.counters->ll_combine_seq;  // right after its send
  }
  const int work = kSend && kRecv ? std::max(args.num_tokens, ctx.dims.experts_per_rank)
                   : kSend        ? ctx.dims.experts_per_rank
                                  : args.num_tokens;
  ll_combine<kParts><<<GridSize(ctx, work), kThreads, 0, stream>>>(ctx, args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLlCombine(const LlContext& ctx, const LlCombineArgs& args, LlParts parts,
                            cudaStream_t stream) {
  switch (parts) {
    case LlParts::kSend: return LaunchCombineParts<kSendPart>(ctx, args, stream);
    case LlParts::kRecv: return LaunchCombineParts<kRecvPart>(ctx, args, stream);
    case LlParts::kBoth: return LaunchCombineParts<kBothParts>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PrepareLlCombineKernels() {
  auto address = [](auto kernel) { return reinterpret_cast<const void*>(kernel); };
  cudaError_t err = cudaSuccess;
  cudaFuncAttributes attrs;
  for (const void* kernel : {address(ll_combine<kSendPart>), address(ll_combine<kRecvPart>),
                             address(ll_combine<kBothParts>)}) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
