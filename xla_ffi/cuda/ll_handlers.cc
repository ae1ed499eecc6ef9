// XLA FFI handlers (CUDA) of the low-latency ops. Each decodes and checks its
// buffers and launches kernels on XLA's stream; no allocation, no host sync and
// no per-call host state (parity and sequence numbers live on the device), so
// every handler is command-buffer compatible.
//
// Custom calls (jax_ep/backends/cuda.py builds them):
//   jax_ep_ll_dispatch(x bf16[T,H], topk_idx s32[T,K]) ->
//       x [E_local, R*T_max, H] (bf16 | f8e4m3fn), scales f32[E_local, R*T_max, H/128 | 0],
//       count s32[E_local], recv_src s32[E_local, R*T_max], num_invalid s32[]
//   jax_ep_ll_combine(y bf16[E_local, R*T_max, H], recv_src, count, topk_idx s32[T,K],
//       topk_weights f32[T,K]) -> out bf16[T,H]
// and the same split in two for overlap, tied by a ticket (the send's sequence
// number, a device scalar):
//   jax_ep_ll_dispatch_send(x, topk_idx) -> (num_invalid, ticket)
//   jax_ep_ll_dispatch_recv(ticket) -> (x, scales, count, recv_src)
//   jax_ep_ll_combine_send(y, recv_src, count) -> ticket
//   jax_ep_ll_combine_recv(ticket, topk_idx, topk_weights) -> out
#include "xla_ffi/cuda/ll_handlers.h"

#include "cuda/ll_launch.h"
#include "xla_ffi/cuda/handler_common.h"

namespace jax_ep::ffi_cuda {
namespace {

constexpr bool kNeedLl = true;

// Rank-constrained buffer types without commas (the binding is a macro argument).
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Rank3 = ffi::Buffer<ffi::F32, 3>;

#define JAX_EP_DIMS_ATTRS                         \
  .Attr<int64_t>("num_ranks")                     \
      .Attr<int64_t>("num_experts")               \
      .Attr<int64_t>("hidden")                    \
      .Attr<int64_t>("max_tokens")                \
      .Attr<int64_t>("num_topk")

ffi::Error CheckTokens(const char* op, ffi::Span<const int64_t> dims, int64_t hidden,
                       int64_t max_tokens) {
  if (dims.size() != 2 || dims[1] != hidden || dims[0] > max_tokens) {
    return ffi::Error::InvalidArgument(std::string("jax_ep ") + op + ": expected [tokens <= " +
                                       std::to_string(max_tokens) + ", " +
                                       std::to_string(hidden) + "], got " + ShapeText(dims));
  }
  return ffi::Error::Success();
}

uint32_t* Ticket(ffi::Result<S32Scalar>& ticket) {
  return reinterpret_cast<uint32_t*>(ticket->typed_data());
}
const uint32_t* Ticket(const S32Scalar& ticket) {
  return reinterpret_cast<const uint32_t*>(ticket.typed_data());
}

constexpr const char* kDispatch = "low_latency_dispatch";
constexpr const char* kCombine = "low_latency_combine";

ffi::Error CheckDispatchInputs(const cuda::Runtime& runtime, bool use_fp8,
                               const ffi::AnyBuffer& x, const S32Matrix& topk_idx) {
  const cuda::EpDims& d = runtime.dims();
  if (x.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: x must be bfloat16");
  }
  if (auto err = CheckTokens(kDispatch, x.dimensions(), d.hidden, d.max_tokens); err.failure()) {
    return err;
  }
  const int64_t num_tokens = x.dimensions()[0];
  if (topk_idx.dimensions()[0] != num_tokens || topk_idx.dimensions()[1] != d.num_topk ||
      d.num_topk > 32 || d.hidden % (use_fp8 ? 128 : 8) != 0) {
    return ffi::Error::InvalidArgument(
        "jax_ep low_latency_dispatch: topk_idx must be [tokens, K] with K <= 32, and hidden a "
        "multiple of 8 (128 with FP8)");
  }
  const size_t smem = cuda::LlDispatchSmemBytes(static_cast<int>(num_tokens), d);
  if (smem > cuda::LlMaxDynamicSmemBytes()) {
    return ffi::Error::InvalidArgument(
        "jax_ep low_latency_dispatch: " + std::to_string(num_tokens) + " tokens x top-" +
        std::to_string(d.num_topk) + " with " + std::to_string(d.num_experts) +
        " experts need " + std::to_string(smem) + " bytes of shared memory per block, more than "
        "the " + std::to_string(cuda::LlMaxDynamicSmemBytes()) +
        " the LL kernels use; send fewer tokens per call or use jax_ep.dispatch (high throughput)");
  }
  return ffi::Error::Success();
}

ffi::Error CheckDispatchOutputs(const cuda::Runtime& runtime, bool use_fp8, int64_t num_tokens,
                                ffi::Result<ffi::AnyBuffer>& x, ffi::Result<F32Rank3>& scales) {
  const cuda::EpDims& d = runtime.dims();
  auto x_dims = x->dimensions();
  if (x_dims.size() != 3 || x_dims[0] != d.experts_per_rank ||
      x_dims[1] != static_cast<int64_t>(d.num_ranks) * d.max_tokens || x_dims[2] != d.hidden ||
      x->element_type() != (use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: output x must be "
                                       "[E_local, R*T, H] of bf16 (or float8_e4m3fn with fp8)");
  }
  if ((use_fp8 && scales->dimensions()[2] != d.hidden / 128) || num_tokens < 0 ||
      num_tokens > d.max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: bad scales shape or tokens");
  }
  return ffi::Error::Success();
}

ffi::Error CheckCombineInputs(const cuda::Runtime& runtime, int64_t num_tokens,
                              const ffi::AnyBuffer& y, const S32Matrix& recv_src,
                              const S32Vector& count) {
  const cuda::EpDims& d = runtime.dims();
  const int64_t rows = static_cast<int64_t>(d.num_ranks) * d.max_tokens;
  auto y_dims = y.dimensions();
  if (y.element_type() != ffi::DataType::BF16 || y_dims.size() != 3 ||
      y_dims[0] != d.experts_per_rank || y_dims[1] != rows || y_dims[2] != d.hidden) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: y must be bfloat16 "
                                       "[E_local, R*T, H], got " + ShapeText(y_dims));
  }
  if (count.dimensions()[0] != d.experts_per_rank ||
      recv_src.dimensions()[0] != d.experts_per_rank || recv_src.dimensions()[1] != rows ||
      num_tokens < 0 || num_tokens > d.max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: handle shapes do not match");
  }
  return ffi::Error::Success();
}

