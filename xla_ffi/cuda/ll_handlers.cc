// XLA FFI handlers (CUDA) of the low-latency ops. Each decodes and checks its
// buffers and launches kernels on XLA's stream; no allocation, no host sync and
// no per-call host state (parity and sequence numbers live on the device), so
// every handler is command-buffer compatible. Every target binds the traced
// EpConfig as one struct attribute, "config"; the kernels run with its dims,
// which the buffers must be able to serve (handler_common.h CallDims), and the
// shapes below are those dims'. T_ll = config.ll_max_tokens.
//
// Custom calls (jax_ep/backends/cuda.py builds them); a trailing dimension of
// 0 marks an optional operand or result as absent:
//   jax_ep_ll_dispatch(x bf16[T,H], topk_idx s32[T,K], topk_weights f32[T,K|0]) ->
//       x [E_local, R*T_ll, H] (bf16 | f8e4m3fn), scales f32[E_local, R*T_ll, H/128 | 0],
//       count s32[E_local], recv_src s32[E_local, R*T_ll],
//       weights f32[E_local, R*T_ll | 0] (each pair's weight), num_invalid s32[]
//   jax_ep_ll_combine(y bf16[E_local, R*T_ll, H|0], row_values f32[E_local, R*T_ll|0],
//       row_weights f32[E_local, R*T_ll|0], recv_src, count, topk_idx s32[T,K],
//       topk_weights f32[T,K|0]) -> out bf16[T, H|0], pair_values f32[T, K|0]
//     with row_weights (the dispatch's weights): the combine pre-summed per
//     rank (ll_presummed_kernels.cu), y given, no row_values, topk_weights [T, 0]
// and the row-only ops split in two for overlap, tied by a ticket (the send's
// sequence number, a device scalar):
//   jax_ep_ll_dispatch_send(x, topk_idx, topk_weights f32[T,K|0]) -> (num_invalid, ticket)
//   jax_ep_ll_dispatch_recv(ticket) -> (x, scales, count, recv_src,
//       weights f32[E_local, R*T_ll|0]: given iff the send had topk_weights)
//   jax_ep_ll_combine_send(y, row_weights, recv_src, count) -> ticket
//   jax_ep_ll_combine_recv(ticket, topk_idx, topk_weights) -> out
// (pre-summed: row_weights [E_local, R*T_ll] at the send, topk_weights [T, 0]
// at the recv; else row_weights [E_local, 0] and topk_weights [T, K])
#include "xla_ffi/cuda/ll_handlers.h"

#include "cuda/ll_launch.h"
#include "xla_ffi/cuda/handler_common.h"
#include "xla_ffi/exports.h"

namespace jax_ep::ffi_cuda {
namespace {

// Rank-constrained buffer types without commas (the binding is a macro argument).
using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;
using F32Rank3 = ffi::Buffer<ffi::F32, 3>;

constexpr const char* kDispatch = "low_latency_dispatch";
constexpr const char* kCombine = "low_latency_combine";

ffi::Error Invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string("jax_ep ") + op + ": " + what);
}

ffi::Error CheckDispatchInputs(const cuda::EpDims& d, bool use_fp8, const ffi::AnyBuffer& x,
                               const S32Matrix& topk_idx) {
  auto dims = x.dimensions();
  if (x.element_type() != ffi::DataType::BF16 || dims.size() != 2 || dims[1] != d.hidden ||
      dims[0] > d.ll_max_tokens) {
    return Invalid(kDispatch, "x must be bfloat16 [tokens <= " + std::to_string(d.ll_max_tokens) +
                                  ", " + std::to_string(d.hidden) + "], got " + ShapeText(dims));
  }
  const int64_t num_tokens = dims[0];
  if (topk_idx.dimensions()[0] != num_tokens || topk_idx.dimensions()[1] != d.num_topk ||
      d.num_topk > 32 || d.hidden % (use_fp8 ? 128 : 8) != 0) {
    return Invalid(kDispatch, "topk_idx must be [tokens, K] with K <= 32, and hidden a multiple "
                              "of 8 (128 with FP8)");
  }
  const size_t smem = cuda::LlDispatchSmemBytes(static_cast<int>(num_tokens), d);
  if (smem > cuda::LlMaxDynamicSmemBytes()) {
    return Invalid(kDispatch,
                   std::to_string(num_tokens) + " tokens x top-" + std::to_string(d.num_topk) +
                       " with " + std::to_string(d.num_experts) + " experts need " +
                       std::to_string(smem) + " bytes of shared memory per block, more than the " +
                       std::to_string(cuda::LlMaxDynamicSmemBytes()) +
                       " the LL kernels use; send fewer tokens per call or use jax_ep.dispatch "
                       "(high throughput)");
  }
  return ffi::Error::Success();
}

