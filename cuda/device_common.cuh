// Device-side building blocks shared by jax_ep's kernels: memory-ordering
// primitives, sequence-tagged completion flags, bounded waits, the fault
// status word and the "last block finishes the call" counter.
//
// Completion flags are 64-bit words that carry (call sequence << 32 | value).
// A receiver waits until the high half equals the sequence number of the call
// it is in. Because every rank issues the same calls in the same order, the
// sequence numbers agree across ranks without any exchange; a stale flag from
// an earlier call never matches, so flags are never reset. Sequence numbers
// start at 1 (zero-initialised memory never matches).
#ifndef JAX_EP_CUDA_DEVICE_COMMON_CUH_
#define JAX_EP_CUDA_DEVICE_COMMON_CUH_

#include <cstdint>

#include "cuda/ep_types.h"

namespace jax_ep::cuda {

constexpr int kWarpSize = 32;

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

// GPU scope: for flags that only this GPU's threads write (a rank's flags to
// itself); an acquire.gpu is cheaper than an acquire.sys.
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* ptr) {
  uint64_t value;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

// A flag's acquire at the narrowest scope that covers its writers.
__device__ __forceinline__ uint64_t ld_acquire_flag(const uint64_t* ptr, bool gpu_scope) {
  return gpu_scope ? ld_acquire_gpu(ptr) : ld_acquire_sys(ptr);
}

__device__ __forceinline__ uint32_t ld_acquire_sys_u32(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}

// Publishing to (possibly peer-mapped) counters, the release pattern split in
// two: the fence orders the caller's earlier writes, and those ordered before
// them (e.g. by __syncwarp), before every relaxed add after it, so whoever
// acquires a new value sees them; several counters, one fence.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
__device__ __forceinline__ void red_add_relaxed_sys(uint32_t* ptr, uint32_t value) {
  asm volatile("red.relaxed.sys.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}

// Atomic add at GPU scope with acquire-release semantics; returns the old value.
// The "last arriver" of a counter acquires every earlier arriver's writes
// (and, through their barriers, their blocks' writes) before it publishes them.
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* ptr, uint32_t value) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(ptr), "r"(value)
               : "memory");
  return old;
}

__device__ __forceinline__ void st_release_sys(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// A release at GPU scope: enough when every reader runs on this GPU (a rank's
// flags to itself), and cheaper than st.release.sys, whose fence waits for the
// thread's earlier writes to be visible to the whole system.
__device__ __forceinline__ void st_release_gpu(uint64_t* ptr, uint64_t value) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr));
  return value;
}

__device__ __forceinline__ float ld_volatile_f32(const float* ptr) {
  float value;
  asm volatile("ld.volatile.global.f32 %0, [%1];" : "=f"(value) : "l"(ptr));
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// 16-byte global load that does not allocate in L1. coherent = false:
// ld.global.nc, for data that is read-only for the whole kernel. coherent =
// true: a coherent (weak) load, for data another block or a peer wrote during
// this kernel and published by a flag or counter this thread's block acquired
// (ld.global.nc is undefined for such data). `coherent` is a constant at
// almost every call, so only one of the two loads is emitted there.
__device__ __forceinline__ int4 ld_v4_no_alloc(const int4* ptr, bool coherent) {
  int4 v;
  if (coherent) {
    asm volatile("ld.global.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(ptr));
  }
  return v;
}

// 16-byte store that does not allocate in L1 (streaming to local or peer memory).
__device__ __forceinline__ void st_na_v4(int4* ptr, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w));
}

// Warp-collective batched load: lane `lane` loads vectors base + u*32 + lane
// (u < kUnroll, those below num_vec) of `src`, all in flight at once;
// `coherent` as in ld_v4_no_alloc.
template <int kUnroll>
__device__ __forceinline__ void warp_load_batch(int4 (&batch)[kUnroll], const int4* src, int base,
                                                int num_vec, int lane, bool coherent = false) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = base + u * kWarpSize + lane;
    if (v < num_vec) batch[u] = ld_v4_no_alloc(src + v, coherent);
  }
}

// Stores what warp_load_batch loaded, to the same positions of `dst`.
template <int kUnroll>
__device__ __forceinline__ void warp_store_batch(int4* dst, const int4 (&batch)[kUnroll], int base,
                                                 int num_vec, int lane) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int v = base + u * kWarpSize + lane;
    if (v < num_vec) st_na_v4(dst + v, batch[u]);
  }
}

// Warp-collective copy of `num_vec` int4 to `dst` (local or a peer's): batches
// of kUnroll independent loads before their stores keep several loads in
// flight per lane. kCoherent: `coherent` of ld_v4_no_alloc.
template <int kUnroll = 8, bool kCoherent = false>
__device__ __forceinline__ void warp_copy(int4* dst, const int4* src, int num_vec, int lane) {
  for (int base = 0; base < num_vec; base += kUnroll * kWarpSize) {
    int4 batch[kUnroll];
    warp_load_batch(batch, src, base, num_vec, lane, kCoherent);
    warp_store_batch(dst, batch, base, num_vec, lane);
  }
}

__device__ __forceinline__ uint64_t make_flag(uint32_t seq, uint32_t value) {
  return (static_cast<uint64_t>(seq) << 32) | value;
}
__device__ __forceinline__ uint32_t flag_seq(uint64_t flag) { return static_cast<uint32_t>(flag >> 32); }
__device__ __forceinline__ uint32_t flag_value(uint64_t flag) { return static_cast<uint32_t>(flag); }

