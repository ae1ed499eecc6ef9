// CUDA FFI handlers of the high-throughput ops (ht_handlers.cc).
#ifndef JAX_EP_XLA_FFI_CUDA_HT_HANDLERS_H_
#define JAX_EP_XLA_FFI_CUDA_HT_HANDLERS_H_

#include <vector>

#include "xla_ffi/cuda/handler_common.h"

namespace jax_ep::ffi_cuda {

void AppendHtHandlers(std::vector<HandlerEntry>* entries);

}  // namespace jax_ep::ffi_cuda

#endif  // JAX_EP_XLA_FFI_CUDA_HT_HANDLERS_H_
