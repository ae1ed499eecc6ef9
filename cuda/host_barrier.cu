// A bounded barrier over every PE, for the host's collective steps (allocate,
// release, finalize): nvshmem_barrier_all has no timeout, so a PE that died
// would hang every survivor there. This one gives up after a timeout and names
// the first PE that did not arrive; the caller then skips NVSHMEM's
// collectives instead of entering them.
//
// PROTOCOL (npes PEs, flags = [npes] uint64 in symmetric memory, zero at
// start, never reset; n = the barrier's number, a host counter that is the same
// on every PE because every PE runs the same collective steps in the same
// order; flags carry (n << 32 | phase) as in device_common.cuh):
//   phase 1: thread p sets PE p's flags[me] = (n, 1) (st.release.sys through
//     the peer mapping, or an NVSHMEM signal for a PE reached only by RDMA),
//     then waits (bounded) until its own flags[p] carries (n, >= 1).
//   phase 2: once the block saw every PE in phase 1, thread p sets PE p's
//     flags[me] = (n, 2) and waits until flags[p] carries (n, 2).
// A PE that times out in phase 1 never sets phase 2, so a peer that passed
// phase 1 only because that PE arrived just before giving up times out in
// phase 2 too: both skip the collectives. The outcome can still differ when a
// PE's phase-2 flag arrives later than the timeout after its peers', i.e. only
// when PEs are more than a timeout apart while all alive.
// The kernel is launched on a private stream and the host waits for it: these
// are host steps outside any jit, where a host sync is fine.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "cuda/device_common.cuh"
#include "cuda/host_barrier.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {
namespace {

constexpr int kBarrierThreads = 1024;

__device__ void set_peer_flag(uint64_t* flags, int me, int pe, uint64_t value) {
  transport::set_flag_pe(flags + me, value, pe, nullptr, 0);
}

// Waits until flags[pe] carries barrier n with a phase of at least `phase`,
// or a later barrier (that PE is past this one).
__device__ bool wait_phase(const uint64_t* flags, int pe, uint32_t n, uint32_t phase,
                           uint64_t timeout_ns) {
  const uint64_t start = global_timer_ns();
  uint32_t polls = 0;
  for (;;) {
    const uint64_t value = ld_acquire_sys(flags + pe);
    if (flag_seq(value) > n || (flag_seq(value) == n && flag_value(value) >= phase)) return true;
    if (polls++ > 64u) __nanosleep(256);
    if ((polls & 255u) == 0u && global_timer_ns() - start > timeout_ns) return false;
  }
}

__global__ void __launch_bounds__(kBarrierThreads, 1)
    bounded_barrier(uint64_t* flags, int me, int npes, uint32_t n, uint64_t timeout_ns,
                    int32_t* first_missing) {
  __shared__ int s_missing;
  if (threadIdx.x == 0) s_missing = npes;
  __syncthreads();
  for (uint32_t phase = 1; phase <= 2; ++phase) {
    for (int pe = threadIdx.x; pe < npes; pe += blockDim.x) {
      __threadfence_system();
      set_peer_flag(flags, me, pe, make_flag(n, phase));
    }
    for (int pe = threadIdx.x; pe < npes; pe += blockDim.x) {
      if (!wait_phase(flags, pe, n, phase, timeout_ns)) atomicMin(&s_missing, pe);
    }
    __syncthreads();
    if (s_missing < npes) break;  // block-uniform: this PE does not enter phase 2
  }
  if (threadIdx.x == 0) *first_missing = s_missing < npes ? s_missing : -1;
}

}  // namespace

cudaError_t RunBoundedBarrier(uint64_t* flags, int me, int npes, uint32_t n,
                              uint64_t timeout_ns, cudaStream_t stream, int32_t* device_result,
                              int* first_missing) {
  bounded_barrier<<<1, kBarrierThreads, 0, stream>>>(flags, me, npes, n, timeout_ns,
                                                     device_result);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(first_missing, device_result, sizeof(int32_t), cudaMemcpyDeviceToHost,
                          stream);
  }
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  return err;
}

}  // namespace jax_ep::cuda
