// XLA FFI handlers (CUDA) of the low-latency ops. Each decodes and checks its
// buffers and launches kernels on XLA's stream; no allocation, no host sync and
// no per-call host state (parity and sequence numbers live on the device), so
// every handler is command-buffer compatible.
//
// Custom calls (jax_ep/backends/cuda.py builds them):
//   jax_ep_ll_dispatch_send(x bf16[T,H], topk_idx s32[T,K]) -> num_invalid s32[]
//   jax_ep_ll_dispatch_recv(num_invalid s32[]) ->
//       x [E_local, R*T_max, H] (bf16 | f8e4m3fn), scales f32[E_local, R*T_max, H/128 | 0],
//       count s32[E_local], recv_src s32[E_local, R*T_max]
//   jax_ep_ll_combine_send(y bf16[E_local, R*T_max, H], recv_src, count) -> token s32[]
//   jax_ep_ll_combine_recv(token, topk_idx s32[T,K], topk_weights f32[T,K]) -> out bf16[T,H]
// The send->recv data dependencies (num_invalid, token) order each pair.
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

ffi::Error LlDispatchSendImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                              int64_t num_experts, int64_t hidden, int64_t max_tokens,
                              int64_t num_topk, bool use_fp8, ffi::AnyBuffer x,
                              ffi::Buffer<ffi::S32, 2> topk_idx,
                              ffi::ResultBuffer<ffi::S32, 0> num_invalid) {
  const char* op = "low_latency_dispatch";
  auto runtime = RuntimeFor(op, {num_ranks, num_experts, hidden, max_tokens, num_topk}, device,
                            kNeedLl, false);
  if (runtime.has_error()) return runtime.error();
  if (x.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: x must be bfloat16");
  }
  if (auto err = CheckTokens(op, x.dimensions(), hidden, max_tokens); err.failure()) return err;
  const int64_t num_tokens = x.dimensions()[0];
  if (topk_idx.dimensions()[0] != num_tokens || topk_idx.dimensions()[1] != num_topk ||
      num_topk > 32 || hidden % (use_fp8 ? 128 : 8) != 0) {
    return ffi::Error::InvalidArgument(
        "jax_ep low_latency_dispatch: topk_idx must be [tokens, K] with K <= 32, and hidden a "
        "multiple of 8 (128 with FP8)");
  }
  return LaunchError(op, cuda::LaunchLlDispatchSend(
                             (*runtime)->ll_context(), x.untyped_data(), topk_idx.typed_data(),
                             static_cast<int>(num_tokens), use_fp8, num_invalid->typed_data(),
                             stream));
}

ffi::Error LlDispatchRecvImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                              int64_t num_experts, int64_t hidden, int64_t max_tokens,
                              int64_t num_topk, bool use_fp8, int64_t num_tokens,
                              ffi::Buffer<ffi::S32, 0> /*send_done*/,
                              ffi::Result<ffi::AnyBuffer> out_x,
                              ffi::ResultBuffer<ffi::F32, 3> out_scales,
                              ffi::ResultBuffer<ffi::S32, 1> out_count,
                              ffi::ResultBuffer<ffi::S32, 2> out_recv_src) {
  const char* op = "low_latency_dispatch";
  auto runtime = RuntimeFor(op, {num_ranks, num_experts, hidden, max_tokens, num_topk}, device,
                            kNeedLl, false);
  if (runtime.has_error()) return runtime.error();
  const int64_t experts_per_rank = num_experts / num_ranks;
  auto x_dims = out_x->dimensions();
  if (x_dims.size() != 3 || x_dims[0] != experts_per_rank ||
      x_dims[1] != num_ranks * max_tokens || x_dims[2] != hidden ||
      out_x->element_type() != (use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16)) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: output x must be "
                                       "[E_local, R*T, H] of bf16 (or float8_e4m3fn with fp8)");
  }
  if (use_fp8 && out_scales->dimensions()[2] != hidden / 128) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: scales must be [.., H/128]");
  }
  if (num_tokens < 0 || num_tokens > max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_dispatch: bad token count");
  }
  return LaunchError(op, cuda::LaunchLlDispatchRecv(
                             (*runtime)->ll_context(), static_cast<int>(num_tokens), use_fp8,
                             out_x->untyped_data(), use_fp8 ? out_scales->typed_data() : nullptr,
                             out_count->typed_data(), out_recv_src->typed_data(), stream));
}

