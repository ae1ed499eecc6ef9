// XLA FFI handlers (CUDA) of the high-throughput ops. Command-buffer
// compatible: kernels only, no host sync, sequence numbers on the device.
// Every target binds the traced EpConfig as one struct attribute, "config";
// the kernels run with its dims (handler_common.h CallDims).
//
//   jax_ep_ht_dispatch(x [T,H] bf16|f16|f32|f8e4m3fn, scales [T,S] (S = 0: none),
//                      topk_idx s32[T,K], topk_weights f32[T,K]; capacity) ->
//       x [C,H], scales [C,S], topk_idx s32[C,K], topk_weights f32[C,K],
//       num_tokens s32[], tokens_per_expert s32[E_local], num_dropped s32[],
//       num_invalid s32[], recv_src s32[C], send_row s32[T,R]
//   jax_ep_ht_combine(y [C,W] bf16|f16|f32, recv_src s32[C], send_row s32[T,R],
//                     num_tokens s32[]) -> out [T,W] (y's type)
//     W * element size must be a multiple of 16 bytes; rows wider than 2H
//     bytes travel in several passes (cuda/ht_combine.cu).
//   jax_ep_ht_dispatch_expert_major(x, scales, topk_idx, topk_weights as
//                      jax_ep_ht_dispatch; capacity C >= R*T, num_rows M,
//                      alignment A) ->
//       x [M,H], scales [M,S], pair_expert s32[M], pair_weight f32[M],
//       pair_src s32[M], num_pairs s32[], tokens_per_expert s32[E_local],
//       group_sizes s32[E_local], num_dropped s32[], num_invalid s32[],
//       recv_src s32[C], send_row s32[T,R], num_tokens s32[],
//       slot_row s32[C,K], rows_by_expert s32[C,K]
//     (the pair plan, cuda/ht_pair_plan.cu, then the dispatch kernel).
//   jax_ep_ht_combine_expert_major(y [M,W], rows_by_expert s32[C,K],
//                      recv_src s32[C], send_row s32[T,R], num_tokens s32[];
//                      capacity C) -> out [T,W] (cuda/ht_pair_combine.cu)
//   jax_ep_ht_slot_values(values f32[M], slot_row s32[C,K]) -> f32[C,K] (local)
#include "xla_ffi/cuda/ht_handlers.h"

#include <algorithm>
#include <string>

#include "cuda/ht_launch.h"
#include "xla_ffi/cuda/handler_common.h"
#include "xla_ffi/exports.h"

