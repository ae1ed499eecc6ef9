// Low-latency (LL) dispatch: one kernel, ll_dispatch, with a send and a
// receive part (the one-call op runs both, every block sends then receives;
// the split ops run one part per kernel, tied by a ticket in device memory).
// The protocol in full, with the one-rank paths, faults, masking and the
// reuse rule: docs/design.md, "LL protocol"; tests/cpu/protocol_model.py
// models it. In short (p: parity of the call's seq; done[] =
// ctx.slot_counters, zero between calls):
//   1. Every block reads this rank's routing into shared memory and counts
//      rows_per_expert[e] and rows_before[e].
//   2. Token t for expert e (owner r, local le) goes to slot rows_before[e] of
//      r's dispatch_recv[p][le][me], in token order, header (t, where, w).
//      NVLink: the payload goes once per owner rank into
//      dispatch_tokens[p][me][t]; RDMA: header and payload are put on QP le.
//   3. After a token's rows, one thread per expert adds 1 to done[e]; the one
//      that completes e resets done[e] and sets r's dispatch_flags[p][le][me] =
//      (seq, rows) (st.release.sys; a signal on QP le over RDMA).
//   4. Receivers wait (bounded) for every (expert, source) flag of seq and
//      copy the rows out in (source rank, source token) order.
// Flags carry seq and buffers alternate by parity, so nothing is reset
// between calls; a timed-out wait voids the call's counts (-1).

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ll_common.cuh"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"
#include "cuda/ll_dispatch_recv.cuh"
#include "cuda/ll_dispatch_send.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kManyRanks = 0, kOneRankTable = 1, kOneRankQueries = 2;
template <bool kFp8, int kParts, int kOneRank = kManyRanks>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch(LlContext ctx, LlDispatchArgs args) {
  extern __shared__ int smem[];
  __shared__ int s_masked[kLlMaxRanks];
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  // BF16 only: an FP8 row would be quantized once per pair by the receiver
  // instead of once per token by the sender (slower: 2026-12-01,
  // docs/benchmarks.md "What was tried").
  constexpr bool kDirectSelf = kSend && kRecv && !kFp8;
  DeviceCounters* counters = ctx.counters;
  if constexpr (kOneRank != kManyRanks) {
    // One rank: no peer can be out of step, so no grid-wide epilogue (the
    // arrival counter and its dependent loads cost about 1.5 us per call) and
    // no look at earlier faults (the host-mapped status word costs about 0.9
    // us to read; the next execution fails on them anyway, in the prepare
    // stage). A split send awaiting its receive is still a protocol fault:
    // thread 0 of every block reads the pairing word at its start (nothing in
    // this kernel writes it; one load per block, not per thread: the same word
    // loaded by every thread cost about 0.26 us of a 3.65 us no-rows kernel,
    // 2026-12-01, docs/benchmarks.md) and the block voids its experts' counts,
    // block 0 records the fault.
    static_assert(kSend && kRecv, "one rank: the one-call op only");
    // Block 0's sequence number, loaded now with the block's other loads and
    // stored at the end (no load after its last store; no measurable change in
    // the kernel's time, 2026-12-01, docs/benchmarks.md).
    const uint32_t seq = blockIdx.x == 0 && threadIdx.x == 0
                             ? call_seq<kSend>(&counters->ll_dispatch_seq, args.ticket_in)
                             : 0u;
    bool void_call;
    if constexpr (kOneRank == kOneRankQueries) {
      profile_start(ctx, 0);
      void_call = dispatch_single_rank_by_queries<kFp8>(ctx, args);
    } else {
      __shared__ uint32_t s_void_call;  // published by the routing pass's first barrier
      if (threadIdx.x == 0) s_void_call = ld_volatile_u32(&counters->ll_dispatch_outstanding);
      load_rank_mask(ctx, s_masked);  // published by the first barrier below
      profile_start(ctx, 0);
      dispatch_single_rank<kFp8>(ctx, args, s_masked, smem, &s_void_call);
      void_call = s_void_call != 0u;
    }
    finish_single_rank_call(ctx, seq, void_call, &counters->ll_dispatch_seq, kOpLlDispatch, 0);
    return;
  }
  const uint32_t seq = call_seq<kSend>(&counters->ll_dispatch_seq, args.ticket_in);
  // A fault recorded before this call voids it too (its waits may have given
  // up at once). Read now, used at the end: the status word is host memory.
  const bool earlier_fault = kRecv && blockIdx.x == 0 && threadIdx.x == 0 &&
                             fault_recorded(ctx.status);
  load_rank_mask(ctx, s_masked);  // published by the first barrier below
  if constexpr (kSend) {
    profile_start(ctx, 0);
    dispatch_send_part<kFp8, kDirectSelf>(ctx, seq, args, s_masked, smem);
    if constexpr (kRecv) profile_end_block0(ctx, 0);
  } else {
    __syncthreads();
  }
  if constexpr (kRecv) {
    profile_start(ctx, 1);
    const bool lost = dispatch_recv_part<kFp8, kDirectSelf>(ctx, seq, args, s_masked);
    if ((lost || earlier_fault) && threadIdx.x == 0) counters->ll_dispatch_lost = 1u;
  }
  const bool last = finish_call<kParts>(ctx, seq, &counters->ll_dispatch_send_done,
                                        &counters->ll_dispatch_recv_done,
                                        &counters->ll_dispatch_outstanding,
                                        &counters->ll_dispatch_seq, args.ticket_out,
                                        kOpLlDispatch, 0);
  // A one-call dispatch while a split send awaits its receive: finish_call
  // recorded a protocol fault, and the sequence numbers of this call are not
  // the peers'.
  const bool protocol_fault = kSend && kRecv && last && counters->ll_dispatch_outstanding != 0u;
  if (kRecv && last && (counters->ll_dispatch_lost != 0u || protocol_fault)) {
    // A wait of this call gave up, an earlier call faulted, or this one broke
    // the pairing: rows are missing or foreign. Counts that cannot be real say
    // so (combine sends nothing for them).
    counters->ll_dispatch_lost = 0u;
    for (int le = 0; le < ctx.dims.experts_per_rank; ++le) args.out_count[le] = -1;
  }
}

