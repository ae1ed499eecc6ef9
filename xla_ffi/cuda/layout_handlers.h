// XLA FFI handler (CUDA) of get_dispatch_layout.
#ifndef JAX_EP_XLA_FFI_CUDA_LAYOUT_HANDLERS_H_
#define JAX_EP_XLA_FFI_CUDA_LAYOUT_HANDLERS_H_

#include <vector>

#include "xla_ffi/cuda/handler_common.h"

namespace jax_ep::ffi_cuda {

void AppendLayoutHandlers(std::vector<HandlerEntry>* entries);

}  // namespace jax_ep::ffi_cuda

#endif  // JAX_EP_XLA_FFI_CUDA_LAYOUT_HANDLERS_H_
