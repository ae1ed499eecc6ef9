// Shared by the HT kernels (ht_dispatch.cu, ht_combine.cu): the block shape and
// the profile hooks. Each .cu includes it once (anonymous namespace).
#ifndef JAX_EP_CUDA_HT_COMMON_CUH_
#define JAX_EP_CUDA_HT_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/ht_launch.h"

namespace jax_ep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / kWarpSize;

// Profiling hooks (JAX_EP_PROFILE=1; no-ops when ctx.profile is null). Slots:
// ep_types.h DeviceProfile. A role's time runs from block 0's start to the
// latest end among the role's blocks; the last block of the call closes it.
constexpr int kProfCounts = 4, kProfDispatchSend = 5, kProfDispatchRecv = 6,
              kProfCombineSend = 7, kProfCombineRecv = 8;

__device__ __forceinline__ void ht_profile_start(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    ctx.profile->start[k] = global_timer_ns();
  }
}
// Thread 0 of each block of the role, once the block's part is done.
__device__ __forceinline__ void ht_profile_role_end(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    atomicMax(reinterpret_cast<unsigned long long*>(&ctx.profile->role_end[k]),
              static_cast<unsigned long long>(global_timer_ns()));
  }
}
// Thread 0 of a block: `ns` this block spent waiting for peers.
__device__ __forceinline__ void ht_profile_wait(const HtContext& ctx, int k, uint64_t ns) {
  if (ctx.profile != nullptr && threadIdx.x == 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctx.profile->wait_ns[k]),
              static_cast<unsigned long long>(ns));
    atomicAdd(reinterpret_cast<unsigned long long*>(&ctx.profile->blocks[k]), 1ull);
  }
}
// HT dispatch timeline (DeviceProfile::ht_trace); one thread calls it.
__device__ __forceinline__ void ht_trace(const HtContext& ctx, uint32_t seq, int event,
                                         uint64_t at = 0) {
  if (ctx.profile != nullptr) {
    ctx.profile->ht_trace[seq % kHtTraceCalls][event] = at != 0 ? at : global_timer_ns();
  }
}
// One thread of the call's last block, after every block's role_end.
__device__ __forceinline__ void ht_profile_close(const HtContext& ctx, int k) {
  if (ctx.profile != nullptr) {
    DeviceProfile* p = ctx.profile;
    if (p->role_end[k] > p->start[k]) p->total_ns[k] += p->role_end[k] - p->start[k];
    p->role_end[k] = 0;
    p->calls[k] += 1;
  }
}

}  // namespace
}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_COMMON_CUH_
