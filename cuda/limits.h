// The kernels' limits that the host side must respect. Plain C++ (no CUDA):
// the kernels size shared memory and grids with these, the handlers check
// calls against them, and both extension modules export them to Python
// (xla_ffi/exports.h; jax_ep/_extension.py limits()), so that no Python
// literal copies one.
#ifndef JAX_EP_CUDA_LIMITS_H_
#define JAX_EP_CUDA_LIMITS_H_

#include <cstddef>

namespace jax_ep::cuda {

// Top-k entries of a token: one lane (or thread) per entry.
constexpr int kMaxTopk = 32;

// High throughput.
// Most EP ranks (one NVLink domain).
constexpr int kHtMaxRanks = 8;
// Most tokens per rank of one dispatch: its senders keep one byte per token,
// and tile bases, in shared memory.
constexpr int kHtMaxTokens = 65536;
// Most experts per rank: the dispatch counts pairs per local expert in
// shared memory.
constexpr int kHtMaxExpertsPerRank = 1024;
// Rows per completion counter of a dispatch: the receiver copies a chunk out
// as soon as its rows have landed, while the rest are still in flight.
constexpr int kHtChunkRows = 32;
// Most blocks of the pair plan's kernels (their per-block counts live in
// plan_block_counts). At one rank those kernels do not run: each block of the
// expert-major dispatch kernel writes its own row, and that kernel's grid is
// cut to kHtOneRankPlanBlocks (more than any GPU's SMs today).
constexpr int kHtPlanBlocks = 64;
constexpr int kHtOneRankPlanBlocks = 256;

// Low latency.
// Most EP ranks: the kernels keep one mask word per rank in shared memory.
constexpr int kLlMaxRanks = 1024;
// Dynamic shared memory of the dispatch's send part (its routing table:
// 4 bytes per (token, top-k) entry and more, ll_dispatch_send.cuh).
constexpr size_t kLlMaxDynamicSmem = 200 * 1024;

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_LIMITS_H_