int64_t RowsPerExpert(const cuda::EpDims& d) {
  return static_cast<int64_t>(d.num_ranks) * d.ll_max_tokens;
}

ffi::Error CheckDispatchOutputs(const cuda::EpDims& d, bool use_fp8, int64_t num_tokens,
                                ffi::Result<ffi::AnyBuffer>& x, ffi::Result<F32Rank3>& scales,
                                ffi::Result<S32Vector>& count, ffi::Result<S32Matrix>& recv_src) {
  auto x_dims = x->dimensions();
  if (x_dims.size() != 3 || x_dims[0] != d.experts_per_rank || x_dims[1] != RowsPerExpert(d) ||
      x_dims[2] != d.hidden ||
      x->element_type() != (use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16)) {
    return Invalid(kDispatch, "output x must be [E_local, R*T_ll, H] of bf16 (or float8_e4m3fn "
                              "with fp8)");
  }
  if ((use_fp8 && scales->dimensions()[2] != d.hidden / 128) || num_tokens < 0 ||
      num_tokens > d.ll_max_tokens || count->dimensions()[0] != d.experts_per_rank ||
      recv_src->dimensions()[0] != d.experts_per_rank ||
      recv_src->dimensions()[1] != RowsPerExpert(d)) {
    return Invalid(kDispatch, "bad scales/count/recv_src shape or token count");
  }
  return ffi::Error::Success();
}

// topk_weights of a dispatch: [tokens, K], or [tokens, 0] (none).
ffi::Error CheckDispatchWeights(const cuda::EpDims& d, int64_t num_tokens,
                                const F32Matrix& topk_weights) {
  const int64_t width = topk_weights.dimensions()[1];
  if (topk_weights.dimensions()[0] != num_tokens || (width != 0 && width != d.num_topk)) {
    return Invalid(kDispatch, "topk_weights must be [tokens, K] (or [tokens, 0]: none), got " +
                                  ShapeText(topk_weights.dimensions()));
  }
  return ffi::Error::Success();
}

// The rows' weights a dispatch returns: [E_local, R*T_ll] with weights, else [E_local, 0].
ffi::Error CheckRowWeightsOut(const cuda::EpDims& d, bool with_weights,
                              ffi::Result<F32Matrix>& out_weights) {
  if (out_weights->dimensions()[0] != d.experts_per_rank ||
      out_weights->dimensions()[1] != (with_weights ? RowsPerExpert(d) : 0)) {
    return Invalid(kDispatch, "weights must be [E_local, R*T_ll] with topk_weights, else "
                              "[E_local, 0]");
  }
  return ffi::Error::Success();
}

ffi::Error CheckHandle(const cuda::EpDims& d, int64_t num_tokens, const S32Matrix& recv_src,
                       const S32Vector& count) {
  if (count.dimensions()[0] != d.experts_per_rank ||
      recv_src.dimensions()[0] != d.experts_per_rank ||
      recv_src.dimensions()[1] != RowsPerExpert(d) || num_tokens < 0 ||
      num_tokens > d.ll_max_tokens) {
    return Invalid(kCombine, "handle shapes do not match");
  }
  return ffi::Error::Success();
}