// kDirectSelf (one-call ops): a row whose source is this rank is neither copied
// nor announced: the receive part finds it in y through the handle (own_row),
// so this rank's own flags are not set either.

template <int kParts>
cudaError_t LaunchDispatchParts(const LlContext& ctx, LlDispatchArgs args, cudaStream_t stream) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  size_t smem = kSend ? DispatchSendSmem(args.num_tokens, ctx.dims) : 0;
  if (smem > kLlMaxDynamicSmem) return cudaErrorInvalidConfiguration;
  if (kRecv && !kSend && args.ticket_in == nullptr) {
    args.ticket_in = &ctx.counters->ll_dispatch_seq;  // right after its send
  }
  const int work = kSend && kRecv ? std::max(args.num_tokens, ctx.dims.experts_per_rank)
                   : kSend        ? args.num_tokens
                                  : ctx.dims.experts_per_rank;
  const int grid = GridSize(ctx, work);
  auto kernel = args.use_fp8 ? ll_dispatch<true, kParts> : ll_dispatch<false, kParts>;
  if constexpr (kSend && kRecv) {
    if (ctx.dims.num_ranks == 1 &&
        OneRankQueryFits(args.num_tokens, ctx.dims.num_topk, ctx.dims.num_experts, grid)) {
      kernel = args.use_fp8 ? ll_dispatch<true, kParts, kOneRankQueries>
                            : ll_dispatch<false, kParts, kOneRankQueries>;
      smem = 0;  // no routing table
    } else if (ctx.dims.num_ranks == 1) {
      kernel = args.use_fp8 ? ll_dispatch<true, kParts, kOneRankTable>
                            : ll_dispatch<false, kParts, kOneRankTable>;
    }
  }
  kernel<<<grid, kThreads, smem, stream>>>(ctx, args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchLlDispatch(const LlContext& ctx, const LlDispatchArgs& args, LlParts parts,
                             cudaStream_t stream) {
  switch (parts) {
    case LlParts::kSend: return LaunchDispatchParts<kSendPart>(ctx, args, stream);
    case LlParts::kRecv: return LaunchDispatchParts<kRecvPart>(ctx, args, stream);
    case LlParts::kBoth: return LaunchDispatchParts<kBothParts>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

size_t LlDispatchSmemBytes(int num_tokens, const EpDims& dims) {
  return DispatchSendSmem(num_tokens, dims);
}

size_t LlMaxDynamicSmemBytes() { return kLlMaxDynamicSmem; }

cudaError_t PrepareLlDispatchKernels() {
  // Load every kernel now (not lazily inside a call while peers spin) and
  // allow large dynamic shared memory for the send part's routing tables.
  const int max_smem = static_cast<int>(kLlMaxDynamicSmem);
  auto address = [](auto kernel) { return reinterpret_cast<const void*>(kernel); };
  cudaError_t err = cudaSuccess;
  for (const void* kernel : {address(ll_dispatch<false, kSendPart>),
                             address(ll_dispatch<true, kSendPart>),
                             address(ll_dispatch<false, kBothParts>),
                             address(ll_dispatch<true, kBothParts>),
                             address(ll_dispatch<false, kBothParts, kOneRankTable>),
                             address(ll_dispatch<true, kBothParts, kOneRankTable>)}) {
    if (err == cudaSuccess) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
    }
  }
  cudaFuncAttributes attrs;
  for (const void* kernel : {address(ll_dispatch<false, kRecvPart>),
                             address(ll_dispatch<true, kRecvPart>),
                             address(ll_dispatch<false, kBothParts, kOneRankQueries>),
                             address(ll_dispatch<true, kBothParts, kOneRankQueries>)}) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