namespace jax_ep::ffi_cuda {
namespace {

using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;

constexpr const char* kDispatch = "dispatch";
constexpr const char* kCombine = "combine";

// "R <= 8, E_local <= 1024, K <= 32", from the kernels' limits.
std::string KernelBounds() {
  return "R <= " + std::to_string(cuda::kHtMaxRanks) +
         ", E_local <= " + std::to_string(cuda::kHtMaxExpertsPerRank) +
         ", K <= " + std::to_string(cuda::kMaxTopk);
}

size_t RowBytes(const ffi::AnyBuffer& buffer) {
  auto dims = buffer.dimensions();
  return dims.size() == 2 ? static_cast<size_t>(dims[1]) * ffi::ByteWidth(buffer.element_type())
                          : 0;
}

// What both dispatch targets check of x: its type and [tokens <= T, H].
ffi::Error CheckDispatchRows(const CallConfig& config, const ffi::AnyBuffer& x,
                             const std::string& op) {
  auto x_dims = x.dimensions();
  const ffi::DataType x_type = x.element_type();
  if (x_dims.size() != 2 || x_dims[1] != config.hidden || x_dims[0] > config.max_tokens ||
      (x_type != ffi::DataType::F8E4M3FN && x_type != ffi::DataType::BF16 &&
       x_type != ffi::DataType::F16 && x_type != ffi::DataType::F32)) {
    return ffi::Error::InvalidArgument("jax_ep " + op + ": x must be bfloat16, float16, float32 "
                                       "or float8_e4m3fn [tokens <= T, H], got " +
                                       ShapeText(x_dims));
  }
  return ffi::Error::Success();
}

// Scale rows move as 4-byte words, in one pass (rows wider than the receive
// buffers' rows, float32, take several; they carry no scales).
ffi::Error CheckScaleRows(size_t scale_bytes, size_t row_bytes, size_t buffer_row_bytes,
                          const std::string& op) {
  if (scale_bytes % 4 != 0) {
    return ffi::Error::InvalidArgument(
        "jax_ep " + op + ": a scale row must be a whole number of 4-byte words, got " +
        std::to_string(scale_bytes) + " bytes (jax_ep.dispatch pads float8_e8m0fnu scales)");
  }
  if (scale_bytes != 0 && row_bytes > buffer_row_bytes) {
    return ffi::Error::InvalidArgument("jax_ep " + op + ": rows with scales must fit one pass");
  }
  return ffi::Error::Success();
}

// The operands and the results both dispatch targets share.
cuda::HtDispatchArgs CommonDispatchArgs(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& scales, const S32Matrix& topk_idx,
    const F32Matrix& topk_weights, int64_t capacity, ffi::Result<ffi::AnyBuffer>& out_x,
    ffi::Result<ffi::AnyBuffer>& out_scales, ffi::Result<S32Scalar>& num_tokens,
    ffi::Result<S32Vector>& tokens_per_expert, ffi::Result<S32Scalar>& num_dropped,
    ffi::Result<S32Scalar>& num_invalid, ffi::Result<S32Vector>& recv_src,
    ffi::Result<S32Matrix>& send_row) {
  const size_t row_bytes = RowBytes(x);
  const size_t scale_bytes = RowBytes(scales);
  cuda::HtDispatchArgs args{};
  args.x = x.untyped_data();
  args.scales = scale_bytes ? scales.untyped_data() : nullptr;
  args.topk_idx = topk_idx.typed_data();
  args.topk_weights = topk_weights.typed_data();
  args.num_tokens = static_cast<int>(x.dimensions()[0]);
  args.capacity = static_cast<int>(capacity);
  args.x_row_stride = row_bytes;
  args.out_row_stride = row_bytes;
  args.scale_bytes = scale_bytes;
  args.out_x = out_x->untyped_data();
  args.out_scales = scale_bytes ? out_scales->untyped_data() : nullptr;
  args.out_num_tokens = num_tokens->typed_data();
  args.out_tokens_per_expert = tokens_per_expert->typed_data();
  args.out_num_dropped = num_dropped->typed_data();
  args.out_num_invalid = num_invalid->typed_data();
  args.out_recv_src = recv_src->typed_data();
  args.out_send_row = send_row->typed_data();
  return args;
}

// Rows wider than the receive buffers' rows (float32) move in several
// launches, one per column range; each launch also rewrites the routing
// outputs, with the same values. The receive rows are the allocation's (at
// least this call's H wide when several configs share the buffers).
cudaError_t LaunchDispatchPasses(const CallRuntime& call, const cuda::HtDispatchArgs& args,
                                 size_t buffer_row_bytes, cudaStream_t stream) {
  const size_t row_bytes = args.x_row_stride;
  cudaError_t err = cudaSuccess;
  for (size_t offset = 0; offset < row_bytes && err == cudaSuccess; offset += buffer_row_bytes) {
    cuda::HtDispatchArgs pass = args;
    pass.x = static_cast<const char*>(args.x) + offset;
    pass.out_x = static_cast<char*>(args.out_x) + offset;
    pass.row_bytes = std::min(buffer_row_bytes, row_bytes - offset);
    err = cuda::LaunchHtDispatch(call.ht, pass, stream);
  }
  return err;
}

ffi::Error HtDispatchImpl(cudaStream_t stream, int32_t device, CallConfig config,
                          int64_t capacity, ffi::AnyBuffer x, ffi::AnyBuffer scales,
                          S32Matrix topk_idx, F32Matrix topk_weights,
                          ffi::Result<ffi::AnyBuffer> out_x, ffi::Result<ffi::AnyBuffer> out_scales,
                          ffi::Result<S32Matrix> out_idx, ffi::Result<F32Matrix> out_w,
                          ffi::Result<S32Scalar> num_tokens, ffi::Result<S32Vector> tokens_per_expert,
                          ffi::Result<S32Scalar> num_dropped, ffi::Result<S32Scalar> num_invalid,
                          ffi::Result<S32Vector> recv_src, ffi::Result<S32Matrix> send_row,
                          StatusToken /*status_token*/) {
  auto runtime_or = RuntimeFor(kDispatch, config, device, false, /*need_high_throughput=*/true);
  if (runtime_or.has_error()) return runtime_or.error();
  const CallRuntime& call = *runtime_or;  // the kernel runs with call.ht (this call's dims)
  if (auto err = CheckDispatchRows(config, x, kDispatch); err.failure()) return err;
  const int64_t tokens = x.dimensions()[0];
  const size_t scale_bytes = RowBytes(scales);
  if (topk_idx.dimensions()[0] != tokens || topk_idx.dimensions()[1] != config.num_topk ||
      topk_weights.dimensions()[0] != tokens || scales.dimensions()[0] != tokens ||
      send_row->dimensions()[0] != tokens || send_row->dimensions()[1] != config.num_ranks ||
      out_x->dimensions()[0] != capacity || RowBytes(*out_x) != RowBytes(x) ||
      RowBytes(*out_scales) != scale_bytes || recv_src->dimensions()[0] != capacity ||
      capacity > config.num_ranks * config.max_tokens) {
    return ffi::Error::InvalidArgument("jax_ep dispatch: operand/result shapes do not match");
  }
  const size_t buffer_row_bytes = call.runtime->layout().ht_row_bytes / 16 * 16;
  if (auto err = CheckScaleRows(scale_bytes, RowBytes(x), buffer_row_bytes, kDispatch);
      err.failure()) {
    return err;
  }
  cuda::HtDispatchArgs args =
      CommonDispatchArgs(x, scales, topk_idx, topk_weights, capacity, out_x, out_scales,
                         num_tokens, tokens_per_expert, num_dropped, num_invalid, recv_src,
                         send_row);
  args.out_idx = out_idx->typed_data();
  args.out_w = out_w->typed_data();
  const cudaError_t err = LaunchDispatchPasses(call, args, buffer_row_bytes, stream);
  if (err == cudaErrorInvalidValue) {
    return ffi::Error::InvalidArgument(
        "jax_ep dispatch: the HT kernels need " + KernelBounds() +
        " and rows that are a multiple of 16 bytes (jax_ep takes the portable path for other "
        "configs)");
  }
  return LaunchError(kDispatch, err);
}

ffi::Error HtDispatchExpertMajorImpl(
    cudaStream_t stream, int32_t device, CallConfig config, int64_t capacity, int64_t num_rows,
    int64_t alignment, ffi::AnyBuffer x, ffi::AnyBuffer scales, S32Matrix topk_idx,
    F32Matrix topk_weights, ffi::Result<ffi::AnyBuffer> out_x,
    ffi::Result<ffi::AnyBuffer> out_scales, ffi::Result<S32Vector> pair_expert,
    ffi::Result<F32Vector> pair_weight, ffi::Result<S32Vector> pair_src,
    ffi::Result<S32Scalar> num_pairs, ffi::Result<S32Vector> tokens_per_expert,
    ffi::Result<S32Vector> group_sizes, ffi::Result<S32Scalar> num_dropped,
    ffi::Result<S32Scalar> num_invalid, ffi::Result<S32Vector> recv_src,
    ffi::Result<S32Matrix> send_row, ffi::Result<S32Scalar> num_tokens,
    ffi::Result<S32Matrix> slot_row, ffi::Result<S32Matrix> rows_by_expert,
    StatusToken /*status_token*/) {
  const std::string op = "dispatch (expert-major)";
  auto runtime_or = RuntimeFor(kDispatch, config, device, false, /*need_high_throughput=*/true);
  if (runtime_or.has_error()) return runtime_or.error();
  const CallRuntime& call = *runtime_or;
  if (auto err = CheckDispatchRows(config, x, op); err.failure()) return err;
  const int64_t tokens = x.dimensions()[0];
  const size_t scale_bytes = RowBytes(scales);
  const int64_t K = config.num_topk;
  if (topk_idx.dimensions()[0] != tokens || topk_idx.dimensions()[1] != K ||
      topk_weights.dimensions()[0] != tokens || scales.dimensions()[0] != tokens ||
      send_row->dimensions()[0] != tokens || send_row->dimensions()[1] != config.num_ranks ||
      capacity < config.num_ranks * tokens || capacity > config.num_ranks * config.max_tokens ||
      recv_src->dimensions()[0] != capacity || slot_row->dimensions()[0] != capacity ||
      slot_row->dimensions()[1] != K || rows_by_expert->dimensions()[0] != capacity ||
      rows_by_expert->dimensions()[1] != K || out_x->dimensions()[0] != num_rows ||
      RowBytes(*out_x) != RowBytes(x) || RowBytes(*out_scales) != scale_bytes ||
      out_scales->dimensions()[0] != num_rows || pair_expert->dimensions()[0] != num_rows ||
      pair_weight->dimensions()[0] != num_rows || pair_src->dimensions()[0] != num_rows) {
    return ffi::Error::InvalidArgument(
        "jax_ep dispatch (expert-major): operand/result shapes do not match (the staging "
        "capacity must hold every token of every rank, R * tokens)");
  }
  if (num_rows <= 0 || num_rows > (int64_t{1} << 30) || alignment < 1 || num_rows % alignment) {
    return ffi::Error::InvalidArgument(
        "jax_ep dispatch (expert-major): num_rows must be a positive multiple of alignment, got " +
        std::to_string(num_rows) + " rows, alignment " + std::to_string(alignment));
  }
  const size_t buffer_row_bytes = call.runtime->layout().ht_row_bytes / 16 * 16;
  if (auto err = CheckScaleRows(scale_bytes, RowBytes(x), buffer_row_bytes, op); err.failure()) {
    return err;
  }
  cuda::HtDispatchArgs args =
      CommonDispatchArgs(x, scales, topk_idx, topk_weights, capacity, out_x, out_scales,
                         num_tokens, tokens_per_expert, num_dropped, num_invalid, recv_src,
                         send_row);
  args.pairs.num_rows = static_cast<int>(num_rows);
  args.pairs.alignment = static_cast<int>(alignment);
  args.pairs.out_pair_expert = pair_expert->typed_data();
  args.pairs.out_pair_weight = pair_weight->typed_data();
  args.pairs.out_pair_src = pair_src->typed_data();
  args.pairs.out_num_pairs = num_pairs->typed_data();
  args.pairs.out_group_sizes = group_sizes->typed_data();
  args.pairs.out_slot_row = slot_row->typed_data();
  args.pairs.out_rows_by_expert = rows_by_expert->typed_data();
  cudaError_t err = cuda::LaunchHtPairPlan(call.ht, args.topk_idx, args.num_tokens, stream);
  if (err == cudaSuccess) err = LaunchDispatchPasses(call, args, buffer_row_bytes, stream);
  if (err == cudaErrorInvalidValue) {
    return ffi::Error::InvalidArgument(
        "jax_ep dispatch (expert-major): the HT kernels need " + KernelBounds() +
        ", rows that are a multiple of 16 bytes and a send plan that fits shared memory (jax_ep "
        "takes the portable path for other configs)");
  }
  return LaunchError(kDispatch, err);
}

ffi::ErrorOr<cuda::HtRowType> CombineRowType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::BF16: return cuda::HtRowType::kBf16;
    case ffi::DataType::F16: return cuda::HtRowType::kF16;
    case ffi::DataType::F32: return cuda::HtRowType::kF32;
    default:
      return ffi::Error::InvalidArgument("jax_ep combine: y must be bfloat16, float16 or float32");
  }
}

