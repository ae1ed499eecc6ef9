// Host launchers of the high-throughput kernels (ht_kernels.cu). Plain C++.
#ifndef JAX_EP_CUDA_HT_LAUNCH_H_
#define JAX_EP_CUDA_HT_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/ht_types.h"

namespace jax_ep::cuda {

// Most EP ranks the HT kernels handle (one NVLink domain).
constexpr int kHtMaxRanks = 8;
// Most tokens per rank of an HT dispatch (its senders keep one byte per token,
// and tile bases, in shared memory; jax_ep/backends/cuda.py HT_MAX_TOKENS).
constexpr int kHtMaxTokens = 65536;

// One HT dispatch: count exchange, row pushes, receive epilogue (one kernel
// on `stream`). Rows are `row_bytes` wide (any 16-byte multiple up to the
// receive buffers' row: bf16, f16 or fp8 rows of H; wider rows, e.g. float32,
// take one launch per column range, x and out_x then pointing at the range's
// first byte with their full row strides); optional per-row scales of
// `scale_bytes`. After a fault (a timed-out wait in this call or an
// earlier one) num_tokens, num_dropped and tokens_per_expert are -1.
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
};
cudaError_t LaunchHtDispatch(const HtContext& ctx, const HtDispatchArgs& args, cudaStream_t stream);

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

cudaError_t PrepareHtKernels();

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_LAUNCH_H_