// y: bf16 [E_local, R*T_ll, H], or [E_local, R*T_ll, 0] when `optional`.
ffi::ErrorOr<bool> CheckCombineRows(const cuda::EpDims& d, const ffi::AnyBuffer& y,
                                    bool optional) {
  auto dims = y.dimensions();
  if (y.element_type() != ffi::DataType::BF16 || dims.size() != 3 ||
      dims[0] != d.experts_per_rank || dims[1] != RowsPerExpert(d) ||
      !(dims[2] == d.hidden || (optional && dims[2] == 0))) {
    return Invalid(kCombine, "y must be bfloat16 [E_local, R*T_ll, H], got " + ShapeText(dims));
  }
  return dims[2] != 0;
}

// topk_weights: [T, K], or [T, 0] for the pre-summed combine (`presummed`).
ffi::Error CheckRouting(const cuda::EpDims& d, const S32Matrix& topk_idx,
                        const F32Matrix& topk_weights, bool presummed) {
  const int64_t num_tokens = topk_idx.dimensions()[0];
  if (topk_idx.dimensions()[1] != d.num_topk || topk_weights.dimensions()[0] != num_tokens ||
      topk_weights.dimensions()[1] != (presummed ? 0 : d.num_topk) ||
      num_tokens > d.ll_max_tokens) {
    return Invalid(kCombine, presummed ? "topk_idx must be [tokens <= T_ll, K] and topk_weights "
                                         "[tokens, 0] (the dispatch had the weights)"
                                       : "topk_idx/topk_weights must be [tokens <= T_ll, K]");
  }
  return ffi::Error::Success();
}

// row_weights: [E_local, R*T_ll] (the pre-summed combine) or [E_local, 0].
ffi::ErrorOr<bool> CheckRowWeights(const cuda::EpDims& d, const F32Matrix& row_weights) {
  if (row_weights.dimensions()[0] != d.experts_per_rank ||
      (row_weights.dimensions()[1] != 0 && row_weights.dimensions()[1] != RowsPerExpert(d))) {
    return Invalid(kCombine, "row_weights must be [E_local, R*T_ll] (the dispatch's weights) or "
                             "[E_local, 0]");
  }
  return row_weights.dimensions()[1] != 0;
}

ffi::Error CheckCombineOutput(const cuda::EpDims& d, int64_t num_tokens,
                              ffi::Result<ffi::AnyBuffer>& out, bool with_rows) {
  auto dims = out->dimensions();
  if (out->element_type() != ffi::DataType::BF16 || dims.size() != 2 || dims[0] != num_tokens ||
      dims[1] != (with_rows ? d.hidden : 0)) {
    return Invalid(kCombine, "the output must be bfloat16 [tokens, H]");
  }
  return ffi::Error::Success();
}

#define JAX_EP_RETURN_IF_ERROR(expr)      \
  if (auto err = (expr); err.failure()) { \
    return err;                           \
  }

// `d`: this call's dims; `ctx`: the LL context with them (handler_common.h CallDims).
#define JAX_EP_RUNTIME_OR_RETURN(op)                                                  \
  auto runtime_or = RuntimeFor(op, config, device, /*need_low_latency=*/true, false); \
  if (runtime_or.has_error()) return runtime_or.error();                              \
  const CallRuntime& call = *runtime_or;                                              \
  const cuda::EpDims& d = call.dims;                                                  \
  const cuda::LlContext& ctx = call.ll

uint32_t* Ticket(ffi::Result<S32Scalar>& ticket) {
  return reinterpret_cast<uint32_t*>(ticket->typed_data());
}
const uint32_t* Ticket(const S32Scalar& ticket) {
  return reinterpret_cast<const uint32_t*>(ticket.typed_data());
}

