// XLA FFI handler (CUDA) of get_dispatch_layout: one kernel launch (one thread-
// block cluster, no memset), local only (no NVSHMEM, no runtime state),
// command-buffer compatible.
//
//   jax_ep_layout(topk_idx s32[T,K]) ->
//       clean_idx s32[T,K], num_invalid s32[], tokens_per_rank s32[R],
//       tokens_per_expert s32[E], is_token_in_rank pred[T,R]
#include "xla_ffi/cuda/layout_handlers.h"

#include <string>

#include "cuda/layout_launch.h"
#include "xla_ffi/cuda/handler_common.h"

namespace jax_ep::ffi_cuda {
namespace {

using S32Scalar = ffi::Buffer<ffi::S32, 0>;
using S32Vector = ffi::Buffer<ffi::S32, 1>;
using S32Matrix = ffi::Buffer<ffi::S32, 2>;
using PredMatrix = ffi::Buffer<ffi::PRED, 2>;

ffi::Error LayoutImpl(cudaStream_t stream, int64_t num_experts, int64_t num_ranks,
                      S32Matrix topk_idx, ffi::Result<S32Matrix> clean_idx,
                      ffi::Result<S32Scalar> num_invalid, ffi::Result<S32Vector> tokens_per_rank,
                      ffi::Result<S32Vector> tokens_per_expert,
                      ffi::Result<PredMatrix> is_token_in_rank) {
  auto dims = topk_idx.dimensions();
  if (clean_idx->dimensions()[0] != dims[0] || clean_idx->dimensions()[1] != dims[1] ||
      tokens_per_rank->dimensions()[0] != num_ranks ||
      tokens_per_expert->dimensions()[0] != num_experts ||
      is_token_in_rank->dimensions()[0] != dims[0] ||
      is_token_in_rank->dimensions()[1] != num_ranks) {
    return ffi::Error::InvalidArgument("jax_ep get_dispatch_layout: result shapes do not match "
                                       "topk_idx " + ShapeText(dims));
  }
  cuda::LayoutArgs args{};
  args.topk_idx = topk_idx.typed_data();
  args.num_tokens = static_cast<int>(dims[0]);
  args.num_topk = static_cast<int>(dims[1]);
  args.num_experts = static_cast<int>(num_experts);
  args.num_ranks = static_cast<int>(num_ranks);
  args.out_clean_idx = clean_idx->typed_data();
  args.out_num_invalid = num_invalid->typed_data();
  args.out_tokens_per_rank = tokens_per_rank->typed_data();
  args.out_tokens_per_expert = tokens_per_expert->typed_data();
  args.out_is_token_in_rank = is_token_in_rank->typed_data();
  const cudaError_t err = cuda::LaunchLayout(args, stream);
  if (err == cudaErrorInvalidValue) {
    return ffi::Error::InvalidArgument(
        "jax_ep get_dispatch_layout: the layout kernel needs 1 <= K <= 32, 1 <= R <= " +
        std::to_string(cuda::kLayoutMaxRanks) + ", E a positive multiple of R and E + R <= " +
        std::to_string(cuda::kLayoutMaxCounters) + "; got K = " +
        std::to_string(args.num_topk) + ", E = " + std::to_string(num_experts) + ", R = " +
        std::to_string(num_ranks));
  }
  return LaunchError("get_dispatch_layout", err);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("num_ranks")
                           .Arg<S32Matrix>()
                           .Ret<S32Matrix>()
                           .Ret<S32Scalar>()
                           .Ret<S32Vector>()
                           .Ret<S32Vector>()
                           .Ret<PredMatrix>(),
                       {ffi::Traits::kCmdBufferCompatible});

void AppendLayoutHandlers(std::vector<HandlerEntry>* entries) {
  entries->push_back({"jax_ep_layout", kLayout});
}

}  // namespace jax_ep::ffi_cuda
