// Hopper bulk copies (cp.async.bulk, the TMA unit without tensor maps):
// global into shared memory, completing on a shared-memory mbarrier, and
// shared into global memory, completing in bulk groups.
//
// PROTOCOL (one barrier per buffer, arrival count 1): the issuing thread calls
// bulk_load(), which arrives on the barrier and declares the bytes to expect;
// the barrier's phase completes when all of them have landed. Every reader
// waits for that phase (mbarrier_wait_parity with the buffer's use count & 1)
// before reading. Before the next bulk_load into the same buffer, its readers
// are done: threads (__syncwarp / __syncthreads, then the issuer orders their
// generic-proxy reads before the async-proxy writes: fence_proxy_async_shared)
// or a bulk_store from it (the issuer waits for its group's reads:
// bulk_wait_reads). A thread that issued bulk stores waits for their
// completion (bulk_wait_all) before its block exits.
// Nothing here waits on a peer: a bulk copy of valid memory always completes.
#ifndef JAX_EP_CUDA_BULK_COPY_CUH_
#define JAX_EP_CUDA_BULK_COPY_CUH_

#include <cstdint>

namespace jax_ep::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// One thread, before the barrier's first use; then a barrier among its users.
__device__ __forceinline__ void mbarrier_init_one(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(shared_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// `src` into shared `dst`, completing the current phase of `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
               ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(shared_address(dst)), "l"(src), "r"(bytes), "r"(shared_address(bar))
      : "memory");
}

// Waits until the phase of `bar` with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n"
        "  .reg .pred ready;\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, ready;\n"
        "}\n"
        : "=r"(done)
        : "r"(shared_address(bar)), "r"(parity)
        : "memory");
  }
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from shared
// `src` to global `dst`, as one bulk group of this thread.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               ::"l"(dst), "r"(shared_address(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// This thread's bulk stores have read their shared memory (it may be reused).
__device__ __forceinline__ void bulk_wait_reads() {
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}

// This thread's bulk stores are complete.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// Orders this thread's (and, after a barrier, its group's) generic-proxy
// accesses to shared memory before later async-proxy ones (a bulk_load into
// a buffer just read).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_BULK_COPY_CUH_
