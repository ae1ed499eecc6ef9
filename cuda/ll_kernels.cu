// Low-latency (LL) dispatch and combine.
//
// PROTOCOL (R ranks, E experts, E_local = E/R per rank, T = the LL token cap
// per rank (EpDims::ll_max_tokens), p = parity of the call's sequence number
// seq; buffers in ep_types.h LlBuffers;
// done[] = ctx.slot_counters [E], device memory of this rank only, zero
// between calls)
//
// Each op has a send part and a receive part. The one-call ops run both in ONE
// kernel (every block sends, then receives); the split ops (overlap) run one
// part per kernel, tied by a ticket. Fused kernels need all their blocks
// resident at once (a receiving block spins while the rank's last sends may
// still be running): grids never exceed the SM count and use one block per SM.
//
// dispatch send (on every source rank s):
//   1. Every block reads all of this rank's routing into shared memory: the
//      first occurrence of each valid expert on an unmasked rank is kept, and
//      rows_per_expert[e] (tokens sent to e) and rows_before[e] (those before
//      the block's current token) are counted. Out-of-range entries are counted
//      by block 0, which writes num_invalid.
//   2. A token t sent to expert e (owner r = e/E_local, le = e%E_local) goes to
//      slot rows_before[e] of r's dispatch_recv[p][le][s]: rows land in token
//      order, so no atomics decide slots and the receiver never sorts.
//      Every slot's 16-byte header is (t, where, w, 0): w is the pair's weight
//      (the sum of the token's top-k weights choosing e, bits of a float; 0
//      without weights), delivered to the receiver's out_weights.
//      NVLink: the slot gets only the 16-byte header (t, 1, w); the payload goes
//      once per owner rank, not once per expert, into r's
//      dispatch_tokens[p][s][t], written by the token's first expert on r (in
//      k order). This cuts the bytes on the link by the number of the token's
//      experts per rank (about 4 at top-8 over 2 ranks). The one-call BF16
//      op's pairs on this rank itself (r = s) get only the header (t, 2, w):
//      the receive part reads their payload from this call's x, so they skip
//      dispatch_tokens; the split send has no such reader and FP8 rows are
//      quantized once per token by the sender, so those write the payload as
//      for NVLink. RDMA (one QP per
//      expert, so every pair carries its own data): the message
//      [header (t, 0)][payload] is staged in dispatch_stage[t] and put on QP
//      le (its puts are complete or queued on QP le before step 3); with
//      weights, the pair's own header (t, 0, w) is staged in
//      dispatch_header_stage[t][k] and put before the shared payload.
//   3. After a token's rows (block barrier), one thread per expert of the token
//      adds 1 to done[e] (acq_rel, GPU scope). The thread that brings it to
//      rows_per_expert[e] resets done[e] to 0 and sets r's
//      dispatch_flags[p][le][s] = (seq, rows_per_expert[e]) with a system-scope
//      release (NVLink; GPU scope when r = s: only this GPU reads it) or a
//      signal on QP le (RDMA): the release covers every row of e, whichever
//      block wrote it (barrier -> release -> acquire chain).
//      An expert that no token uses gets (seq, 0) at once from block e % grid.
// dispatch recv (on every owner rank r):
//   4. For each local expert le: wait (bounded) for dispatch_flags[p][le][s] to
//      carry seq, for every source s: n_s rows, in slots 0..n_s-1 in token
//      order (a block waits for all its (expert, source) flags at once when
//      they fit one per thread). Output row offset_s + slot, offset_s =
//      sum_{s'<s} n_s': the contract's (source rank, source token) order.
//      count[le] = sum n_s. A slot's header (t, where) says where its payload
//      is: in the slot (where = 0), in dispatch_tokens[p][s][t] (where = 1)
//      or in x[t] (where = 2, s = this rank, one-call BF16 op).
// combine send (on r):
//   5. Row i < count[le] of expert le came from source s, token t (recv_src):
//      y[le][i] goes to s's combine_recv[p][r*E_local+le][t], and/or the row's
//      value row_values[le][i] to s's combine_values[p][r*E_local+le][t]. In
//      the one-call op a row of this rank's own (s = r) is not sent at all:
//      step 6 finds it in y (with one rank the send part does nothing).
//      After all of expert le's rows (block barrier), (seq, 0) is set in
//      combine_flags[p][r*E_local+le] on every rank (NVLink: st.release.sys by
//      one thread, st.release.gpu for r itself; RDMA: signal on QP le after
//      the puts), except r itself in the one-call op.
// combine recv (on s):
//   6. For each token, wait for combine_flags[p][e] = seq of its valid experts;
//      out[t] = sum over valid k of w[t,k] * combine_recv[p][e_k][t], in fp32,
//      in k order (product and sum each rounded: no fused multiply-add), and/or
//      out_pair_values[t][k] = combine_values[p][e_k][t]. One-call op, an
//      expert of s itself: no flag; its row is y[le][i] (row_values[le][i]),
//      i the place of s*T + t in recv_src[le][0 .. count), which ascends
//      (binary search; not there, as after a faulted dispatch: the token's
//      result is void, NaN).
//   7. Reuse credit: once its tokens are done, block 0 also waits for
//      combine_flags[p][q*E_local] = seq (peer q's local expert 0, set by q's
//      step 5 on every rank) from every unmasked peer q, needed or not
//      (ll_common.cuh wait_reuse_credits; why: the reuse rule below).
//
// One rank (R = 1), one-call ops: the dispatch's sender writes the results
// itself (no messages, flags or receive part) and the combine has no send
// part (step 6 reads every row from y). The dispatch goes one of two ways,
// chosen by the launcher (OneRankQueryFits), with the same results: with at
// most one token per block, K <= 8 and at most 4 experts per block, each
// block asks the routing only for its token's rows and its experts' counts
// (dispatch_single_rank_by_queries: registers, warp reductions and one block
// barrier; no shared table, counter or atomic); otherwise every block builds
// the routing table in shared memory (dispatch_single_rank). Neither has the
// last-block epilogue below: block 0 advances the sequence number, and a split
// send of the same kind awaiting its receive (read by every block at its
// start; no block writes it) is recorded as a protocol fault by block 0 and
// voids the dispatch's counts (-1, written by each expert's block). With no
// peer nothing can be out of step, so a fault recorded before the call does
// not void it (the next execution fails on it, in the prepare stage).
//
// Faults: a wait that times out records the fault (device_common.cuh) and the
// call's results are void, so they are marked: a dispatch receive block whose
// wait lost rows (or block 0, when a fault was recorded before the call) sets
// counters->ll_dispatch_lost; the last block then writes count = -1 for every
// local expert (the combine then sends nothing for them) and resets the word;
// so it does when it records a protocol fault itself (a one-call dispatch
// while a split send awaits its receive).
// A combine writes NaN for every token (and pair value) whose expert's flag
// never came. Masked ranks are not a fault: they just contribute nothing.
//
// Rank masking (ctx.masked, 1 = masked; set by the host between calls, or by a
// kernel on a timeout with mask_on_timeout): senders skip pairs whose expert
// lives on a masked rank and rows whose source is masked, and never write a
// masked rank's flags; receivers do not wait for a masked rank and leave its
// rows and experts out (count 0, no contribution).
//
// Pairing: a split send hands its sequence number to its recv as a ticket in
// device memory, so XLA may reorder independent jax_ep calls freely as long as
// every rank runs the same program. At most one split send of each kind may
// await its recv; another send meanwhile is a protocol fault (kStatusProtocol).
// The last block of each kernel (GPU-scope arrival counter) does this
// bookkeeping; it needs no system fence, as later kernels read it.
//
// Why no resets of flags or buffers: flags carry the call's sequence number
// (device_common.cuh), and buffers (dispatch_tokens too) alternate by parity.
// The reuse rule: a peer q writes this rank's parity p of an op kind again
// only in call n+2, and each call's receive waits for a flag of that call
// from every unmasked peer, whatever the routing: q's call n+2 starts after
// q's receive of call n+1 (stream order; a split send waits for its recv
// before the next send, or it is a protocol fault), which waited for this
// rank's flag of call n+1, set in this rank's send of call n+1, after this
// rank's receive of call n read parity p. The dispatch's receive waits for
// every (expert, source) flag (step 4); the combine's waits only for its
// tokens' experts (step 6), so it waits for one flag per peer besides (step
// 7). Without step 7 a rank whose tokens all stay on its own experts waits
// for no peer in a combine: under jax.grad, where XLA may run three combines
// back to back, it wrote a peer's parity-p flag of call n+2 while that peer
// still waited for call n's (f521f4f, all tokens on one rank's experts).
// The same credit orders late writes: a cell with two writers (an LL
// combine's flag of expert e = r is also the pre-summed combine's flag of
// rank r) gets no write of call n once this rank has moved on to call n+2,
// since this rank's receive of call n+1 waited for every peer's credit of
// call n+1, set in that peer's send of call n+1, after its call-n kernel (so
// every write of call n) ended.
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

