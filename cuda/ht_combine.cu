// HT combine over NVLink (R <= kHtMaxRanks): ht_combine_send, then
// ht_combine_recv. The protocol in full: docs/design.md, "HT protocol";
// tests/cpu/protocol_model.py models it. In short (seq: the combine's sequence
// number; p = seq parity):
//   send: received row i (source s != me, token t) goes to s's
//     combine_recv[p][me][t]; every thread fences, and the last block sets
//     combine_flags[p][me] = seq on every rank. Rows of this rank stay in y.
//   recv: waits (bounded) for every rank's flag; out[t] = the sum in fp32, in
//     rank order, over the ranks r with send_row[t][r] >= 0 of
//     combine_recv[p][r][t] (r != me) or y[send_row[t][me]] (r == me).
// At one rank only recv runs. A combine sends without a handshake, so its
// buffers alternate by parity: a peer writes parity p again only after
// receiving this rank's rows of the combine in between, sent after this rank
// read parity p. Rows wider than the 2H-byte combine_recv rows travel in
// passes, each a send and a receive with its own seq. A fault gives NaN rows
// for the tokens whose rows did not all arrive.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_combine_common.cuh"
#include "cuda/ht_common.cuh"
#include "cuda/ht_row_elements.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

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

cudaError_t PrepareHtCombineKernels() {
  cudaFuncAttributes attrs;
  cudaError_t err = cudaFuncGetAttributes(&attrs, ht_combine_send);
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