ffi::Error LlCombineSendImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                             int64_t num_experts, int64_t hidden, int64_t max_tokens,
                             int64_t num_topk, int64_t num_tokens, ffi::AnyBuffer y,
                             ffi::Buffer<ffi::S32, 2> recv_src, ffi::Buffer<ffi::S32, 1> count,
                             ffi::ResultBuffer<ffi::S32, 0> /*token*/) {
  const char* op = "low_latency_combine";
  auto runtime = RuntimeFor(op, {num_ranks, num_experts, hidden, max_tokens, num_topk}, device,
                            kNeedLl, false);
  if (runtime.has_error()) return runtime.error();
  const int64_t experts_per_rank = num_experts / num_ranks;
  auto y_dims = y.dimensions();
  if (y.element_type() != ffi::DataType::BF16 || y_dims.size() != 3 ||
      y_dims[0] != experts_per_rank || y_dims[1] != num_ranks * max_tokens ||
      y_dims[2] != hidden) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: y must be bfloat16 "
                                       "[E_local, R*T, H], got " + ShapeText(y_dims));
  }
  if (count.dimensions()[0] != experts_per_rank ||
      recv_src.dimensions()[0] != experts_per_rank ||
      recv_src.dimensions()[1] != num_ranks * max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: handle shapes do not match");
  }
  if (num_tokens < 0 || num_tokens > max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: bad token count");
  }
  return LaunchError(op, cuda::LaunchLlCombineSend((*runtime)->ll_context(), y.untyped_data(),
                                                   recv_src.typed_data(), count.typed_data(),
                                                   static_cast<int>(num_tokens), stream));
}

ffi::Error LlCombineRecvImpl(cudaStream_t stream, int32_t device, int64_t num_ranks,
                             int64_t num_experts, int64_t hidden, int64_t max_tokens,
                             int64_t num_topk, ffi::Buffer<ffi::S32, 0> /*token*/,
                             ffi::Buffer<ffi::S32, 2> topk_idx,
                             ffi::Buffer<ffi::F32, 2> topk_weights,
                             ffi::Result<ffi::AnyBuffer> out) {
  const char* op = "low_latency_combine";
  auto runtime = RuntimeFor(op, {num_ranks, num_experts, hidden, max_tokens, num_topk}, device,
                            kNeedLl, false);
  if (runtime.has_error()) return runtime.error();
  const int64_t num_tokens = topk_idx.dimensions()[0];
  if (topk_idx.dimensions()[1] != num_topk || topk_weights.dimensions()[0] != num_tokens ||
      topk_weights.dimensions()[1] != num_topk || out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("jax_ep low_latency_combine: topk_idx/topk_weights must be "
                                       "[tokens, K] and the output bfloat16");
  }
  if (auto err = CheckTokens(op, out->dimensions(), hidden, max_tokens); err.failure()) return err;
  return LaunchError(op, cuda::LaunchLlCombineRecv(
                             (*runtime)->ll_context(), topk_idx.typed_data(),
                             topk_weights.typed_data(), static_cast<int>(num_tokens),
                             out->untyped_data(), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLlDispatchSend, LlDispatchSendImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>() JAX_EP_DIMS_ATTRS
                           .Attr<bool>("use_fp8")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Ret<S32Scalar>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlDispatchRecv, LlDispatchRecvImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>() JAX_EP_DIMS_ATTRS
                           .Attr<bool>("use_fp8")
                           .Attr<int64_t>("num_tokens")
                           .Arg<S32Scalar>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Rank3>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineSend, LlCombineSendImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>() JAX_EP_DIMS_ATTRS
                           .Attr<int64_t>("num_tokens")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Ret<S32Scalar>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineRecv, LlCombineRecvImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Ctx<ffi::DeviceOrdinal>() JAX_EP_DIMS_ATTRS
                           .Arg<S32Scalar>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>(),
                       {ffi::Traits::kCmdBufferCompatible});

void AppendLlHandlers(std::vector<HandlerEntry>* entries) {
  entries->push_back({"jax_ep_ll_dispatch_send", kLlDispatchSend});
  entries->push_back({"jax_ep_ll_dispatch_recv", kLlDispatchRecv});
  entries->push_back({"jax_ep_ll_combine_send", kLlCombineSend});
  entries->push_back({"jax_ep_ll_combine_recv", kLlCombineRecv});
}

}  // namespace jax_ep::ffi_cuda
