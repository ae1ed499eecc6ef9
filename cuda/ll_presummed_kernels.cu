// Low-latency combine pre-summed per rank. The weights came with the dispatch
// (LlDispatchArgs::topk_weights; each row's weight is the handle's
// row_weights), so the expert side applies them and returns ONE row per
// (source token, rank) instead of one per (token, expert): up to K / R times
// fewer combine bytes (4x for top-8 at EP2).
//
// PROTOCOL (R ranks, E_local experts per rank, T = this call's tokens per rank
// (the same on every rank), T_ll the LL token cap, seq = the combine's
// sequence number (DeviceCounters::ll_combine_seq, shared with ll_combine in
// ll_combine.cu: calls of the two kinds may alternate), p = parity of seq;
// buffers in ep_types.h LlBuffers; done[] = ctx.rank_counters [R], device
// memory of this rank only, zero between calls)
//
// send (on every expert rank r):
//   1. Unit u = s*T + t is source rank s's token t. Row i < count[le] of local
//      expert le came from unit recv_src[le][i] (the dispatch's handle; a unit
//      has at most one row per expert, so at most K rows on r). A block takes
//      batches of consecutive units; for a batch it reads every received
//      row's source (the handle, about T*K entries, read by every block) and
//      lists each unit's rows, then sorts each list by local expert.
//   2. p = bf16(the fp32 sum from +0.0, in ascending local expert, of
//      fl(row_weights[le][i] * f32(y[le][i]))), the product and the sum each
//      rounded (no fused multiply-add): jax_ep.reference's presummed contract,
//      bit for bit. p goes to row r*T_ll + t of s's combine_recv[p] (the
//      [E][T_ll] row buffer; R <= E) by stores (NVLink, or r itself), or is
//      staged in combine_stage row u and put by RDMA on the default queue
//      pair. A unit with no rows on r sends nothing, nor does a masked source.
//   3. After its batch (block barrier; RDMA: nvshmem_quiet of the block's
//      puts), one thread per source s of the batch adds the batch's units of s
//      to done[s] (acq_rel, GPU scope). The one that brings it to T resets
//      done[s] to 0 and sets s's combine_flags[p][r] = (seq, 0): st.release.sys
//      through the peer mapping, st.release.gpu when s = r, or an RDMA signal
//      on the default queue pair, after every block's quiet of its puts to s.
//      The release covers every block's rows of s (barrier -> acq_rel counter
//      -> release chain, as in the LL dispatch step 3, docs/design.md).
// recv (on every source rank s):
//   4. For token t: the ranks holding its valid experts (unmasked at the
//      kernel's start), ascending. Wait (bounded) for combine_flags[p][r] to
//      carry seq for each, then out[t] = bf16(the fp32 sum from +0.0, in rank
//      order, of f32(row r*T_ll + t of combine_recv[p])). A token with no such
//      rank gets +0.0.
//   5. Reuse credit: once its tokens are done, block 0 also waits for
//      combine_flags[p][q] = seq from every unmasked peer q, needed or not
//      (ll_common.cuh wait_reuse_credits; the reuse rule of the LL protocol, docs/design.md).
//
// Faults: a wait that times out records the fault (device_common.cuh) and the
// token's row is NaN; with mask_on_timeout the rank is masked instead and
// contributes nothing. Masked ranks (ctx.masked): neither sent to nor waited
// for, as in ll_combine.cu.
// Why no resets of flags or buffers: as in the LL protocol (flags carry seq,
// buffers alternate by parity under its reuse rule, and seq counts the calls
// of both combines, so the rule spans them: a call of either kind waits for
// a flag of every peer, step 5 here, step 7 there); done[s] is reset by its
// last arriver within the call.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ll_common.cuh"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

// Units a block lists at once: its batch's rows live in shared memory.
constexpr int kMaxBatchUnits = 16;
// Received rows' sources loaded per thread before they are sorted into units.
constexpr int kScanUnroll = 4;
// A row sum: kSumVecs vectors per thread x kSumBatch rows of loads in flight
// (256 threads x 4 vectors: a hidden-7168 row in one round).
constexpr int kSumVecs = 4;
constexpr int kSumBatch = 8;