ffi::Error HtCombineImpl(cudaStream_t stream, int32_t device, CallConfig config,
                         int64_t capacity, ffi::AnyBuffer y, S32Vector recv_src,
                         S32Matrix send_row, S32Scalar num_tokens,
                         ffi::Result<ffi::AnyBuffer> out,
                         StatusToken /*status_token*/) {
  auto runtime_or = RuntimeFor(kCombine, config, device, false, /*need_high_throughput=*/true);
  if (runtime_or.has_error()) return runtime_or.error();
  const CallRuntime& call = *runtime_or;  // the kernels run with call.ht (this call's dims)
  auto row_type = CombineRowType(y.element_type());
  if (row_type.has_error()) return row_type.error();
  auto y_dims = y.dimensions();
  if (y_dims.size() != 2 || y_dims[0] != capacity || RowBytes(y) % 16 != 0 || y_dims[1] == 0 ||
      recv_src.dimensions()[0] != capacity || send_row.dimensions()[1] != config.num_ranks ||
      send_row.dimensions()[0] > config.max_tokens ||
      out->element_type() != y.element_type() || out->dimensions().size() != 2 ||
      out->dimensions()[0] != send_row.dimensions()[0] || out->dimensions()[1] != y_dims[1]) {
    return ffi::Error::InvalidArgument("jax_ep combine: y must be [C, W] matching the handle "
                                       "(of at most T tokens), with W * element size a "
                                       "multiple of 16 bytes; got " + ShapeText(y_dims));
  }
  cuda::HtCombineArgs args{};
  args.y = y.untyped_data();
  args.recv_src = recv_src.typed_data();
  args.send_row = send_row.typed_data();
  args.num_tokens = num_tokens.typed_data();
  args.capacity = static_cast<int>(capacity);
  args.num_local_tokens = static_cast<int>(send_row.dimensions()[0]);
  args.num_columns = static_cast<int>(y_dims[1]);
  args.row_type = *row_type;
  args.out = out->untyped_data();
  return LaunchError(kCombine, cuda::LaunchHtCombine(call.ht, args, stream));
}

