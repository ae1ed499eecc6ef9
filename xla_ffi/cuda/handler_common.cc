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

ffi::ErrorOr<const cuda::Runtime*> RuntimeFor(const char* op, const CallConfig& traced,
                                              int32_t device_ordinal, bool need_low_latency,
                                              bool need_high_throughput) {
  const cuda::Runtime& runtime = cuda::Runtime::Get();
  if (!runtime.initialized() || !runtime.allocated()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": the CUDA runtime is not initialised (or was finalised); "
        "call jax_ep.initialize(config, mesh) before running compiled jax_ep ops");
  }
  const cuda::EpDims& d = runtime.dims();
  if (d.num_ranks != traced.num_ranks || d.num_experts != traced.num_experts ||
      d.hidden != traced.hidden || d.max_tokens != traced.max_tokens ||
      d.ll_max_tokens != traced.ll_max_tokens || d.num_topk != traced.num_topk) {
    cuda::EpDims t{static_cast<int32_t>(traced.num_ranks), 0,
                   static_cast<int32_t>(traced.num_experts), 0,
                   static_cast<int32_t>(traced.hidden), static_cast<int32_t>(traced.max_tokens),
                   static_cast<int32_t>(traced.ll_max_tokens),
                   static_cast<int32_t>(traced.num_topk)};
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": compiled for " + DimsText(t) +
        " but the runtime is initialised for " + DimsText(d) +
        "; re-trace after jax_ep.initialize with this config");
  }
  if (device_ordinal != runtime.device()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": running on device " + std::to_string(device_ordinal) +
        " but jax_ep's NVSHMEM PE is bound to device " + std::to_string(runtime.device()) +
        " (one JAX process per GPU: use python -m jax_ep.launch)");
  }
  if (need_low_latency && !runtime.low_latency()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": low-latency buffers were not allocated "
        "(EpConfig(enable_low_latency=False))");
  }
  if (need_high_throughput && !runtime.high_throughput()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, 
        std::string("jax_ep ") + op + ": high-throughput buffers were not allocated "
        "(EpConfig(enable_high_throughput=False))");
  }
  return &runtime;
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
  const cuda::Runtime& runtime = cuda::Runtime::Get();
  if (!runtime.allocated()) return ffi::Error::Success();
  return PendingFault("call", runtime);
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
