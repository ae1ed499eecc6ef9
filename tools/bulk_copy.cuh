// The bulk copy engine's primitives (cp.async.bulk, sm_90) that the copy probes
// (tools/copy_bandwidth.cu, tools/sm_bandwidth.cu) build their rings of
// shared-memory stages from. Protocol of one stage: the issuing thread arms
// the stage's mbarrier with the bytes it expects and starts the load
// (bulk_load_row); the engine completes the barrier's phase when they landed;
// the thread waits for that phase by its parity (wait_stage), then stores the
// stage (bulk_store_row) and, before refilling it, waits until the store has
// read it (cp.async.bulk.wait_group.read). Not part of the library.
#pragma once

#include <cstdint>

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread: `count` barriers, one arrival each, visible to the engine.
__device__ __forceinline__ void init_stage_barriers(uint64_t* bars, int count) {
  for (int s = 0; s < count; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Loads `bytes` (a multiple of 16) of global `src` into `stage`; `bar` completes.
__device__ __forceinline__ void bulk_load_row(void* stage, const void* src, uint32_t bytes,
                                              uint64_t* bar) {
  const uint32_t bar_addr = smem_addr(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(stage)),
      "l"(src), "r"(bytes), "r"(bar_addr)
      : "memory");
}

// Waits (bounded: about 2 s, after which a stuck ring fails the probe's check)
// for the phase of `bar` with this parity.
__device__ __forceinline__ void wait_stage(uint64_t* bar, uint32_t parity) {
  const uint32_t bar_addr = smem_addr(bar);
  uint32_t done = 0;
  const long long give_up = clock64() + (1ll << 32);
  while (!done && clock64() < give_up) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar_addr), "r"(parity)
        : "memory");
  }
}

// Stores `bytes` of `stage` to global `dst`, as one committed bulk group.
__device__ __forceinline__ void bulk_store_row(void* dst, const void* stage, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_addr(stage)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Engine `warp` of this block (lane 0 of each warp is one engine) takes rows
// engine, engine + E*grid, ...: `count` of them, the i-th at row(i).
struct EngineRows {
  int engine;
  int num_engines;
  int count;
  __device__ int row(int i) const { return engine + i * num_engines; }
};

__device__ __forceinline__ EngineRows engine_rows(int engines_per_block, int warp, int num_rows) {
  const int engine = blockIdx.x * engines_per_block + warp;
  const int num_engines = gridDim.x * engines_per_block;
  return {engine, num_engines, engine < num_rows ? (num_rows - 1 - engine) / num_engines + 1 : 0};
}