ffi::Error HtCombineExpertMajorImpl(cudaStream_t stream, int32_t device, CallConfig config,
                                    int64_t capacity, ffi::AnyBuffer y, S32Matrix rows_by_expert,
                                    S32Vector recv_src, S32Matrix send_row, S32Scalar num_tokens,
                                    ffi::Result<ffi::AnyBuffer> out,
                                    StatusToken /*status_token*/) {
  auto runtime_or = RuntimeFor(kCombine, config, device, false, /*need_high_throughput=*/true);
  if (runtime_or.has_error()) return runtime_or.error();
  const CallRuntime& call = *runtime_or;
  auto row_type = CombineRowType(y.element_type());
  if (row_type.has_error()) return row_type.error();
  auto y_dims = y.dimensions();
  if (y_dims.size() != 2 || RowBytes(y) % 16 != 0 || y_dims[1] == 0 ||
      rows_by_expert.dimensions()[0] != capacity ||
      rows_by_expert.dimensions()[1] != config.num_topk ||
      recv_src.dimensions()[0] != capacity || send_row.dimensions()[1] != config.num_ranks ||
      send_row.dimensions()[0] > config.max_tokens ||
      out->element_type() != y.element_type() || out->dimensions().size() != 2 ||
      out->dimensions()[0] != send_row.dimensions()[0] || out->dimensions()[1] != y_dims[1]) {
    return ffi::Error::InvalidArgument(
        "jax_ep combine (expert-major): y must be [M, W] pair rows of the handle's dispatch "
        "(of at most T tokens), with W * element size a multiple of 16 bytes; got " +
        ShapeText(y_dims));
  }
  cuda::HtPairCombineArgs args{};
  args.y = y.untyped_data();
  args.rows_by_expert = rows_by_expert.typed_data();
  args.recv_src = recv_src.typed_data();
  args.send_row = send_row.typed_data();
  args.num_tokens = num_tokens.typed_data();
  args.capacity = static_cast<int>(capacity);
  args.num_local_tokens = static_cast<int>(send_row.dimensions()[0]);
  args.num_columns = static_cast<int>(y_dims[1]);
  args.row_type = *row_type;
  args.out = out->untyped_data();
  return LaunchError(kCombine, cuda::LaunchHtPairCombine(call.ht, args, stream));
}

