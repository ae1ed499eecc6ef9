// XLA FFI handlers (CPU platform) of the portable backend's local steps.
// Each handler decodes and validates its buffers, then calls portable_ops.h.
#ifndef JAX_EP_XLA_FFI_CPU_CPU_HANDLERS_H_
#define JAX_EP_XLA_FFI_CPU_CPU_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

namespace jax_ep::cpu {

namespace ffi = ::xla::ffi;

// One entry per target: the name jax_ep/local_ops.py registers and calls.
struct HandlerEntry {
  const char* name;
  XLA_FFI_Handler* handler;
};

// All CPU targets, null-terminated.
const HandlerEntry* CpuHandlers();

// The implementations, exposed for the C++ unit tests.
// first_invalid: int32[3] = (token, slot, value) of the first index outside
// [-1, E), or (-1, -1, 0).
ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                      int64_t num_ranks, ffi::ResultBuffer<ffi::S32> clean_idx,
                      ffi::ResultBuffer<ffi::S32> num_invalid,
                      ffi::ResultBuffer<ffi::S32> first_invalid,
                      ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::PRED> is_token_in_rank);

// EpConfig(debug_checks=True): fails on every rank when any rank saw an
// invalid index (a check on one rank only would leave the others waiting in
// the next collective). Inputs gathered over the EP axis:
//   invalid_counts int32[R], first_invalid int32[R, 3] (see LayoutImpl).
// Passes clean_idx through, so the exchange that follows depends on it.
ffi::Error CheckInvalidImpl(ffi::Buffer<ffi::S32> clean_idx, ffi::Buffer<ffi::S32> invalid_counts,
                            ffi::Buffer<ffi::S32> first_invalid, int64_t num_experts,
                            ffi::ResultBuffer<ffi::S32> checked_idx);

ffi::Error ScatterRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                           ffi::Result<ffi::AnyBuffer> out);

ffi::Error GatherRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                          ffi::Result<ffi::AnyBuffer> out);

ffi::Error GatherReduceImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::F32> weights,
                            ffi::Result<ffi::AnyBuffer> out);

}  // namespace jax_ep::cpu

#endif  // JAX_EP_XLA_FFI_CPU_CPU_HANDLERS_H_
