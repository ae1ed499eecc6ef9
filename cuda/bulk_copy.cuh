// Hopper bulk copies (cp.async.bulk, the TMA unit's non-tensor copies) between
// global and shared memory, and the mbarrier that tracks the loads.
//
// Why: an SM's own loads and stores go through its L1 and reach about 40 GB/s
// of rows per SM however many are in flight (docs/benchmarks.md, the SM sweep
// of 2026-12-03); the TMA unit moves whole rows per instruction outside that
// path. Rules the callers keep (PTX ISA, "Asynchronous operations"):
//   * addresses and sizes are multiples of 16 bytes;
//   * shared memory written by threads is handed to a bulk store after
//     fence.proxy.async.shared::cta (bulk_fence_shared) and a warp barrier;
//   * a bulk store's source may be rewritten only after
//     cp.async.bulk.wait_group.read (bulk_wait_reads) in the issuing thread;
//     every issuing thread waits for all its bulk stores (bulk_wait_all)
//     before it exits;
//   * a bulk load completes on its mbarrier (expect_tx bytes, then a phase
//     flip); its data may be read after mbar_wait of that phase; its buffer
//     may be loaded into again after every reader passed a warp barrier and
//     bulk_fence_shared.
#ifndef JAX_EP_CUDA_BULK_COPY_CUH_
#define JAX_EP_CUDA_BULK_COPY_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void bulk_fence_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Shared -> global, in the issuing thread's current bulk group.
__device__ __forceinline__ void bulk_store(void* global_dst, const void* shared_src,
                                           uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global_dst),
               "r"(shared_address(shared_src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Every committed bulk store of this thread has read its shared source.
__device__ __forceinline__ void bulk_wait_reads() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
// Every committed bulk store of this thread is complete (its writes done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The issuing thread's arrival, announcing `bytes` of bulk loads on this phase.
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)),
               "r"(bytes)
               : "memory");
}
// Global -> shared, completing on `bar`.
__device__ __forceinline__ void bulk_load(void* shared_dst, const void* global_src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          shared_address(shared_dst)),
      "l"(global_src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}
// Waits until the phase with this parity completed; false after timeout_ns
// (the loads are this kernel's own reads of device memory, so only a broken
// device gets there; the caller records a fault and voids its rows).
__device__ __forceinline__ bool mbar_wait(uint64_t* bar, uint32_t parity, uint64_t timeout_ns) {
  const uint32_t addr = shared_address(bar);
  uint64_t start = 0;
  for (uint32_t spins = 0;; ++spins) {
    uint32_t done = 0;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(addr), "r"(parity) : "memory");
    if (done) return true;
    if ((spins & 1023u) == 1023u) {
      uint64_t now;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        return false;
      }
    }
  }
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_BULK_COPY_CUH_