ffi::Error CheckCombineOutputs(const cuda::Runtime& runtime, const S32Matrix& topk_idx,
                               const F32Matrix& topk_weights, ffi::Result<ffi::AnyBuffer>& out) {
  const cuda::EpDims& d = runtime.dims();
  const int64_t num_tokens = topk_idx.dimensions()[0];
  if (topk_idx.dimensions()[1] != d.num_topk || topk_weights.dimensions()[0] != num_tokens ||
      topk_weights.dimensions()[1] != d.num_topk || out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: topk_idx/topk_weights must be "
                                       "[tokens, K] and the output bfloat16");
  }
  return CheckTokens(kCombine, out->dimensions(), d.hidden, d.max_tokens);
}

#define JAX_EP_RETURN_IF_ERROR(expr)    \
  if (auto err = (expr); err.failure()) { \
    return err;                           \
  }

#define JAX_EP_RUNTIME_OR_RETURN(op)                                                          \
  auto runtime_or = RuntimeFor(op, {num_ranks, num_experts, hidden, max_tokens, num_topk},    \
                               device, /*need_low_latency=*/true, false);                     \
  if (runtime_or.has_error()) return runtime_or.error();                                      \
  const cuda::Runtime& runtime = **runtime_or

// ---- one-call ops: one kernel runs the send and the receive part.
ffi::Error LlDispatchImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                          int64_t num_experts, int64_t hidden, int64_t max_tokens,
                          int64_t num_topk, bool use_fp8, ffi::AnyBuffer x, S32Matrix topk_idx,
                          ffi::Result<ffi::AnyBuffer> out_x, ffi::Result<F32Rank3> out_scales,
                          ffi::Result<S32Vector> out_count, ffi::Result<S32Matrix> out_recv_src,
                          ffi::Result<S32Scalar> num_invalid) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchInputs(runtime, use_fp8, x, topk_idx));
  const int64_t num_tokens = x.dimensions()[0];
  JAX_EP_RETURN_IF_ERROR(CheckDispatchOutputs(runtime, use_fp8, num_tokens, out_x, out_scales));
  return LaunchError(kDispatch, cuda::LaunchLlDispatch(
                                    runtime.ll_context(), x.untyped_data(), topk_idx.typed_data(),
                                    static_cast<int>(num_tokens), use_fp8,
                                    num_invalid->typed_data(), out_x->untyped_data(),
                                    use_fp8 ? out_scales->typed_data() : nullptr,
                                    out_count->typed_data(), out_recv_src->typed_data(), stream));
}

ffi::Error LlCombineImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                         int64_t num_experts, int64_t hidden, int64_t max_tokens,
                         int64_t num_topk, ffi::AnyBuffer y, S32Matrix recv_src, S32Vector count,
                         S32Matrix topk_idx, F32Matrix topk_weights,
                         ffi::Result<ffi::AnyBuffer> out) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  const int64_t num_tokens = topk_idx.dimensions()[0];
  JAX_EP_RETURN_IF_ERROR(CheckCombineInputs(runtime, num_tokens, y, recv_src, count));
  JAX_EP_RETURN_IF_ERROR(CheckCombineOutputs(runtime, topk_idx, topk_weights, out));
  return LaunchError(kCombine, cuda::LaunchLlCombine(
                                   runtime.ll_context(), y.untyped_data(), recv_src.typed_data(),
                                   count.typed_data(), topk_idx.typed_data(),
                                   topk_weights.typed_data(), static_cast<int>(num_tokens),
                                   out->untyped_data(), stream));
}

