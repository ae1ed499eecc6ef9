// Shared decoding and checks of the CUDA FFI handlers.
#ifndef JAX_EP_XLA_FFI_CUDA_HANDLER_COMMON_H_
#define JAX_EP_XLA_FFI_CUDA_HANDLER_COMMON_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/ep_types.h"
#include "cuda/ht_types.h"
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

// The dims a call runs with: its traced config's, with this process's EP rank;
// or why the buffers, allocated for `allocated`, cannot serve it ("" on success).
//
// One allocation serves every config given to jax_ep.initialize: it is sized
// for their element-wise maximum (jax_ep/buffers.py sizing_config). Every
// kernel gets its own call's dims, never the allocation's: it indexes the
// symmetric buffers with them, except for the strides the runtime fixed at
// allocation (LlBuffers::message_bytes, HtBuffers::row_bytes and
// chunks_per_source), which are the same on every rank. Each buffer's extent
// is a product of dims (and of those strides), so a call whose every dim is
// at most the allocation's stays inside every buffer; senders and receivers
// agree on the layout because every rank runs the same call. Hence the rule
// checked here: the same R, and E, H, K (and T for the HT ops, T_ll for the
// LL ops) at most the allocation's.
std::string CallDims(const CallConfig& traced, const cuda::EpDims& allocated,
                     bool low_latency, bool high_throughput, cuda::EpDims* call);

// What a handler runs with: the runtime, this call's dims, and the runtime's
// kernel contexts with those dims (the buffers' addresses and strides stay the
// allocation's).
struct CallRuntime {
  const cuda::Runtime* runtime;
  cuda::EpDims dims;
  cuda::LlContext ll;
  cuda::HtContext ht;
};

// Checks the runtime is up, its buffers can serve the traced config (CallDims)
// and it is on this device. Pending faults are the status check's (below),
// which runs before the call in its computation.
ffi::ErrorOr<CallRuntime> RuntimeFor(const char* op, const CallConfig& traced,
                                     int32_t device_ordinal, bool need_low_latency,
                                     bool need_high_throughput);

ffi::Error LaunchError(const char* op, cudaError_t err);

// The status check, once per computation instead of once per call.
//
// Every jax_ep target takes one more operand, last: a StatusToken, the result
// of a jax_ep_status_check custom call (jax_ep/backends/cuda.py). The checks
// are identical and side-effect free (one s32[] constant operand), so XLA's
// CSE merges them into one per computation, and XLA keeps it because jax_ep's
// calls read its result. Its prepare stage (PrepareStatusCheckHandler) is what
// makes a recorded fault fail the next execution before anything is launched:
// XLA runs every thunk's prepare stage on the host before each execution, also
// inside command buffers (whose replays call no execute stage). On the other
// targets it would run once per call: about 0.5-1 us of host time each before
// the executable's launch (2026-12-01, docs/benchmarks.md).
using StatusToken = ffi::Buffer<ffi::S32, 0>;

// The check's prepare stage: the error of a pending fault, else success.
// Binds nothing it does not need.
XLA_FFI_Handler* PrepareStatusCheckHandler();

// The check's execute stage: the same check where XLA calls it (command
// buffers off, and when a CUDA graph is recorded), which is what still fails
// the execution where the prepare stage is off or refused; then writes 0 to
// the token (one 4-byte memset on the stream: a CUDA graph gets a node, not an
// empty capture), once per execution.
XLA_FFI_Handler* StatusCheckHandler();

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
