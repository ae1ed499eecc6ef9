// Building blocks shared by the low-latency kernels (ll_dispatch.cu,
// ll_combine.cu; ll_presummed_kernels.cu: the combine pre-summed per rank): the
// launch shape, the profile hooks, the calls' sequence numbers and epilogue,
// the rank mask and the bounded waits on peers' flags. Protocols: at the top
// of each kernel file, in full in docs/design.md.
#ifndef JAX_EP_CUDA_LL_COMMON_CUH_
#define JAX_EP_CUDA_LL_COMMON_CUH_

#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ep_types.h"
#include "cuda/limits.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 256;

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

// Fused kernels: block 0 stamps the end of its send part as slot k's end.
__device__ __forceinline__ void profile_end_block0(const LlContext& ctx, int k) {
  if (blockIdx.x == 0) profile_end(ctx, k);
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

// Which parts of an op a kernel runs: the split ops launch one part per
// kernel, the one-call ops one kernel with both.
constexpr int kSendPart = 1;
constexpr int kRecvPart = 2;
constexpr int kBothParts = kSendPart | kRecvPart;

// The call's sequence number: a send (or fused) kernel starts the next one, a
// split receive kernel takes its send's ticket.
template <bool kSend>
__device__ __forceinline__ uint32_t call_seq(const uint32_t* seq_counter,
                                             const uint32_t* ticket_in) {
  return kSend ? ld_volatile_u32(seq_counter) + 1 : ld_volatile_u32(ticket_in);
}

// Every thread: the kernel's bookkeeping, done by one thread of its last block
// (a GPU-scope arrival counter; later kernels read it). Fused kernel: the
// protocol check and the new sequence number. Split send: finish_send. Split
// receive: its send is no longer outstanding. Profile slots: send_slot for the
// send part, send_slot + 1 for the receive part. Returns true in thread 0 of
// the last block, which has then seen every other block's writes (faults
// recorded by their waits included).
template <int kParts>
__device__ __forceinline__ bool finish_call(const LlContext& ctx, uint32_t seq,
                                            uint32_t* send_done, uint32_t* recv_done,
                                            uint32_t* outstanding, uint32_t* seq_counter,
                                            uint32_t* ticket_out, uint32_t op, int send_slot) {
  constexpr bool kSend = (kParts & kSendPart) != 0, kRecv = (kParts & kRecvPart) != 0;
  if (!arrive_is_last_block_gpu(kSend ? send_done : recv_done) || threadIdx.x != 0) return false;
  if constexpr (kSend && kRecv) {
    if (*outstanding != 0u) record_fault(ctx.status, kStatusProtocol, op, ctx.dims.rank, 0);
    *seq_counter = seq;
    profile_end(ctx, send_slot + 1);
  } else if constexpr (kSend) {
    finish_send(ctx, outstanding, seq_counter, seq, ticket_out, op);
    profile_end(ctx, send_slot);
  } else {
    *outstanding = 0u;
    profile_end(ctx, send_slot + 1);
  }
  return true;
}

// The one-call ops at one rank: finish_call's fused bookkeeping without the
// last block (it reads nothing other blocks wrote): thread 0 of block 0
// records a protocol fault when a split send of the op's kind awaited its
// receive at the kernel's start (`split_send_outstanding`, read then; no block
// of a one-call kernel writes it) and stores the call's sequence number.
// Profile slot `slot` ends at block 0's end. Every thread calls it.
__device__ __forceinline__ void finish_single_rank_call(const LlContext& ctx, uint32_t seq,
                                                        bool split_send_outstanding,
                                                        uint32_t* seq_counter, uint32_t op,
                                                        int slot) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (split_send_outstanding) record_fault(ctx.status, kStatusProtocol, op, ctx.dims.rank, 0);
    *seq_counter = seq;  // read by later kernels only
  }
  profile_end_block0(ctx, slot);  // with no last block, the slot times block 0 alone
}