// ---- split ops (overlap): the send hands a ticket to its recv.
ffi::Error LlDispatchSendImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                              int64_t num_experts, int64_t hidden, int64_t max_tokens,
                              int64_t num_topk, bool use_fp8, ffi::AnyBuffer x,
                              S32Matrix topk_idx, ffi::Result<S32Scalar> num_invalid,
                              ffi::Result<S32Scalar> ticket) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchInputs(runtime, use_fp8, x, topk_idx));
  return LaunchError(kDispatch, cuda::LaunchLlDispatchSend(
                                    runtime.ll_context(), x.untyped_data(), topk_idx.typed_data(),
                                    static_cast<int>(x.dimensions()[0]), use_fp8,
                                    num_invalid->typed_data(), Ticket(ticket), stream));
}

ffi::Error LlDispatchRecvImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                              int64_t num_experts, int64_t hidden, int64_t max_tokens,
                              int64_t num_topk, bool use_fp8, int64_t num_tokens,
                              S32Scalar ticket, ffi::Result<ffi::AnyBuffer> out_x,
                              ffi::Result<F32Rank3> out_scales, ffi::Result<S32Vector> out_count,
                              ffi::Result<S32Matrix> out_recv_src) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchOutputs(runtime, use_fp8, num_tokens, out_x, out_scales));
  return LaunchError(kDispatch, cuda::LaunchLlDispatchRecv(
                                    runtime.ll_context(), Ticket(ticket),
                                    static_cast<int>(num_tokens), use_fp8, out_x->untyped_data(),
                                    use_fp8 ? out_scales->typed_data() : nullptr,
                                    out_count->typed_data(), out_recv_src->typed_data(), stream));
}

ffi::Error LlCombineSendImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                             int64_t num_experts, int64_t hidden, int64_t max_tokens,
                             int64_t num_topk, int64_t num_tokens, ffi::AnyBuffer y,
                             S32Matrix recv_src, S32Vector count, ffi::Result<S32Scalar> ticket) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  JAX_EP_RETURN_IF_ERROR(CheckCombineInputs(runtime, num_tokens, y, recv_src, count));
  return LaunchError(kCombine, cuda::LaunchLlCombineSend(
                                   runtime.ll_context(), y.untyped_data(), recv_src.typed_data(),
                                   count.typed_data(), static_cast<int>(num_tokens),
                                   Ticket(ticket), stream));
}

ffi::Error LlCombineRecvImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                             int64_t num_experts, int64_t hidden, int64_t max_tokens,
                             int64_t num_topk, S32Scalar ticket, S32Matrix topk_idx,
                             F32Matrix topk_weights, ffi::Result<ffi::AnyBuffer> out) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  JAX_EP_RETURN_IF_ERROR(CheckCombineOutputs(runtime, topk_idx, topk_weights, out));
  return LaunchError(kCombine, cuda::LaunchLlCombineRecv(
                                   runtime.ll_context(), Ticket(ticket), topk_idx.typed_data(),
                                   topk_weights.typed_data(),
                                   static_cast<int>(topk_idx.dimensions()[0]),
                                   out->untyped_data(), stream));
}

}  // namespace

#define JAX_EP_LL_BIND                                          \
  ffi::Ffi::Bind()                                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                 \
      .Ctx<ffi::DeviceOrdinal>() JAX_EP_DIMS_ATTRS

XLA_FFI_DEFINE_HANDLER(kLlDispatch, LlDispatchImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Rank3>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>()
                           .Ret<S32Scalar>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombine, LlCombineImpl,
                       JAX_EP_LL_BIND.Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlDispatchSend, LlDispatchSendImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Ret<S32Scalar>()
                           .Ret<S32Scalar>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlDispatchRecv, LlDispatchRecvImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Attr<int64_t>("num_tokens")
                           .Arg<S32Scalar>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Rank3>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineSend, LlCombineSendImpl,
                       JAX_EP_LL_BIND.Attr<int64_t>("num_tokens")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Ret<S32Scalar>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineRecv, LlCombineRecvImpl,
                       JAX_EP_LL_BIND.Arg<S32Scalar>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

void AppendLlHandlers(std::vector<HandlerEntry>* entries) {
  entries->push_back({"jax_ep_ll_dispatch", kLlDispatch});
  entries->push_back({"jax_ep_ll_combine", kLlCombine});
  entries->push_back({"jax_ep_ll_dispatch_send", kLlDispatchSend});
  entries->push_back({"jax_ep_ll_dispatch_recv", kLlDispatchRecv});
  entries->push_back({"jax_ep_ll_combine_send", kLlCombineSend});
  entries->push_back({"jax_ep_ll_combine_recv", kLlCombineRecv});
}

}  // namespace jax_ep::ffi_cuda
