// Host launchers of the low-latency kernels (ll_dispatch.cu, ll_combine.cu,
// ll_presummed_kernels.cu). Plain C++: the FFI glue in xla_ffi/cuda/ calls
// these without seeing CUDA device code.
// Shapes: T = this call's tokens, T_ll = EpDims::ll_max_tokens, R ranks,
// E_local experts per rank, H hidden, K top-k.
#ifndef JAX_EP_CUDA_LL_LAUNCH_H_
#define JAX_EP_CUDA_LL_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ep_types.h"

namespace jax_ep::cuda {

// Which parts of an op one launch runs: the one-call ops run both in one
// kernel; the split ops (overlap) run the send in one call and the receive
// in a later one, tied by a ticket (the send's sequence number, a device
// scalar written by the send and read by the receive).
enum class LlParts { kSend, kRecv, kBoth };

// One LL dispatch. Send part: x, topk_idx, topk_weights, num_invalid,
// ticket_out; receive part: ticket_in and the out_* buffers.
struct LlDispatchArgs {
  const void* x;               // bf16 [T, H]
  const int32_t* topk_idx;     // [T, K]
  // [T, K] or null. When given, each (token, expert) pair carries the sum of
  // the token's weights that chose that expert, delivered in out_weights.
  const float* topk_weights;
  int num_tokens;              // T (<= T_ll)
  bool use_fp8;                // rows travel as e4m3 + float32 scales per 128 channels
  int32_t* num_invalid;        // [] top-k entries outside [-1, E)
  uint32_t* ticket_out;        // split send: its sequence number, for the receive
  const uint32_t* ticket_in;   // split receive: the send's ticket (null: right after it)
  void* out_x;                 // [E_local, R*T_ll, H] bf16 (or e4m3 with use_fp8)
  float* out_scales;           // [E_local, R*T_ll, H/128] (use_fp8) or null
  int32_t* out_count;          // [E_local]; -1 when the call saw a fault
  int32_t* out_recv_src;       // [E_local, R*T_ll] src_rank * T + src_token, -1 past count
  float* out_weights;          // [E_local, R*T_ll] pair weights (0 past count), or null
};

// One LL combine. Send part: y and/or row_values, recv_src, count,
// ticket_out; receive part: topk_idx, topk_weights, ticket_in, out and/or
// out_pair_values.
struct LlCombineArgs {
  const void* y;               // bf16 [E_local, R*T_ll, H] rows to return, or null
  const float* row_values;     // [E_local, R*T_ll] a value per row to return, or null
  const int32_t* recv_src;     // [E_local, R*T_ll] from the dispatch
  const int32_t* count;        // [E_local] from the dispatch
  const int32_t* topk_idx;     // [T, K] the dispatch's routing
  const float* topk_weights;   // [T, K] (used with y; not by the pre-summed combine)
  // [E_local, R*T_ll] the pre-summed combine's weight of each row (the
  // dispatch's LlDispatchArgs::out_weights); send part only.
  const float* row_weights;
  int num_tokens;              // T of the dispatch
  uint32_t* ticket_out;
  const uint32_t* ticket_in;
  // bf16 [T, H]: sum over valid k of topk_weights[t, k] * y row of (t, e_k),
  // in fp32 in k order; NaN rows for tokens whose expert rows did not arrive
  // (timeout). Null when y is null.
  void* out;
  // [T, K]: row_values of the row of (t, e_k) for valid k, else 0; NaN where
  // it did not arrive. Null when row_values is null.
  float* out_pair_values;
};

cudaError_t LaunchLlDispatch(const LlContext& ctx, const LlDispatchArgs& args, LlParts parts,
                             cudaStream_t stream);
cudaError_t LaunchLlCombine(const LlContext& ctx, const LlCombineArgs& args, LlParts parts,
                            cudaStream_t stream);

// The combine pre-summed per rank (ll_presummed_kernels.cu): the weights came
// with the dispatch, so each rank returns one row per (source token, rank):
// out[t] = bf16(sum over the ranks r holding t's experts, in rank order, in
// fp32, of p_r[t]), p_r[t] = bf16(sum over t's rows on r in ascending local
// expert, in fp32, of row_weights * y row). Uses y, row_weights, recv_src,
// count (send part), topk_idx, out (receive part) and the tickets; no
// row_values or pair values.
cudaError_t LaunchLlCombinePresummed(const LlContext& ctx, const LlCombineArgs& args,
                                     LlParts parts, cudaStream_t stream);

// Dynamic shared memory the dispatch send part needs for num_tokens tokens, and
// the most a kernel may use (larger batches are refused: use the HT ops).
size_t LlDispatchSmemBytes(int num_tokens, const EpDims& dims);
size_t LlMaxDynamicSmemBytes();

// Loads the LL kernels and sets their attributes (call once at initialisation).
cudaError_t PrepareLlDispatchKernels();  // ll_dispatch.cu
cudaError_t PrepareLlCombineKernels();   // ll_combine.cu
inline cudaError_t PrepareLlKernels() {
  const cudaError_t err = PrepareLlDispatchKernels();
  return err != cudaSuccess ? err : PrepareLlCombineKernels();
}
cudaError_t PrepareLlPresummedKernels();

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LL_LAUNCH_H_