// Exclusive prefix sums of every thread's `value` into prefix[0 .. blockDim]
// (prefix[blockDim] = the total). All threads call it; it synchronises, and
// prefix may be read when it returns.
__device__ __forceinline__ void block_exclusive_scan(int value, int* prefix, int* warp_sums) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  int inclusive = value;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset <<= 1) {
    const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == kWarpSize - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarpSize; ++w) {
      const int sum = warp_sums[w];
      warp_sums[w] = running;
      running += sum;
    }
    prefix[blockDim.x] = running;
  }
  __syncthreads();
  prefix[threadIdx.x] = warp_sums[warp] + inclusive - value;
  __syncthreads();
}

// Block-collective: dst[v] = bf16(the fp32 sum from +0.0, in list order, of
// fl(weight_j * f32(row_j[v]))) for v < num_vec (kWeighted; without weights the
// terms are f32(row_j[v]) unscaled). row_of(j) -> const int4* of list entry j
// < num_rows; kCoherent: rows written during this kernel (ld_v4_no_alloc).
template <bool kWeighted, bool kCoherent, typename RowOf>
__device__ __forceinline__ void sum_rows(int4* dst, RowOf row_of, const float* weights,
                                         int num_rows, int num_vec) {
  for (int v0 = threadIdx.x; v0 < num_vec; v0 += kSumVecs * blockDim.x) {
    float acc[kSumVecs][8];
#pragma unroll
    for (int u = 0; u < kSumVecs; ++u) {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;
    }
    for (int j0 = 0; j0 < num_rows; j0 += kSumBatch) {
      int4 raw[kSumVecs][kSumBatch];
#pragma unroll
      for (int b = 0; b < kSumBatch; ++b) {
        if (j0 + b >= num_rows) continue;
        const int4* src = row_of(j0 + b);
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const int v = v0 + u * blockDim.x;
          if (v < num_vec) raw[u][b] = ld_v4_no_alloc(src + v, kCoherent);
        }
      }
#pragma unroll
      for (int b = 0; b < kSumBatch; ++b) {
        if (j0 + b >= num_rows) continue;
        const float weight = kWeighted ? weights[j0 + b] : 1.0f;
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u) {
          const __nv_bfloat16* vals = reinterpret_cast<const __nv_bfloat16*>(&raw[u][b]);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float term = __bfloat162float(vals[i]);
            // The contract's roundings: the product, then the sum.
            acc[u][i] = __fadd_rn(acc[u][i], kWeighted ? __fmul_rn(weight, term) : term);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kSumVecs; ++u) {
      const int v = v0 + u * blockDim.x;
      if (v >= num_vec) continue;
      int4 packed;
      __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = __float2bfloat16_rn(acc[u][i]);
      st_na_v4(dst + v, packed);
    }
  }
}

// Sets source rank s's copy of `flag` (its local symmetric address).
__device__ __forceinline__ void publish_presummed_flag(const LlContext& ctx, uint64_t* flag,
                                                       uint64_t value, int s) {
  if (s == ctx.dims.rank) {
    st_release_gpu(flag, value);
  } else {
    // No QP handles: the RDMA rows went on the default queue pair and were
    // completed (quiet) by their blocks, so the signal may take it too.
    transport::set_flag(flag, value, s, nullptr, 0);
  }
}