// ---- one-call ops: one kernel runs the send and the receive part.
ffi::Error LlDispatchImpl(cudaStream_t stream, int32_t device, CallConfig config, bool use_fp8,
                          ffi::AnyBuffer x, S32Matrix topk_idx, F32Matrix topk_weights,
                          ffi::Result<ffi::AnyBuffer> out_x, ffi::Result<F32Rank3> out_scales,
                          ffi::Result<S32Vector> out_count, ffi::Result<S32Matrix> out_recv_src,
                          ffi::Result<F32Matrix> out_weights, ffi::Result<S32Scalar> num_invalid,
                          StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchInputs(d, use_fp8, x, topk_idx));
  const int64_t num_tokens = x.dimensions()[0];
  JAX_EP_RETURN_IF_ERROR(CheckDispatchOutputs(d, use_fp8, num_tokens, out_x, out_scales,
                                              out_count, out_recv_src));
  const bool with_weights = topk_weights.dimensions()[1] != 0;
  JAX_EP_RETURN_IF_ERROR(CheckDispatchWeights(d, num_tokens, topk_weights));
  JAX_EP_RETURN_IF_ERROR(CheckRowWeightsOut(d, with_weights, out_weights));
  cuda::LlDispatchArgs args{};
  args.x = x.untyped_data();
  args.topk_idx = topk_idx.typed_data();
  args.topk_weights = with_weights ? topk_weights.typed_data() : nullptr;
  args.num_tokens = static_cast<int>(num_tokens);
  args.use_fp8 = use_fp8;
  args.num_invalid = num_invalid->typed_data();
  args.out_x = out_x->untyped_data();
  args.out_scales = use_fp8 ? out_scales->typed_data() : nullptr;
  args.out_count = out_count->typed_data();
  args.out_recv_src = out_recv_src->typed_data();
  args.out_weights = with_weights ? out_weights->typed_data() : nullptr;
  return LaunchError(kDispatch, cuda::LaunchLlDispatch(ctx, args, cuda::LlParts::kBoth, stream));
}

ffi::Error LlCombineImpl(cudaStream_t stream, int32_t device, CallConfig config, ffi::AnyBuffer y,
                         F32Matrix row_values, F32Matrix row_weights, S32Matrix recv_src,
                         S32Vector count, S32Matrix topk_idx, F32Matrix topk_weights,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<F32Matrix> pair_values,
                         StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  const int64_t num_tokens = topk_idx.dimensions()[0];
  JAX_EP_RETURN_IF_ERROR(CheckHandle(d, num_tokens, recv_src, count));
  auto presummed = CheckRowWeights(d, row_weights);
  if (presummed.has_error()) return presummed.error();
  JAX_EP_RETURN_IF_ERROR(CheckRouting(d, topk_idx, topk_weights, *presummed));
  auto with_rows = CheckCombineRows(d, y, /*optional=*/true);
  if (with_rows.has_error()) return with_rows.error();
  JAX_EP_RETURN_IF_ERROR(CheckCombineOutput(d, num_tokens, out, *with_rows));
  const bool with_values = row_values.dimensions()[1] != 0;
  if (row_values.dimensions()[0] != d.experts_per_rank ||
      (with_values && row_values.dimensions()[1] != RowsPerExpert(d)) ||
      pair_values->dimensions()[0] != num_tokens ||
      pair_values->dimensions()[1] != (with_values ? d.num_topk : 0) ||
      (!*with_rows && !with_values) || (*presummed && (with_values || !*with_rows))) {
    return Invalid(kCombine, "row_values must be [E_local, R*T_ll] and pair_values [tokens, K] "
                             "(or both absent, with rows; always absent with row_weights)");
  }
  if (*presummed) {
    cuda::LlCombineArgs args{};
    args.y = y.untyped_data();
    args.row_weights = row_weights.typed_data();
    args.recv_src = recv_src.typed_data();
    args.count = count.typed_data();
    args.topk_idx = topk_idx.typed_data();
    args.num_tokens = static_cast<int>(num_tokens);
    args.out = out->untyped_data();
    return LaunchError(kCombine,
                       cuda::LaunchLlCombinePresummed(ctx, args, cuda::LlParts::kBoth, stream));
  }
  cuda::LlCombineArgs args{};
  args.y = *with_rows ? y.untyped_data() : nullptr;
  args.row_values = with_values ? row_values.typed_data() : nullptr;
  args.recv_src = recv_src.typed_data();
  args.count = count.typed_data();
  args.topk_idx = topk_idx.typed_data();
  args.topk_weights = topk_weights.typed_data();
  args.num_tokens = static_cast<int>(num_tokens);
  args.out = *with_rows ? out->untyped_data() : nullptr;
  args.out_pair_values = with_values ? pair_values->typed_data() : nullptr;
  return LaunchError(kCombine, cuda::LaunchLlCombine(ctx, args, cuda::LlParts::kBoth, stream));
}