// Records the first fault of this process: later kernels see it and skip all
// waits, and the host reads it (host-mapped) without a stream sync.
__device__ __forceinline__ void record_fault(DeviceStatus* status, uint32_t code, uint32_t op,
                                             int32_t peer, int32_t detail) {
  if (atomicCAS(&status->code, 0u, code) == 0u) {
    status->op = op;
    status->peer = peer;
    status->detail = detail;
    __threadfence_system();
    atomicAdd(&status->fault_count, 1u);
  }
}

__device__ __forceinline__ bool fault_recorded(const DeviceStatus* status) {
  return ld_volatile_u32(&status->code) != 0u;
}

// What a wait does when it times out by default: record the fault.
struct RecordFault {
  DeviceStatus* status;
  uint32_t op;
  int32_t peer;
  int32_t detail;
  __device__ __forceinline__ void operator()() const {
    record_fault(status, kStatusTimeout, op, peer, detail);
  }
};

// Polls `ready()` (one thread) until it returns true; false after a timeout
// (then `on_timeout()` runs: by default it records a fault naming `op` and
// `peer`), or at once when an earlier fault was recorded. The one bounded spin
// of every wait in the kernels.
template <typename Ready, typename OnTimeout>
__device__ __forceinline__ bool bounded_wait(Ready ready, uint64_t timeout_ns,
                                             DeviceStatus* status, OnTimeout on_timeout) {
  if (ready()) return true;
  const uint64_t start = global_timer_ns();
  uint32_t polls = 0;
  while (!ready()) {
    // Back off a little after the first polls: many pollers slow the very
    // NVLink writes they are waiting for.
    if (polls > 64u) __nanosleep(32);
    if ((++polls & 1023u) == 0u) {
      if (fault_recorded(status)) return false;
      if (global_timer_ns() - start > timeout_ns) {
        on_timeout();
        return false;
      }
    }
  }
  return true;
}

template <typename Ready>
__device__ __forceinline__ bool bounded_wait(Ready ready, uint64_t timeout_ns,
                                             DeviceStatus* status, uint32_t op, int32_t peer,
                                             int32_t detail) {
  return bounded_wait(ready, timeout_ns, status, RecordFault{status, op, peer, detail});
}

// Waits (one thread) until the flag carries `seq`; returns its value, or
// kFlagTimedOut (see bounded_wait). gpu_scope: the flag's writers all run on
// this GPU (acquire.gpu instead of acquire.sys).
constexpr uint32_t kFlagTimedOut = 0xffffffffu;

__device__ __forceinline__ uint32_t wait_flag(const uint64_t* flag, uint32_t seq,
                                              uint64_t timeout_ns, DeviceStatus* status,
                                              uint32_t op, int32_t peer, int32_t detail,
                                              bool gpu_scope = false) {
  uint64_t value = 0;
  const bool arrived = bounded_wait(
      [&] {
        value = ld_acquire_flag(flag, gpu_scope);
        return flag_seq(value) == seq;
      },
      timeout_ns, status, op, peer, detail);
  return arrived ? flag_value(value) : kFlagTimedOut;
}

// Waits (one thread) until the counter reaches `expected` (see bounded_wait).
__device__ __forceinline__ bool wait_count(const uint32_t* counter, uint32_t expected,
                                           uint64_t timeout_ns, DeviceStatus* status, uint32_t op,
                                           int32_t peer, int32_t detail) {
  return bounded_wait([&] { return ld_acquire_sys_u32(counter) >= expected; }, timeout_ns,
                      status, op, peer, detail);
}

// The last block of a launch (by arrival) runs the call's epilogue. Every
// block must call this exactly once, after its stores (made visible system-wide
// by each thread's __threadfence_system() inside). Returns true in all threads
// of the last block, whose threads may then read everything the others wrote.
__device__ __forceinline__ bool arrive_is_last_block(uint32_t* done_counter) {
  __shared__ bool is_last;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint32_t arrived = atomicAdd(done_counter, 1u);
    is_last = arrived == gridDim.x - 1;
    if (is_last) *done_counter = 0u;  // ready for the next launch
  }
  __syncthreads();
  if (is_last) __threadfence_system();
  return is_last;
}

// Whether this thread runs the kernel's epilogue: thread 0 of the last block to
// arrive (arrive_is_last_block), or, with `block0_alone` (the epilogue reads
// nothing that other blocks wrote), thread 0 of block 0 with no arrival at
// all. Every thread must call it.
__device__ __forceinline__ bool runs_epilogue(uint32_t* done_counter, bool block0_alone) {
  if (block0_alone) return blockIdx.x == 0 && threadIdx.x == 0;
  return arrive_is_last_block(done_counter) && threadIdx.x == 0;
}

// Like arrive_is_last_block, for epilogues that only do device bookkeeping
// (sequence numbers, tickets) read by later kernels: no system-scope fences,
// one GPU-scope acquire-release atomic per block.
__device__ __forceinline__ bool arrive_is_last_block_gpu(uint32_t* done_counter) {
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    is_last = atom_add_acq_rel_gpu(done_counter, 1u) == gridDim.x - 1;
    if (is_last) *done_counter = 0u;  // ready for the next launch
  }
  __syncthreads();
  return is_last;
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_DEVICE_COMMON_CUH_