__device__ __forceinline__ void presummed_send_part(const LlContext& ctx, uint32_t seq,
                                                    const LlCombineArgs& args,
                                                    const int* s_masked) {
  __shared__ int s_prefix[kThreads + 1];
  __shared__ int s_warp_sums[kThreads / kWarpSize];
  __shared__ int s_num_rows[kMaxBatchUnits];
  __shared__ int s_rows[kMaxBatchUnits][kMaxTopk];  // flat rows le * R*T_ll + i
  __shared__ float s_row_weight[kMaxBatchUnits][kMaxTopk];
  const EpDims d = ctx.dims;
  const int num_tokens = args.num_tokens;
  const int num_units = d.num_ranks * num_tokens;
  if (num_units <= 0) return;
  const auto* __restrict__ y = static_cast<const __nv_bfloat16*>(args.y);
  const int32_t* __restrict__ recv_src = args.recv_src;
  const float* __restrict__ row_weights = args.row_weights;
  const int rows_per_expert = d.num_ranks * d.ll_max_tokens;
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  uint32_t* done = ctx.rank_counters;
  const int grid = static_cast<int>(gridDim.x);
  const int units_per_batch = min(max((num_units + grid - 1) / grid, 1), kMaxBatchUnits);
  const int num_batches = (num_units + units_per_batch - 1) / units_per_batch;

  for (int batch = blockIdx.x; batch < num_batches; batch += grid) {
    const int u0 = batch * units_per_batch;
    const int u1 = min(u0 + units_per_batch, num_units);
    if (threadIdx.x < kMaxBatchUnits) s_num_rows[threadIdx.x] = 0;
    // (block_exclusive_scan synchronises before the lists are appended to.)
    // 1. List the batch's rows: chunks of blockDim local experts, their rows
    //    flattened by a prefix sum of the counts (-1, a faulted dispatch: none).
    for (int le0 = 0; le0 < d.experts_per_rank; le0 += blockDim.x) {
      const int le = le0 + static_cast<int>(threadIdx.x);
      const int count = le < d.experts_per_rank ? min(max(args.count[le], 0), rows_per_expert) : 0;
      block_exclusive_scan(count, s_prefix, s_warp_sums);
      const int total = s_prefix[blockDim.x];
      for (int j0 = 0; j0 < total; j0 += kScanUnroll * blockDim.x) {
        int row[kScanUnroll], src[kScanUnroll];
#pragma unroll
        for (int q = 0; q < kScanUnroll; ++q) {
          const int j = j0 + q * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x);
          row[q] = -1;
          src[q] = -1;
          if (j >= total) continue;
          int lo = 0, hi = blockDim.x;  // the expert c with prefix[c] <= j < prefix[c + 1]
          while (hi - lo > 1) {
            const int mid = (lo + hi) / 2;
            if (s_prefix[mid] <= j) lo = mid; else hi = mid;
          }
          row[q] = (le0 + lo) * rows_per_expert + (j - s_prefix[lo]);
          src[q] = __ldg(recv_src + row[q]);
        }
#pragma unroll
        for (int q = 0; q < kScanUnroll; ++q) {
          if (row[q] < 0 || src[q] < u0 || src[q] >= u1) continue;
          const int slot = atomicAdd(&s_num_rows[src[q] - u0], 1);
          if (slot < kMaxTopk) s_rows[src[q] - u0][slot] = row[q];
        }
      }
      __syncthreads();  // the lists are complete; s_prefix may be rewritten
    }
    // Each unit's rows in ascending local expert (= ascending flat row), and
    // their weights. More than K rows cannot come from one dispatch: cut.
    if (threadIdx.x < u1 - u0) {
      const int ub = threadIdx.x;
      const int n = min(s_num_rows[ub], d.num_topk);
      int* rows = s_rows[ub];
      for (int a = 1; a < n; ++a) {
        const int value = rows[a];
        int b = a - 1;
        for (; b >= 0 && rows[b] > value; --b) rows[b + 1] = rows[b];
        rows[b + 1] = value;
      }
      for (int a = 0; a < n; ++a) s_row_weight[ub][a] = __ldg(row_weights + rows[a]);
      s_num_rows[ub] = n;
    }
    __syncthreads();
    // 2. Each unit's row, to its source.
    bool used_rdma = false;
    for (int ub = 0; ub < u1 - u0; ++ub) {
      const int u = u0 + ub, s = u / num_tokens, t = u % num_tokens;
      const int n = s_num_rows[ub];
      if (n == 0 || s_masked[s] != 0) continue;
      char* dst_local = recv_base + (static_cast<size_t>(d.rank) * d.ll_max_tokens + t) * row_bytes;
      auto* dst = static_cast<int4*>(s == d.rank ? dst_local : transport::peer_ptr(dst_local, s));
      // RDMA: staged (combine_stage exists whenever a peer is reachable only so).
      int4* stage = dst != nullptr ? nullptr
                                   : reinterpret_cast<int4*>(ctx.buffers.combine_stage +
                                                             static_cast<size_t>(u) * row_bytes);
      const int* rows = s_rows[ub];
      auto row_of = [&](int j) {
        return reinterpret_cast<const int4*>(y + static_cast<size_t>(rows[j]) * d.hidden);
      };
      sum_rows<true, false>(dst != nullptr ? dst : stage, row_of, s_row_weight[ub], n, num_vec);
      if (dst == nullptr) {
        __syncthreads();  // the staged row is complete
        if (threadIdx.x < kWarpSize) {
          transport::put_warp(dst_local, stage, row_bytes, s, nullptr, 0);
        }
        used_rdma = true;
      }
    }
    transport::complete_block_puts(__syncthreads_or(used_rdma), nullptr, ctx.status);
    __syncthreads();  // every row of the batch is written (or its put completed)
    // 3. Count the batch's units per source; the last publishes the source's rows.
    const int s_first = u0 / num_tokens, s_last = (u1 - 1) / num_tokens;
    for (int s = s_first + static_cast<int>(threadIdx.x); s <= s_last; s += blockDim.x) {
      const uint32_t units = static_cast<uint32_t>(min(u1, (s + 1) * num_tokens) -
                                                   max(u0, s * num_tokens));
      if (atom_add_acq_rel_gpu(done + s, units) + units == static_cast<uint32_t>(num_tokens)) {
        done[s] = 0u;
        if (s_masked[s] == 0) publish_presummed_flag(ctx, flags + d.rank, make_flag(seq, 0), s);
      }
    }
    __syncthreads();  // s_num_rows / s_rows are rewritten by the next batch
  }
}