ffi::Error HtSlotValuesImpl(cudaStream_t stream, CallConfig config, F32Vector values,
                            S32Matrix slot_row, ffi::Result<F32Matrix> out,
                            StatusToken /*status_token*/) {
  if (slot_row.dimensions()[1] != config.num_topk ||
      out->dimensions()[0] != slot_row.dimensions()[0] ||
      out->dimensions()[1] != slot_row.dimensions()[1]) {
    return ffi::Error::InvalidArgument("jax_ep dispatch (backward): slot values must match "
                                       "the handle's slot_row [C, K]");
  }
  const int64_t slots = slot_row.dimensions()[0] * slot_row.dimensions()[1];
  return LaunchError("dispatch (backward)",
                     cuda::LaunchHtSlotValues(values.typed_data(), slot_row.typed_data(),
                                              static_cast<int>(slots), out->typed_data(),
                                              stream));
}

}  // namespace

#define JAX_EP_HT_BIND                                   \
  ffi::Ffi::Bind()                                       \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()          \
      .Ctx<ffi::DeviceOrdinal>()                         \
      .Attr<CallConfig>("config")                        \
      .Attr<int64_t>("capacity")

XLA_FFI_DEFINE_HANDLER(kHtDispatch, HtDispatchImpl,
                       JAX_EP_HT_BIND.Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<S32Matrix>()
                           .Ret<F32Matrix>()
                           .Ret<S32Scalar>()
                           .Ret<S32Vector>()
                           .Ret<S32Scalar>()
                           .Ret<S32Scalar>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kHtCombine, HtCombineImpl,
                       JAX_EP_HT_BIND.Arg<ffi::AnyBuffer>()
                           .Arg<S32Vector>()
                           .Arg<S32Matrix>()
                           .Arg<S32Scalar>()
                           .Ret<ffi::AnyBuffer>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kHtDispatchExpertMajor, HtDispatchExpertMajorImpl,
                       JAX_EP_HT_BIND.Attr<int64_t>("num_rows")
                           .Attr<int64_t>("alignment")
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<F32Matrix>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<S32Vector>()
                           .Ret<F32Vector>()
                           .Ret<S32Vector>()
                           .Ret<S32Scalar>()
                           .Ret<S32Vector>()
                           .Ret<S32Vector>()
                           .Ret<S32Scalar>()
                           .Ret<S32Scalar>()
                           .Ret<S32Vector>()
                           .Ret<S32Matrix>()
                           .Ret<S32Scalar>()
                           .Ret<S32Matrix>()
                           .Ret<S32Matrix>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kHtCombineExpertMajor, HtCombineExpertMajorImpl,
                       JAX_EP_HT_BIND.Arg<ffi::AnyBuffer>()
                           .Arg<S32Matrix>()
                           .Arg<S32Vector>()
                           .Arg<S32Matrix>()
                           .Arg<S32Scalar>()
                           .Ret<ffi::AnyBuffer>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER(kHtSlotValues, HtSlotValuesImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Attr<CallConfig>("config")
                           .Arg<F32Vector>()
                           .Arg<S32Matrix>()
                           .Ret<F32Matrix>()
                           .Arg<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

void AppendHtHandlers(std::vector<HandlerEntry>* entries) {
  entries->push_back({exports::kHtDispatch, kHtDispatch});
  entries->push_back({exports::kHtCombine, kHtCombine});
  entries->push_back({exports::kHtDispatchExpertMajor, kHtDispatchExpertMajor});
  entries->push_back({exports::kHtCombineExpertMajor, kHtCombineExpertMajor});
  entries->push_back({exports::kHtSlotValues, kHtSlotValues});
}

}  // namespace jax_ep::ffi_cuda
