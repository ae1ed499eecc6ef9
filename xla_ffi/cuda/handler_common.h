// Shared decoding and checks of the CUDA FFI handlers.
#ifndef JAX_EP_XLA_FFI_CUDA_HANDLER_COMMON_H_
#define JAX_EP_XLA_FFI_CUDA_HANDLER_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/runtime.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep::ffi_cuda {

namespace ffi = ::xla::ffi;

// One FFI target: the name jax_ep/backends/cuda.py calls, and its handler.
struct HandlerEntry {
  const char* name;
  XLA_FFI_Handler* handler;
};

// The EpConfig a call was traced with: one struct attribute, "config", that
// every jax_ep target binds (jax_ep/backends/cuda.py builds it).
struct CallConfig {
  int64_t num_ranks;
  int64_t num_experts;
  int64_t hidden;
  int64_t max_tokens;
  int64_t ll_max_tokens;
  int64_t num_topk;
};

std::string DimsText(const cuda::EpDims& d);

// Checks the runtime is up, sized for the traced config, on this device, and
// that no earlier fault is pending; returns the runtime.
ffi::ErrorOr<const cuda::Runtime*> RuntimeFor(const char* op, const CallConfig& traced,
                                              int32_t device_ordinal, bool need_low_latency,
                                              bool need_high_throughput);

ffi::Error LaunchError(const char* op, cudaError_t err);

// The error of an earlier fault recorded by a kernel (host-mapped status
// word), or success.
ffi::Error PendingFault(const char* op, const cuda::Runtime& runtime);

// Prepare-stage handler shared by every jax_ep target: XLA runs it on the host
// before each execution, also when the op sits inside a command buffer (whose
// replays do not call the execute stage), so a recorded fault fails the next
// execution before anything is launched. Binds nothing it does not need.
XLA_FFI_Handler* PrepareStatusCheckHandler();

std::string ShapeText(ffi::Span<const int64_t> dims);

}  // namespace jax_ep::ffi_cuda

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::jax_ep::ffi_cuda::CallConfig,
                                      ::xla::ffi::StructMember<int64_t>("num_ranks"),
                                      ::xla::ffi::StructMember<int64_t>("num_experts"),
                                      ::xla::ffi::StructMember<int64_t>("hidden"),
                                      ::xla::ffi::StructMember<int64_t>("max_tokens"),
                                      ::xla::ffi::StructMember<int64_t>("ll_max_tokens"),
                                      ::xla::ffi::StructMember<int64_t>("num_topk"));

#endif  // JAX_EP_XLA_FFI_CUDA_HANDLER_COMMON_H_
