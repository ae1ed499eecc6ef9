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
ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                      int64_t num_ranks, bool debug_checks,
                      ffi::ResultBuffer<ffi::S32> clean_idx,
                      ffi::ResultBuffer<ffi::S32> num_invalid,
                      ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::PRED> is_token_in_rank);

ffi::Error ScatterRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                           ffi::Result<ffi::AnyBuffer> out);

ffi::Error GatherRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                          ffi::Result<ffi::AnyBuffer> out);

ffi::Error GatherReduceImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::F32> weights,
                            ffi::Result<ffi::AnyBuffer> out);

}  // namespace jax_ep::cpu

#endif  // JAX_EP_XLA_FFI_CPU_CPU_HANDLERS_H_
