#include "xla_ffi/cuda/handler_common.h"

#include <string>

namespace jax_ep::ffi_cuda {
namespace {

const char* OpName(uint32_t op) {
  switch (op) {
    case cuda::kOpLlDispatch: return "low_latency_dispatch";
    case cuda::kOpLlCombine: return "low_latency_combine";
    case cuda::kOpHtNotify: return "dispatch (count exchange)";
    case cuda::kOpHtDispatch: return "dispatch";
    case cuda::kOpHtCombine: return "combine";
    default: return "unknown op";
  }
}

}  // namespace

std::string DimsText(const cuda::EpDims& d) {
  return "R=" + std::to_string(d.num_ranks) + " E=" + std::to_string(d.num_experts) +
         " H=" + std::to_string(d.hidden) + " T=" + std::to_string(d.max_tokens) +
         " T_ll=" + std::to_string(d.ll_max_tokens) + " K=" + std::to_string(d.num_topk);
}

std::string ShapeText(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

std::string CallDims(const CallConfig& traced, const cuda::EpDims& allocated,
                     bool low_latency, bool high_throughput, cuda::EpDims* call) {
  cuda::EpDims t{static_cast<int32_t>(traced.num_ranks), allocated.rank,
                 static_cast<int32_t>(traced.num_experts), 0,
                 static_cast<int32_t>(traced.hidden), static_cast<int32_t>(traced.max_tokens),
                 static_cast<int32_t>(traced.ll_max_tokens),
                 static_cast<int32_t>(traced.num_topk)};
  if (traced.num_ranks != allocated.num_ranks) {
    return "compiled for an EP group of " + std::to_string(traced.num_ranks) +
           " ranks, but the runtime's group has " + std::to_string(allocated.num_ranks) +
           "; re-trace after jax_ep.initialize with this config's mesh";
  }
  // Which traced dims exceed the allocation (the families this op uses only).
  std::string over;
  auto check = [&over](const char* name, int64_t value, int32_t limit) {
    if (value > limit) {
      over += std::string(over.empty() ? "" : ", ") + name + " " + std::to_string(value) +
              " > " + std::to_string(limit);
    }
  };
  check("E", traced.num_experts, allocated.num_experts);
  check("H", traced.hidden, allocated.hidden);
  check("K", traced.num_topk, allocated.num_topk);
  if (high_throughput) check("T", traced.max_tokens, allocated.max_tokens);
  if (low_latency) check("T_ll", traced.ll_max_tokens, allocated.ll_max_tokens);
  if (!over.empty()) {
    return "compiled for " + DimsText(t) + ", but the buffers were allocated for at most " +
           DimsText(allocated) + " (the largest of each size over the configs given to "
           "jax_ep.initialize): " + over + ". Pass this config to jax_ep.initialize with the "
           "others and re-trace";
  }
  if (traced.num_experts <= 0 || traced.hidden <= 0 || traced.num_topk <= 0 ||
      traced.max_tokens <= 0 || traced.ll_max_tokens <= 0 ||
      traced.num_experts % traced.num_ranks != 0) {
    return "compiled for " + DimsText(t) + ": sizes must be positive and E a multiple of R";
  }
  t.experts_per_rank = t.num_experts / t.num_ranks;
  *call = t;
  return "";
}

ffi::ErrorOr<CallRuntime> RuntimeFor(const char* op, const CallConfig& traced,
                                     int32_t device_ordinal, bool need_low_latency,
                                     bool need_high_throughput) {
  const cuda::Runtime* current = cuda::Runtime::Current();
  if (current == nullptr || !current->initialized() || !current->allocated()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
        std::string("jax_ep ") + op + ": the CUDA runtime is not initialised (or was finalised); "
        "call jax_ep.initialize(config, mesh) before running compiled jax_ep ops");
  }
  const cuda::Runtime& runtime = *current;
  CallRuntime call{&runtime, {}, runtime.ll_context(), runtime.ht_context()};
  const std::string why = CallDims(traced, runtime.dims(), need_low_latency,
                                   need_high_throughput, &call.dims);
  if (!why.empty()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, std::string("jax_ep ") + op + ": " +
                                                               why);
  }
  call.ll.dims = call.dims;
  call.ht.dims = call.dims;
  if (device_ordinal != runtime.device()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": running on device " + std::to_string(device_ordinal) +
        " but jax_ep's NVSHMEM PE is bound to device " + std::to_string(runtime.device()) +
        " (one JAX process per GPU: use python -m jax_ep.launch)");
  }
  if (need_low_latency && !runtime.low_latency()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": low-latency buffers were not allocated "
        "(EpConfig(enable_low_latency=False) in every config given to jax_ep.initialize)");
  }
  if (need_high_throughput && !runtime.high_throughput()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": high-throughput buffers were not allocated "
        "(EpConfig(enable_high_throughput=False) in every config given to jax_ep.initialize)");
  }
  return call;
}

namespace {

// The error of an earlier fault recorded by a kernel (host-mapped status
// word), or success.
ffi::Error PendingFault(const char* op, const cuda::Runtime& runtime) {
  const cuda::DeviceStatus status = runtime.status();
  if (status.code == cuda::kStatusOk) return ffi::Error::Success();
  if (status.code == cuda::kStatusProtocol) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      std::string("jax_ep.EpError: jax_ep ") + op + ": an earlier jax_ep op (" +
                          OpName(status.op) +
                          ") ran while a split send of its kind awaited its receive (each "
                          "low_latency_*_send must reach its *_recv before the next send or "
                          "one-call op of that kind); its results were void and the EP "
                          "group's low-latency state is out of step: see jax_ep.status()");
  }
  return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                    std::string("jax_ep.EpError: jax_ep ") + op + ": an earlier jax_ep op (" +
                        OpName(status.op) + ") timed out waiting for EP rank " +
                        std::to_string(status.peer) + " (detail " +
                        std::to_string(status.detail) +
                        "); the EP group is out of step: see jax_ep.status()");
}

// The pending fault, if any (a runtime not set up is left to the kernel
// handlers, which say why).
ffi::Error CheckStatus() {
  const cuda::Runtime* runtime = cuda::Runtime::Current();
  if (runtime == nullptr || !runtime->allocated()) return ffi::Error::Success();
  return PendingFault("call", *runtime);
}

ffi::Error PrepareStatusCheck(ffi::RemainingArgs, ffi::RemainingRets, ffi::Dictionary) {
  return CheckStatus();
}

XLA_FFI_DEFINE_HANDLER(kPrepareStatusCheck, PrepareStatusCheck,
                       ffi::Ffi::Bind<ffi::ExecutionStage::kPrepare>()
                           .RemainingArgs()
                           .RemainingRets()
                           .Attrs());

ffi::Error StatusCheck(cudaStream_t stream, ffi::AnyBuffer /*zero*/,
                       ffi::Result<StatusToken> token) {
  if (ffi::Error fault = CheckStatus(); fault.failure()) return fault;
  return LaunchError("status check",
                     cudaMemsetAsync(token->typed_data(), 0, sizeof(int32_t), stream));
}

XLA_FFI_DEFINE_HANDLER(kStatusCheck, StatusCheck,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()
                           .Ret<StatusToken>(),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace

XLA_FFI_Handler* PrepareStatusCheckHandler() { return kPrepareStatusCheck; }
XLA_FFI_Handler* StatusCheckHandler() { return kStatusCheck; }

ffi::Error LaunchError(const char* op, cudaError_t err) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_ep ") + op + ": kernel launch failed: " +
                              cudaGetErrorString(err));
}

}  // namespace jax_ep::ffi_cuda