__device__ __forceinline__ void presummed_recv_part(const LlContext& ctx, uint32_t seq,
                                                    const LlCombineArgs& args,
                                                    const int* s_masked) {
  __shared__ int s_owner[kMaxTopk];
  __shared__ int s_ranks[kMaxTopk];  // the token's ranks, ascending; -1: masked meanwhile
  __shared__ int s_num_ranks;
  __shared__ int s_lost;
  const EpDims d = ctx.dims;
  const int num_tokens = args.num_tokens;
  const int32_t* __restrict__ topk_idx = args.topk_idx;
  auto* __restrict__ out = static_cast<__nv_bfloat16*>(args.out);
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const size_t row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int num_vec = d.hidden / 8;

  for (int t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    if (threadIdx.x < d.num_topk) {
      const int e = topk_idx[t * d.num_topk + threadIdx.x];
      const int r = valid_expert(e, d.num_experts) ? e / d.experts_per_rank : -1;
      s_owner[threadIdx.x] = r >= 0 && s_masked[r] == 0 ? r : -1;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // distinct ranks, ascending (K <= 32 entries)
      int n = 0;
      for (int k = 0; k < d.num_topk; ++k) {
        const int r = s_owner[k];
        if (r < 0) continue;
        int b = n - 1;
        while (b >= 0 && s_ranks[b] > r) --b;
        if (b >= 0 && s_ranks[b] == r) continue;
        for (int c = n - 1; c > b; --c) s_ranks[c + 1] = s_ranks[c];
        s_ranks[b + 1] = r;
        ++n;
      }
      s_num_ranks = n;
      s_lost = 0;
    }
    __syncthreads();
    if (threadIdx.x < s_num_ranks) {
      const int r = s_ranks[threadIdx.x];
      if (ll_wait(ctx, s_masked, flags + r, seq, kOpLlCombine, r, t) == kFlagTimedOut) {
        // Masked on this timeout (mask_on_timeout): it contributes nothing.
        if (rank_masked(ctx, r)) s_ranks[threadIdx.x] = -1; else s_lost = 1;
      }
    }
    __syncthreads();
    if (t == static_cast<int>(blockIdx.x)) profile_waited(ctx, 3);
    auto* out_row = reinterpret_cast<int4*>(out + static_cast<size_t>(t) * d.hidden);
    if (s_lost) {  // a void result must not look valid: NaN
      const int4 nan = make_int4(0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0, 0x7fc07fc0);
      for (int v = threadIdx.x; v < num_vec; v += blockDim.x) out_row[v] = nan;
    } else {
      if (threadIdx.x == 0) {  // drop the ranks masked meanwhile
        int n = 0;
        for (int j = 0; j < s_num_ranks; ++j) {
          if (s_ranks[j] >= 0) s_ranks[n++] = s_ranks[j];
        }
        s_num_ranks = n;
      }
      __syncthreads();
      auto row_of = [&](int j) {  // written by rank s_ranks[j], published by its flag
        return reinterpret_cast<const int4*>(
            recv_base + (static_cast<size_t>(s_ranks[j]) * d.ll_max_tokens + t) * row_bytes);
      };
      sum_rows<false, true>(out_row, row_of, nullptr, s_num_ranks, num_vec);
    }
    __syncthreads();  // s_owner / s_ranks are rewritten for the next token
  }
  // Every peer's flag of this call: the reuse credit (step 5).
  wait_reuse_credits(ctx, s_masked, flags, 1, seq, kOpLlCombine);
}

