// Local (single-rank) building blocks of the portable XLA backend.
//
// The portable backend exchanges rows with jax.lax.all_to_all; everything a
// rank does on its own data before and after the exchange lives here, as plain
// C++ over raw pointers (no XLA headers, so the C++ unit tests can call these
// directly). cpu_handlers.cc wraps each one as an XLA FFI handler.
//
// Index conventions shared with jax_ep/backends/xla.py and the CUDA backend:
//   * cleaned top-k indices: int32 in [-1, E), -1 = no expert;
//   * a token's source id is src_rank * T_local + src_token;
//   * HT exchange buffers are [R, T_local, ...] indexed by source token;
//   * LL exchange buffers are [E, T_local, ...] = [R, E_local, T_local, ...],
//     indexed by (global expert, source token).
#ifndef JAX_EP_XLA_FFI_CPU_PORTABLE_OPS_H_
#define JAX_EP_XLA_FFI_CPU_PORTABLE_OPS_H_

#include <cstddef>
#include <cstdint>

namespace jax_ep::cpu {

// Counts of one rank's routing.
//   topk_idx           [num_tokens, num_topk]  raw indices (any value)
//   clean_idx          [num_tokens, num_topk]  out: values outside [-1, E) -> -1
//   tokens_per_rank    [num_ranks]             out: tokens sent to each rank (once per rank)
//   tokens_per_expert  [num_experts]           out: tokens choosing each expert (once per token)
//   is_token_in_rank   [num_tokens, num_ranks] out
// Returns the number of entries outside [-1, E); *first_invalid receives the
// flat position of the first one (or -1).
int32_t Layout(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
               int64_t num_experts, int64_t num_ranks, int32_t* clean_idx,
               int32_t* tokens_per_rank, int32_t* tokens_per_expert,
               bool* is_token_in_rank, int64_t* first_invalid);

// Sender side of the HT dispatch.
//   clean_idx, weights   [T_local, K]
//   row_offset           [R]  row at which this rank's tokens start on each receiver
//   send_idx, send_w     [R, T_local, K] out: idx rewritten to the receiver's local
//                        expert (-1 elsewhere), weight 0 where idx is -1
//   send_slot            [T_local, R] out: r * T_local + t if token t goes to r, else -1
//   send_row             [T_local, R] out: row of token t in r's output, -1 if not
//                        sent or beyond the receiver's capacity (dropped)
void HtRoute(const int32_t* clean_idx, const float* weights, int64_t num_tokens,
             int64_t num_topk, int64_t num_ranks, int64_t experts_per_rank,
             int64_t capacity, const int32_t* row_offset, int32_t* send_idx,
             float* send_w, int32_t* send_slot, int32_t* send_row);

// Receiver side of the HT dispatch: compacts the exchanged rows into
// (source rank, source token) order.
//   recv_idx, recv_w     [R, T_local, K]  a row is present iff some idx >= 0
//   recv_src             [capacity]       out: source id of each output row, -1 = padding
//   out_idx, out_w       [capacity, K]    out: -1 / 0 on padding rows
//   tokens_per_expert    [experts_per_rank] out: kept rows choosing each local expert
//   *num_tokens, *num_dropped             out
void HtCompact(const int32_t* recv_idx, const float* recv_w, int64_t num_ranks,
               int64_t num_tokens_per_rank, int64_t num_topk,
               int64_t experts_per_rank, int64_t capacity, int32_t* recv_src,
               int32_t* out_idx, float* out_w, int32_t* tokens_per_expert,
               int32_t* num_tokens, int32_t* num_dropped);

// Sender side of the LL dispatch.
//   clean_idx   [T_local, K]
//   send_slot   [T_local, K] out: e * T_local + t for the first k choosing expert e,
//               -1 for -1 entries and repeated experts (one row per (token, expert))
//   send_mask   [E, T_local] out: 1 where token t chose expert e
void LlRoute(const int32_t* clean_idx, int64_t num_tokens, int64_t num_topk,
             int64_t num_experts, int32_t* send_slot, int32_t* send_mask);

// Receiver side of the LL dispatch.
//   recv_mask     [R, E_local, T_local]  1 where (src rank, expert, token) arrived
//   recv_src      [E_local, rows_per_expert] out: source id per row, -1 past count
//   count         [E_local] out
//   gather_index  [E_local, rows_per_expert] out: flat index into the exchanged
//                 [R, E_local, T_local] buffer, -1 past count
void LlCompact(const int32_t* recv_mask, int64_t num_ranks,
               int64_t experts_per_rank, int64_t num_tokens_per_rank,
               int64_t rows_per_expert, int32_t* recv_src, int32_t* count,
               int32_t* gather_index);

// out[index[n, m]] = src[n] for 0 <= index < num_out_rows; other rows zero.
void ScatterRows(const void* src, int64_t num_src_rows, int64_t row_bytes,
                 const int32_t* index, int64_t index_width, void* out,
                 int64_t num_out_rows);

// out[n] = src[index[n]] for 0 <= index < num_src_rows; zero otherwise.
void GatherRows(const void* src, int64_t num_src_rows, int64_t row_bytes,
                const int32_t* index, int64_t num_out_rows, void* out);

enum class FloatKind { kF32, kBF16, kF16 };

// out[n] = sum_m weights[n, m] * src[index[n, m]] over 0 <= index < num_src_rows,
// accumulated in fp32 in order of m, cast to the element type of src.
void GatherReduce(FloatKind kind, const void* src, int64_t num_src_rows,
                  int64_t row_elems, const int32_t* index, const float* weights,
                  int64_t num_out_rows, int64_t index_width, void* out);

}  // namespace jax_ep::cpu

#endif  // JAX_EP_XLA_FFI_CPU_PORTABLE_OPS_H_