// The rank mask as of the kernel's start, into shared memory (the caller
// synchronises). Waits with mask_on_timeout still check the live mask (ll_wait).
__device__ __forceinline__ void load_rank_mask(const LlContext& ctx, int* s_masked) {
  for (int r = threadIdx.x; r < ctx.dims.num_ranks; r += blockDim.x) {
    s_masked[r] = rank_masked(ctx, r) ? 1 : 0;
  }
}

// Waits for a peer's flag; a peer masked at the kernel's start (s_masked, the
// snapshot of load_rank_mask) is not waited for (kFlagTimedOut). With
// mask_on_timeout a timeout masks the peer instead of recording a fault, and a
// peer masked meanwhile (by another wait) ends the wait. The rank's own flags
// are written on this GPU only: acquire at GPU scope.
__device__ __forceinline__ uint32_t ll_wait(const LlContext& ctx, const int* s_masked,
                                            const uint64_t* flag, uint32_t seq, uint32_t op,
                                            int peer, int detail) {
  if (s_masked[peer] != 0) return kFlagTimedOut;
  const bool own = peer == ctx.dims.rank;
  if (!ctx.mask_on_timeout || ctx.masked == nullptr) {
    return wait_flag(flag, seq, ctx.timeout_ns, ctx.status, op, peer, detail, own);
  }
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
        value = ld_acquire_flag(flag, own);
        return flag_seq(value) == seq || rank_masked(ctx, peer);
      },
      ctx.timeout_ns, ctx.status, mask_peer);
  return arrived && flag_seq(value) == seq ? flag_value(value) : kFlagTimedOut;
}

// The combines' reuse credit (the buffer-reuse rule of the LL protocol, docs/design.md): block 0
// of a combine's receive part waits for one flag of this call from every
// unmasked peer q, the flag at flags[q * stride] (a flag q sets on every rank
// in each call, whatever the routing). q sets it in its send part of this
// call, so after its receive of the call before; this rank's next combine, of
// the other parity, ends only after this wait, so no peer can write this
// call's parity again (two calls later) before this rank has read it, even a
// peer from which this rank needs no row. A timeout is a fault as any other
// (recorded by ll_wait); the results already written stay valid. Every thread
// of block 0 calls it after the receive part's last barrier.
__device__ __forceinline__ void wait_reuse_credits(const LlContext& ctx, const int* s_masked,
                                                   const uint64_t* flags, int stride,
                                                   uint32_t seq, uint32_t op) {
  if (blockIdx.x != 0) return;
  for (int q = threadIdx.x; q < ctx.dims.num_ranks; q += blockDim.x) {
    if (q != ctx.dims.rank) ll_wait(ctx, s_masked, flags + static_cast<size_t>(q) * stride, seq,
                                    op, q, 0);
  }
}

// Whether a wait that returned kFlagTimedOut lost data (a fault: the call's
// results are void) rather than skipped a masked peer (called only then).
__device__ __forceinline__ bool wait_lost(const LlContext& ctx, const int* s_masked, int peer) {
  return s_masked[peer] == 0 && !rank_masked(ctx, peer);
}

// Sets rank r's copy of a flag (local symmetric address `flag`). The rank's
// own flags are read on this GPU only: a GPU-scope release, no peer lookup.
__device__ __forceinline__ void publish_flag(const LlContext& ctx, uint64_t* flag, uint64_t value,
                                             int r, int qp) {
  if (r == ctx.dims.rank) {
    st_release_gpu(flag, value);
  } else {
    transport::set_flag(flag, value, r, ctx.qp_handles, qp);
  }
}

// Blocks of a launch with `work` independent items: at most one per SM (the
// fused kernels need every block resident at once).
inline int GridSize(const LlContext& ctx, int work) {
  return work < 1 ? 1 : (work < ctx.num_sms ? work : ctx.num_sms);
}

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LL_COMMON_CUH_
