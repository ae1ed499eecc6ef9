// Host launchers of the high-throughput kernels (ht_dispatch.cu, ht_combine.cu,
// ht_pair_plan.cu, ht_pair_combine.cu). Plain C++.
#ifndef JAX_EP_CUDA_HT_LAUNCH_H_
#define JAX_EP_CUDA_HT_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ht_types.h"
#include "cuda/limits.h"

namespace jax_ep::cuda {

// One HT dispatch: count exchange, row pushes, receive epilogue (one kernel
// on `stream`). Rows are `row_bytes` wide (any 16-byte multiple up to the
// receive buffers' row: bf16, f16 or fp8 rows of H; wider rows, e.g. float32,
// take one launch per column range, x and out_x then pointing at the range's
// first byte with their full row strides); optional per-row scales of
// `scale_bytes`. After a fault (a timed-out wait in this call or an
// earlier one) num_tokens, num_dropped and tokens_per_expert are -1.
// The expert-major outputs of a dispatch (num_rows > 0): out_x then holds
// M = num_rows pair rows (jax_ep/expert_major.py states the row formula), the
// receive rows stay in the symmetric buffers, out_idx and out_w are unused,
// out_tokens_per_expert counts the pairs kept per local expert and
// out_num_dropped the pairs past M; out_recv_src, out_send_row and
// out_num_tokens keep the token-major staging rows (capacity R * T). Needs
// LaunchHtPairPlan on the same stream before (at one rank it launches nothing:
// the dispatch kernel ranks its own pairs). After a fault num_pairs is -1
// and group_sizes 0.
struct HtPairArgs {
  int num_rows;                  // M (0: a token-major dispatch)
  int alignment;                 // A
  int32_t* out_pair_expert;      // [M] local expert of each pair row, -1 on padding
  float* out_pair_weight;        // [M] the token's weights for it, summed in k order
  int32_t* out_pair_src;         // [M] staging row of each pair row, -1 on padding
  int32_t* out_num_pairs;        // []
  int32_t* out_group_sizes;      // [E_local]
  int32_t* out_slot_row;         // [C, K] pair row of each (row, k), -1 elsewhere
  int32_t* out_rows_by_expert;   // [C, K] a row's pair rows in ascending expert, then -1
};

struct HtDispatchArgs {
  const void* x;               // [T, row_bytes]
  const void* scales;          // [T, scale_bytes] or null
  const int32_t* topk_idx;     // [T, K]
  const float* topk_weights;   // [T, K]
  int num_tokens;              // T (this rank)
  int capacity;                // C: rows of the outputs
  size_t row_bytes;            // bytes of each row this launch moves
  size_t x_row_stride;         // bytes between rows of x (>= row_bytes)
  size_t out_row_stride;       // bytes between rows of out_x (>= row_bytes)
  size_t scale_bytes;
  void* out_x;                 // [C, row_bytes]
  void* out_scales;            // [C, scale_bytes] or null
  int32_t* out_idx;            // [C, K]
  float* out_w;                // [C, K]
  int32_t* out_num_tokens;     // []
  int32_t* out_tokens_per_expert;  // [E_local]
  int32_t* out_num_dropped;    // []
  int32_t* out_num_invalid;    // []
  int32_t* out_recv_src;       // [C] src_rank * T + src_token, -1 on padding
  int32_t* out_send_row;       // [T, R] row of token t on rank r, -1 if not there
  HtPairArgs pairs;            // expert-major (pairs.num_rows > 0)
};
cudaError_t LaunchHtDispatch(const HtContext& ctx, const HtDispatchArgs& args, cudaStream_t stream);

// The pair plan of an expert-major dispatch (ht_pair_plan.cu): this rank's
// tokens' ranks per expert, into ctx.buffers.plan_*; once per dispatch, before
// its LaunchHtDispatch calls.
cudaError_t LaunchHtPairPlan(const HtContext& ctx, const int32_t* topk_idx, int num_tokens,
                             cudaStream_t stream);

// Element types of the HT combine's rows (summed in fp32, stored in this type).
enum class HtRowType : int32_t { kBf16 = 0, kF16 = 1, kF32 = 2 };

// One HT combine: y [C, W] rows back to their sources, summed in fp32, W
// columns of `row_type`. The rows travel in passes of at most 2H bytes (the
// receive buffers' row size): columns [c0, c0 + n) per pass, each pass one
// send and one receive kernel with its own sequence number.
struct HtCombineArgs {
  const void* y;               // [C, W]
  const int32_t* recv_src;     // [C]
  const int32_t* send_row;     // [T, R]
  const int32_t* num_tokens;   // [] valid rows of y (device scalar; -1 after a fault: none)
  int capacity;                // C
  int num_local_tokens;        // T
  int num_columns;             // W; W * element size must be a multiple of 16 bytes
  HtRowType row_type;
  void* out;                   // [T, W] of row_type; NaN rows for tokens whose
                               // rows did not all arrive (a timeout)
};
cudaError_t LaunchHtCombine(const HtContext& ctx, const HtCombineArgs& args, cudaStream_t stream);

// An expert-major combine (ht_pair_combine.cu): y [M, W] pair rows ->
// out [T, W]: per rank, the float32 sum of a token's pair rows in ascending
// local expert (rows_by_expert); those partials, float32 on the wire, summed
// in rank order; rounded once to row_type.
struct HtPairCombineArgs {
  const void* y;                     // [M, W]
  const int32_t* rows_by_expert;     // [C, K]
  const int32_t* recv_src;           // [C]
  const int32_t* send_row;           // [T, R]
  const int32_t* num_tokens;         // [] staging rows (device; -1 after a fault)
  int capacity;                      // C
  int num_local_tokens;              // T
  int num_columns;                   // W (W * element size a multiple of 16 bytes)
  HtRowType row_type;
  void* out;                         // [T, W]; NaN rows where rows did not all arrive
};
cudaError_t LaunchHtPairCombine(const HtContext& ctx, const HtPairCombineArgs& args,
                                cudaStream_t stream);

// out[i][k] = values[slot_row[i][k]] where slot_row >= 0, else 0 (the weight
// gradient's per-slot values; local, no peer).
cudaError_t LaunchHtSlotValues(const float* values, const int32_t* slot_row, int num_slots,
                               float* out, cudaStream_t stream);

// Load the HT kernels and set their shared memory limits (at initialize, not
// lazily inside a call while peers spin).
cudaError_t PrepareHtDispatchKernels();  // ht_dispatch.cu
cudaError_t PrepareHtCombineKernels();   // ht_combine.cu
inline cudaError_t PrepareHtKernels() {
  const cudaError_t err = PrepareHtDispatchKernels();
  return err != cudaSuccess ? err : PrepareHtCombineKernels();
}
cudaError_t PrepareHtPairPlan();

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_LAUNCH_H_
