// What the compiled modules tell Python, so that no Python literal copies a
// C++ name or limit: the XLA FFI target name of every handler, by op, and
// the kernels' limits (cuda/limits.h). Both nanobind modules export these
// tables (cpu_module.cc, cuda_module.cc): the CPU module is always built, so
// a machine without the CUDA module can still lower for CUDA
// (jax_ep.runtime.lowering_only); where both load, jax_ep/_extension.py checks
// that they agree (a stale half of a build). Plain C++, header only.
#ifndef JAX_EP_XLA_FFI_EXPORTS_H_
#define JAX_EP_XLA_FFI_EXPORTS_H_

#include <cstdint>

#include "cuda/limits.h"

namespace jax_ep::exports {

// Target names. CPU: the portable backend's local steps (xla_ffi/cpu).
inline constexpr char kCpuLayout[] = "jax_ep_cpu_layout";
inline constexpr char kCpuCheckInvalid[] = "jax_ep_cpu_check_invalid";
inline constexpr char kCpuHtRoute[] = "jax_ep_cpu_ht_route";
inline constexpr char kCpuHtCompact[] = "jax_ep_cpu_ht_compact";
inline constexpr char kCpuLlRoute[] = "jax_ep_cpu_ll_route";
inline constexpr char kCpuLlCompact[] = "jax_ep_cpu_ll_compact";
inline constexpr char kCpuScatterRows[] = "jax_ep_cpu_scatter_rows";
inline constexpr char kCpuGatherRows[] = "jax_ep_cpu_gather_rows";
inline constexpr char kCpuGatherReduce[] = "jax_ep_cpu_gather_reduce";

// CUDA: the kernels (xla_ffi/cuda).
inline constexpr char kHtDispatch[] = "jax_ep_ht_dispatch";
inline constexpr char kHtCombine[] = "jax_ep_ht_combine";
inline constexpr char kHtDispatchExpertMajor[] = "jax_ep_ht_dispatch_expert_major";
inline constexpr char kHtCombineExpertMajor[] = "jax_ep_ht_combine_expert_major";
inline constexpr char kHtSlotValues[] = "jax_ep_ht_slot_values";
inline constexpr char kLlDispatch[] = "jax_ep_ll_dispatch";
inline constexpr char kLlCombine[] = "jax_ep_ll_combine";
inline constexpr char kLlDispatchSend[] = "jax_ep_ll_dispatch_send";
inline constexpr char kLlDispatchRecv[] = "jax_ep_ll_dispatch_recv";
inline constexpr char kLlCombineSend[] = "jax_ep_ll_combine_send";
inline constexpr char kLlCombineRecv[] = "jax_ep_ll_combine_recv";
// Every CUDA call's last operand (xla_ffi/cuda/handler_common.h StatusToken).
inline constexpr char kStatusCheck[] = "jax_ep_status_check";

struct Named {
  const char* op;      // the key Python reads (jax_ep/_extension.py)
  const char* target;  // the FFI target name
};

inline constexpr Named kCpuTargets[] = {
    {"layout", kCpuLayout},           {"check_invalid", kCpuCheckInvalid},
    {"ht_route", kCpuHtRoute},        {"ht_compact", kCpuHtCompact},
    {"ll_route", kCpuLlRoute},        {"ll_compact", kCpuLlCompact},
    {"scatter_rows", kCpuScatterRows}, {"gather_rows", kCpuGatherRows},
    {"gather_reduce", kCpuGatherReduce},
};

inline constexpr Named kCudaTargets[] = {
    {"ht_dispatch", kHtDispatch},
    {"ht_combine", kHtCombine},
    {"ht_dispatch_expert_major", kHtDispatchExpertMajor},
    {"ht_combine_expert_major", kHtCombineExpertMajor},
    {"ht_slot_values", kHtSlotValues},
    {"ll_dispatch", kLlDispatch},
    {"ll_combine", kLlCombine},
    {"ll_dispatch_send", kLlDispatchSend},
    {"ll_dispatch_recv", kLlDispatchRecv},
    {"ll_combine_send", kLlCombineSend},
    {"ll_combine_recv", kLlCombineRecv},
    {"status_check", kStatusCheck},
};

struct Limit {
  const char* name;  // a field of jax_ep._extension.KernelLimits
  int64_t value;
};

inline constexpr Limit kLimits[] = {
    {"max_topk", cuda::kMaxTopk},
    {"ht_max_ranks", cuda::kHtMaxRanks},
    {"ht_max_tokens", cuda::kHtMaxTokens},
    {"ht_max_experts_per_rank", cuda::kHtMaxExpertsPerRank},
    {"ht_chunk_rows", cuda::kHtChunkRows},
    {"ht_plan_blocks", cuda::kHtPlanBlocks},
    {"ht_one_rank_plan_blocks", cuda::kHtOneRankPlanBlocks},
    {"ll_max_ranks", cuda::kLlMaxRanks},
    {"ll_max_dynamic_smem_bytes", static_cast<int64_t>(cuda::kLlMaxDynamicSmem)},
};

}  // namespace jax_ep::exports

#endif  // JAX_EP_XLA_FFI_EXPORTS_H_