cudaError_t LaunchLlDispatch(const LlContext& ctx, const LlDispatchArgs& args, LlParts parts,
                             cudaStream_t stream) {
  switch (parts) {
    case LlParts::kSend: return LaunchDispatchParts<kSendPart>(ctx, args, stream);
    case LlParts::kRecv: return LaunchDispatchParts<kRecvPart>(ctx, args, stream);
    case LlParts::kBoth: return LaunchDispatchParts<kBothParts>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t LaunchLlCombine(const LlContext& ctx, const LlCombineArgs& args, LlParts parts,
                            cudaStream_t stream) {
  switch (parts) {
    case LlParts::kSend: return LaunchCombineParts<kSendPart>(ctx, args, stream);
    case LlParts::kRecv: return LaunchCombineParts<kRecvPart>(ctx, args, stream);
    case LlParts::kBoth: return LaunchCombineParts<kBothParts>(ctx, args, stream);
  }
  return cudaErrorInvalidValue;
}

size_t LlDispatchSmemBytes(int num_tokens, const EpDims& dims) {
  return DispatchSendSmem(num_tokens, dims);
}

size_t LlMaxDynamicSmemBytes() { return kLlMaxDynamicSmem; }

cudaError_t PrepareLlKernels() {
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
                             address(ll_dispatch<true, kBothParts, kOneRankQueries>),
                             address(ll_combine<kSendPart>),
                             address(ll_combine<kRecvPart>),
                             address(ll_combine<kBothParts>)}) {
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attrs, kernel);
  }
  return err;
}

}  // namespace jax_ep::cuda
