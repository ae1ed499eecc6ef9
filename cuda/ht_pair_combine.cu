// The expert-major HT combine: pair rows back to their tokens, summed per
// rank in ascending local expert and then over ranks; and the weight
// gradient's per-slot values.
//
// PROTOCOL (seq = ht_combine_seq + 1 for each pass: the token-major combine's
// counter, receive rows, flags and parity rules, ht_combine.cu)
//   ht_pair_combine_send (R > 1): staging row i < valid whose source s is not
//     this rank (token t): its float32 partial P = 0.0f + y[p_0] + y[p_1] ...
//     over rows_by_expert[i] (ascending local expert, up to the first -1), of
//     the pass's columns, to s's combine_recv[p][me][t] (p = seq parity); then
//     every thread fences and the last block sets combine_flags[p][me] = seq
//     on every rank.
//   ht_pair_combine_recv: waits for every rank's flag of seq (R > 1); out[t] =
//     0.0f + P_0 + P_1 ... in rank order over the ranks r with send_row[t][r]
//     >= 0, where P_me is computed here from y the same way and P_r is
//     combine_recv[p][r][t]; rounded once to the rows' type. A token whose
//     partials did not all arrive (a peer's flag timed out, or the dispatch
//     faulted: num_tokens < 0) gets NaN. The last block (block 0 alone at one
//     rank, unprofiled) advances ht_combine_seq; the receive rows are reused
//     as the token-major combine reuses them.
//   Passes: a partial of W columns is 4W bytes, so columns travel in passes of
//   at most H/2 (the 2H-byte receive rows), each pass one send and one receive
//   kernel with its own sequence number. At one rank nothing travels: one
//   receive kernel over every column.
// The sums are the portable path's (jax_ep/expert_major.py): the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_combine_common.cuh"
#include "cuda/ht_launch.h"
#include "cuda/ht_pair_sum.cuh"
#include "cuda/ht_row_elements.cuh"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// Lane j < K: pair row j of staging row `row`; returns how many lead the list.
__device__ __forceinline__ int load_pair_rows(const int32_t* rows_by_expert, int row, int num_topk,
                                              int lane, int* pair_row) {
  *pair_row = lane < num_topk ? rows_by_expert[static_cast<size_t>(row) * num_topk + lane] : -1;
  const uint32_t missing = __ballot_sync(0xffffffffu, lane >= num_topk || *pair_row < 0);
  return missing == 0u ? kWarpSize : __ffs(missing) - 1;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    ht_pair_combine_send(HtContext ctx, HtPairCombineArgs args, PairPass pass) {
  using E = RowElements<T>;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  char* recv_base = ctx.buffers.combine_recv[seq & 1];
  uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const size_t row_stride = static_cast<size_t>(args.num_columns) * sizeof(T);
  const size_t buffer_row_bytes = static_cast<size_t>(d.hidden) * 2;
  const int valid = min(*args.num_tokens, args.capacity);  // -1 after a faulted dispatch
  for (int i = blockIdx.x * kWarps + warp; i < valid; i += gridDim.x * kWarps) {
    const int src = args.recv_src[i];
    if (src < 0 || args.num_local_tokens <= 0) continue;
    const int s = src / args.num_local_tokens, t = src % args.num_local_tokens;
    if (s >= R || s == d.rank) continue;  // own partials are summed by the receive kernel
    int pair_row;
    const int num_pairs = load_pair_rows(args.rows_by_expert, i, d.num_topk, lane, &pair_row);
    auto* dst = reinterpret_cast<float4*>(
        static_cast<char*>(transport::peer_ptr(recv_base, s)) +
        (static_cast<size_t>(d.rank) * d.max_tokens + t) * buffer_row_bytes);
    for_each_pair_sum<T>(static_cast<const char*>(args.y), row_stride, pass, pair_row, num_pairs,
                         lane, [&](int v, const float(&partial)[E::kPerVector]) {
                           if (v >= pass.num_vectors) return;
#pragma unroll
                           for (int h = 0; h < E::kPerVector / 4; ++h) {
                             dst[v * (E::kPerVector / 4) + h] =
                                 make_float4(partial[4 * h], partial[4 * h + 1],
                                             partial[4 * h + 2], partial[4 * h + 3]);
                           }
                         });
  }
  if (arrive_is_last_block(&ctx.counters->ht_combine_send_done)) {
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
      transport::set_flag(flags + d.rank, make_flag(seq, 1), r, nullptr, 0);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1)
    ht_pair_combine_recv(HtContext ctx, HtPairCombineArgs args, PairPass pass) {
  using E = RowElements<T>;
  const EpDims d = ctx.dims;
  const int R = d.num_ranks;
  const uint32_t seq = ld_volatile_u32(&ctx.counters->ht_combine_seq) + 1;
  const char* recv_base = ctx.buffers.combine_recv[seq & 1];
  const uint64_t* flags = ctx.buffers.combine_flags[seq & 1];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const size_t row_stride = static_cast<size_t>(args.num_columns) * sizeof(T);
  const size_t buffer_row_bytes = static_cast<size_t>(d.hidden) * 2;
  const uint32_t lost = combine_lost_ranks(ctx, flags, seq, args.num_tokens, /*wait_peers=*/R > 1);
  const int valid = min(*args.num_tokens, args.capacity);
  for (int t = blockIdx.x * kWarps + warp; t < args.num_local_tokens; t += gridDim.x * kWarps) {
    const int rank_row = lane < R ? args.send_row[static_cast<size_t>(t) * R + lane] : -1;
    const uint32_t holders = __ballot_sync(0xffffffffu, rank_row >= 0);
    int4* out_row = reinterpret_cast<int4*>(static_cast<char*>(args.out) +
                                            static_cast<size_t>(t) * row_stride) +
                    pass.first_vector;
    if ((holders & lost) != 0u) {
      store_nan_row<T>(out_row, pass.num_vectors, lane);
      continue;
    }
    const int own_row = __shfl_sync(0xffffffffu, rank_row, d.rank);
    int pair_row = -1, num_pairs = 0;
    if (own_row >= 0 && own_row < valid) {
      num_pairs = load_pair_rows(args.rows_by_expert, own_row, d.num_topk, lane, &pair_row);
    }
    // Vector v of the token: 0.0f + P_0 + P_1 ... over the holders in rank
    // order, P_me = own (this rank's partial), the others' from their rows.
    auto finish = [&](int v, const float(&own)[E::kPerVector]) {
      if (v >= pass.num_vectors) return;
      float total[E::kPerVector];
      // One rank: the only holder is this one, so the rank loop is skipped.
#pragma unroll
      for (int j = 0; j < E::kPerVector; ++j) total[j] = R == 1 ? 0.0f + own[j] : 0.0f;
      for (int r = 0; R > 1 && r < R; ++r) {
        if (((holders >> r) & 1u) == 0u) continue;
        if (r == d.rank) {
#pragma unroll
          for (int j = 0; j < E::kPerVector; ++j) total[j] += own[j];
          continue;
        }
        // Written by peer r's send kernel, published by its flag (acquired above).
        const float4* src = reinterpret_cast<const float4*>(
            recv_base + (static_cast<size_t>(r) * d.max_tokens + t) * buffer_row_bytes);
#pragma unroll
        for (int h = 0; h < E::kPerVector / 4; ++h) {
          const int4 raw = ld_v4_no_alloc(
              reinterpret_cast<const int4*>(src + v * (E::kPerVector / 4) + h), true);
          total[4 * h] += __int_as_float(raw.x);
          total[4 * h + 1] += __int_as_float(raw.y);
          total[4 * h + 2] += __int_as_float(raw.z);
          total[4 * h + 3] += __int_as_float(raw.w);
        }
      }
      st_na_v4(out_row + v, E::pack(total));
    };
    if (((holders >> d.rank) & 1u) != 0u) {
      for_each_pair_sum<T>(static_cast<const char*>(args.y), row_stride, pass, pair_row,
                           num_pairs, lane, finish);
    } else {
      const float none[E::kPerVector] = {};  // unread: this rank holds no row of t
      for (int base = 0; base < pass.num_vectors; base += kWarpSize) finish(base + lane, none);
    }
  }
  if (runs_epilogue(&ctx.counters->ht_combine_recv_done, R == 1 && ctx.profile == nullptr)) {
    ctx.counters->ht_combine_seq = seq;
  }
}

template <typename T>
cudaError_t LaunchPairPasses(const HtContext& ctx, const HtPairCombineArgs& args,
                             cudaStream_t stream) {
  constexpr int kPerVector = RowElements<T>::kPerVector;
  const int grid = std::max(1, ctx.num_sms);
  const int row_vectors = args.num_columns / kPerVector;
  // A pass's float32 partial fills at most one 2H-byte receive row.
  const int pass_vectors = ctx.dims.num_ranks == 1
                               ? row_vectors
                               : (ctx.dims.hidden * 2 / 4) / kPerVector;
  if (pass_vectors <= 0) return cudaErrorInvalidValue;
  for (int first = 0; first < row_vectors; first += pass_vectors) {
    const PairPass pass{first, std::min(pass_vectors, row_vectors - first)};
    if (ctx.dims.num_ranks > 1) {
      ht_pair_combine_send<T><<<grid, kThreads, 0, stream>>>(ctx, args, pass);
    }
    ht_pair_combine_recv<T><<<grid, kThreads, 0, stream>>>(ctx, args, pass);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

__global__ void ht_slot_values(const float* values, const int32_t* slot_row, int num_slots,
                               float* out) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < num_slots;
       i += gridDim.x * blockDim.x) {
    const int row = slot_row[i];
    out[i] = row >= 0 ? values[row] : 0.0f;
  }
}

}  // namespace

cudaError_t LaunchHtPairCombine(const HtContext& ctx, const HtPairCombineArgs& args,
                                cudaStream_t stream) {
  const size_t element_bytes = args.row_type == HtRowType::kF32 ? 4 : 2;
  if (ctx.dims.num_ranks > kHtMaxRanks || ctx.dims.hidden % 8 != 0 || args.num_columns <= 0 ||
      (static_cast<size_t>(args.num_columns) * element_bytes) % 16 != 0 ||
      ctx.dims.num_topk > kWarpSize) {
    return cudaErrorInvalidValue;
  }
  switch (args.row_type) {
    case HtRowType::kBf16: return LaunchPairPasses<__nv_bfloat16>(ctx, args, stream);
    case HtRowType::kF16: return LaunchPairPasses<__half>(ctx, args, stream);
    case HtRowType::kF32: return LaunchPairPasses<float>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchHtSlotValues(const float* values, const int32_t* slot_row, int num_slots,
                               float* out, cudaStream_t stream) {
  if (num_slots <= 0) return cudaSuccess;
  const int threads = 256;
  const int grid = std::min(1024, (num_slots + threads - 1) / threads);
  ht_slot_values<<<grid, threads, 0, stream>>>(values, slot_row, num_slots, out);
  return cudaGetLastError();
}

}  // namespace jax_ep::cuda