// ---- split ops (overlap): the send hands a ticket to its recv.
ffi::Error LlDispatchSendImpl(cudaStream_t stream, int32_t device, CallConfig config,
                              bool use_fp8, ffi::AnyBuffer x, S32Matrix topk_idx,
                              F32Matrix topk_weights, ffi::Result<S32Scalar> num_invalid,
                              ffi::Result<S32Scalar> ticket,
                              StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchInputs(d, use_fp8, x, topk_idx));
  JAX_EP_RETURN_IF_ERROR(CheckDispatchWeights(d, x.dimensions()[0], topk_weights));
  cuda::LlDispatchArgs args{};
  args.x = x.untyped_data();
  args.topk_idx = topk_idx.typed_data();
  args.topk_weights = topk_weights.dimensions()[1] != 0 ? topk_weights.typed_data() : nullptr;
  args.num_tokens = static_cast<int>(x.dimensions()[0]);
  args.use_fp8 = use_fp8;
  args.num_invalid = num_invalid->typed_data();
  args.ticket_out = Ticket(ticket);
  return LaunchError(kDispatch, cuda::LaunchLlDispatch(ctx, args, cuda::LlParts::kSend, stream));
}

ffi::Error LlDispatchRecvImpl(cudaStream_t stream, int32_t device, CallConfig config,
                              bool use_fp8, int64_t num_tokens, S32Scalar ticket,
                              ffi::Result<ffi::AnyBuffer> out_x, ffi::Result<F32Rank3> out_scales,
                              ffi::Result<S32Vector> out_count,
                              ffi::Result<S32Matrix> out_recv_src,
                              ffi::Result<F32Matrix> out_weights,
                              StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kDispatch);
  JAX_EP_RETURN_IF_ERROR(CheckDispatchOutputs(d, use_fp8, num_tokens, out_x, out_scales,
                                              out_count, out_recv_src));
  const bool with_weights = out_weights->dimensions()[1] != 0;
  JAX_EP_RETURN_IF_ERROR(CheckRowWeightsOut(d, with_weights, out_weights));
  cuda::LlDispatchArgs args{};
  args.out_weights = with_weights ? out_weights->typed_data() : nullptr;
  args.num_tokens = static_cast<int>(num_tokens);
  args.use_fp8 = use_fp8;
  args.ticket_in = Ticket(ticket);
  args.out_x = out_x->untyped_data();
  args.out_scales = use_fp8 ? out_scales->typed_data() : nullptr;
  args.out_count = out_count->typed_data();
  args.out_recv_src = out_recv_src->typed_data();
  return LaunchError(kDispatch, cuda::LaunchLlDispatch(ctx, args, cuda::LlParts::kRecv, stream));
}

ffi::Error LlCombineSendImpl(cudaStream_t stream, int32_t device, CallConfig config,
                             int64_t num_tokens, ffi::AnyBuffer y, F32Matrix row_weights,
                             S32Matrix recv_src, S32Vector count,
                             ffi::Result<S32Scalar> ticket,
                             StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  JAX_EP_RETURN_IF_ERROR(CheckHandle(d, num_tokens, recv_src, count));
  auto presummed = CheckRowWeights(d, row_weights);
  if (presummed.has_error()) return presummed.error();
  auto with_rows = CheckCombineRows(d, y, /*optional=*/false);
  if (with_rows.has_error()) return with_rows.error();
  cuda::LlCombineArgs args{};
  args.y = y.untyped_data();
  args.row_weights = *presummed ? row_weights.typed_data() : nullptr;
  args.recv_src = recv_src.typed_data();
  args.count = count.typed_data();
  args.num_tokens = static_cast<int>(num_tokens);
  args.ticket_out = Ticket(ticket);
  return LaunchError(kCombine,
                     *presummed ? cuda::LaunchLlCombinePresummed(ctx, args, cuda::LlParts::kSend,
                                                                 stream)
                                : cuda::LaunchLlCombine(ctx, args, cuda::LlParts::kSend, stream));
}