template <int kParts>
__global__ void __launch_bounds__(kThreads, 1)
    ll_combine_presummed(LlContext ctx, LlCombineArgs args) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  __shared__ int s_masked[kLlMaxRanks];
  DeviceCounters* counters = ctx.counters;
  const uint32_t seq = call_seq<kSend>(&counters->ll_combine_seq, args.ticket_in);
  load_rank_mask(ctx, s_masked);
  __syncthreads();
  if constexpr (kSend) {
    profile_start(ctx, 2);
    presummed_send_part(ctx, seq, args, s_masked);
    if constexpr (kRecv) profile_end_block0(ctx, 2);
  }
  if constexpr (kRecv) {
    profile_start(ctx, 3);
    presummed_recv_part(ctx, seq, args, s_masked);
  }
  finish_call<kParts>(ctx, seq, &counters->ll_combine_send_done, &counters->ll_combine_recv_done,
                      &counters->ll_combine_outstanding, &counters->ll_combine_seq,
                      args.ticket_out, kOpLlCombine, 2);
}

template <int kParts>
cudaError_t LaunchParts(const LlContext& ctx, LlCombineArgs args, cudaStream_t stream) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  if (kRecv && !kSend && args.ticket_in == nullptr) {
    args.ticket_in = &ctx.counters->ll_combine_seq;  // right after its send
  }
  const int units = ctx.dims.num_ranks * args.num_tokens;
  const int work = kSend && kRecv ? (units > args.num_tokens ? units : args.num_tokens)
                   : kSend        ? units
                                  : args.num_tokens;
  ll_combine_presummed<kParts><<<GridSize(ctx, work), kThreads, 0, stream>>>(ctx, args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLlCombinePresummed(const LlContext& ctx, const LlCombineArgs& args,
                                     LlParts parts, cudaStream_t stream) {
  switch (parts) {
    case LlParts::kSend: return LaunchParts<kSendPart>(ctx, args, stream);
    case LlParts::kRecv: return LaunchParts<kRecvPart>(ctx, args, stream);
    case LlParts::kBoth: return LaunchParts<kBothParts>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PrepareLlPresummedKernels() {
  // Load every kernel now, not lazily inside a call while peers spin.
  cudaFuncAttributes attrs;
  cudaError_t err = cudaSuccess;
  for (const void* kernel : {reinterpret_cast<const void*>(ll_combine_presummed<kSendPart>),
                             reinterpret_cast<const void*>(ll_combine_presummed<kRecvPart>),
                             reinterpret_cast<const void*>(ll_combine_presummed<kBothParts>)}) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
