// One warp's row copies through the bulk copy engine (TMA, sm_90):
// global -> shared (completing on an mbarrier), then shared -> global to one
// or more destinations (local or a peer's NVLink-mapped memory).
//
// Why: a warp that copies with 16-byte register loads and stores keeps only
// its registers' worth of bytes in flight (4 KB with 8 vectors per lane);
// the bulk copy keeps two shared-memory stages per warp in flight and issues
// each row piece as one request, so an SM pushes more bytes per round trip.
//
// PROTOCOL (per warp; lane 0 issues every bulk operation):
//   * two stages of kTmaPieceBytes in shared memory, each with an mbarrier
//     (arrival count 1) that lane 0 arms with the piece's byte count before
//     the load; the load completes the barrier's phase; `phase` holds the
//     parity each stage waits for next.
//   * a stage is reloaded only after the stores that read it are done
//     reading it (cp.async.bulk.wait_group.read); stores of one piece to all
//     destinations form one bulk group.
//   * tma_complete_all: every store issued so far has landed (its writes are
//     visible to lane 0) and is ordered before lane 0's later generic
//     operations (fence.proxy.async), so a following release (fence.acq_rel.sys,
//     red/st.release.sys) publishes them to peers.
#ifndef JAX_EP_CUDA_TMA_CUH_
#define JAX_EP_CUDA_TMA_CUH_

#include <cstdint>

namespace jax_ep::cuda {

constexpr uint32_t kTmaPieceBytes = 4096;
constexpr int kTmaStages = 2;

struct TmaPipe {
  uint32_t stage[kTmaStages];  // shared-memory addresses of the stages
  uint32_t bar[kTmaStages];    // shared-memory addresses of their mbarriers
  uint32_t phase;              // bit s: the parity stage s waits for next
  uint32_t next;               // stage of the next piece
};

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Lane 0 only. `stages` must hold kTmaStages * kTmaPieceBytes bytes, 16-byte
// aligned; `bars` kTmaStages 8-byte mbarriers.
__device__ __forceinline__ TmaPipe tma_pipe_init(char* stages, uint64_t* bars) {
  TmaPipe pipe;
  for (int s = 0; s < kTmaStages; ++s) {
    pipe.stage[s] = smem_addr(stages + s * kTmaPieceBytes);
    pipe.bar[s] = smem_addr(bars + s);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(pipe.bar[s]) : "memory");
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  pipe.phase = 0;
  pipe.next = 0;
  return pipe;
}

__device__ __forceinline__ void tma_load_piece(const TmaPipe& pipe, int s, const void* src,
                                               uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(pipe.bar[s]),
               "r"(bytes)
               : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          pipe.stage[s]),
      "l"(src), "r"(bytes), "r"(pipe.bar[s])
      : "memory");
}

__device__ __forceinline__ void tma_wait_piece(TmaPipe& pipe, int s) {
  const uint32_t parity = (pipe.phase >> s) & 1u;
  uint32_t done = 0;
  // A local copy engine transfer: it completes unless the GPU faults, which
  // ends the kernel anyway; no peer is involved, so no timeout here.
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(pipe.bar[s]), "r"(parity)
        : "memory");
  }
  pipe.phase ^= 1u << s;
}

__device__ __forceinline__ void tma_store_piece(const TmaPipe& pipe, int s, void* dst,
                                                uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(pipe.stage[s]), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Lane 0 only: copies `bytes` (a multiple of 16; src and every dst 16-byte
// aligned) from `src` to dst[0 .. num_dst). Returns once the last piece's
// stores are issued; they may still be in flight (see tma_complete_all).
__device__ __forceinline__ void tma_copy_row(TmaPipe& pipe, void* const* dst, int num_dst,
                                             const void* src, uint32_t bytes) {
  if (num_dst == 0 || bytes == 0) return;
  const uint32_t num_pieces = (bytes + kTmaPieceBytes - 1) / kTmaPieceBytes;
  // Both stages free: the stores of the previous row have read them.
  tma_wait_read<0>();
  tma_load_piece(pipe, pipe.next, src, bytes < kTmaPieceBytes ? bytes : kTmaPieceBytes);
  for (uint32_t p = 0; p < num_pieces; ++p) {
    const int s = pipe.next;
    const uint32_t offset = p * kTmaPieceBytes;
    const uint32_t piece = bytes - offset < kTmaPieceBytes ? bytes - offset : kTmaPieceBytes;
    if (p + 1 < num_pieces) {
      // The other stage was last read by piece p - 1's stores (the only group
      // still pending): wait for that read, then load piece p + 1 into it.
      tma_wait_read<0>();
      const uint32_t next_offset = offset + kTmaPieceBytes;
      const uint32_t next_piece =
          bytes - next_offset < kTmaPieceBytes ? bytes - next_offset : kTmaPieceBytes;
      tma_load_piece(pipe, s ^ 1, static_cast<const char*>(src) + next_offset, next_piece);
    }
    tma_wait_piece(pipe, s);
    for (int i = 0; i < num_dst; ++i) {
      tma_store_piece(pipe, s, static_cast<char*>(dst[i]) + offset, piece);
    }
    tma_commit();
    pipe.next = s ^ 1;
  }
}

// Lane 0 only: every store issued so far has landed and is ordered before
// lane 0's later generic memory operations (see PROTOCOL).
__device__ __forceinline__ void tma_complete_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_TMA_CUH_