ffi::Error LlCombineRecvImpl(cudaStream_t stream, int32_t device, CallConfig config,
                             S32Scalar ticket, S32Matrix topk_idx, F32Matrix topk_weights,
                             ffi::Result<ffi::AnyBuffer> out,
                             StatusToken /*status_token*/) {
  JAX_EP_RUNTIME_OR_RETURN(kCombine);
  // No weights here: the send applied the dispatch's (pre-summed combine).
  const bool presummed = topk_weights.dimensions()[1] == 0;
  JAX_EP_RETURN_IF_ERROR(CheckRouting(d, topk_idx, topk_weights, presummed));
  const int64_t num_tokens = topk_idx.dimensions()[0];
  JAX_EP_RETURN_IF_ERROR(CheckCombineOutput(d, num_tokens, out, /*with_rows=*/true));
  cuda::LlCombineArgs args{};
  args.topk_idx = topk_idx.typed_data();
  args.topk_weights = presummed ? nullptr : topk_weights.typed_data();
  args.num_tokens = static_cast<int>(num_tokens);
  args.ticket_in = Ticket(ticket);
  args.out = out->untyped_data();
  return LaunchError(kCombine,
                     presummed ? cuda::LaunchLlCombinePresummed(ctx, args, cuda::LlParts::kRecv,
                                                                stream)
                               : cuda::LaunchLlCombine(ctx, args, cuda::LlParts::kRecv, stream));
}

}  // namespace

#define JAX_EP_LL_BIND                                          \
  ffi::Ffi::Bind()                                              \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()                 \
      .Ctx<ffi::DeviceOrdinal>()                                \
      .Attr<CallConfig>("config")

XLA_FFI_DEFINE_HANDLER(kLlDispatch, LlDispatchImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Rank3>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>()
                           .Ret<F32Matrix>()
                           .Ret<S32Scalar>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombine, LlCombineImpl,
                       JAX_EP_LL_BIND.Arg<ffi::AnyBuffer>()
                           .Arg<F32Matrix>()
                           .Arg<F32Matrix>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Matrix>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlDispatchSend, LlDispatchSendImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<S32Scalar>()
                           .Ret<S32Scalar>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlDispatchRecv, LlDispatchRecvImpl,
                       JAX_EP_LL_BIND.Attr<bool>("use_fp8")
                           .Attr<int64_t>("num_tokens")
                           .Arg<S32Scalar>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<F32Rank3>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>()
                           .Ret<F32Matrix>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineSend, LlCombineSendImpl,
                       JAX_EP_LL_BIND.Attr<int64_t>("num_tokens")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<F32Matrix>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Ret<S32Scalar>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kLlCombineRecv, LlCombineRecvImpl,
                       JAX_EP_LL_BIND.Arg<S32Scalar>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

void AppendLlHandlers(std::vector<HandlerEntry>* entries) {
  entries->push_back({exports::kLlDispatch, kLlDispatch});
  entries->push_back({exports::kLlCombine, kLlCombine});
  entries->push_back({exports::kLlDispatchSend, kLlDispatchSend});
  entries->push_back({exports::kLlDispatchRecv, kLlDispatchRecv});
  entries->push_back({exports::kLlCombineSend, kLlCombineSend});
  entries->push_back({exports::kLlCombineRecv, kLlCombineRecv});
}

}  // namespace jax_ep::ffi_cuda
