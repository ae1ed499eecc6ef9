// The device-side transport: the one place where the NVLink and RDMA paths
// differ, and where EP ranks become NVSHMEM PEs.
//
// Kernels address every remote object by its *local* symmetric address plus an
// EP rank. `peer_ptr` says whether loads/stores reach the rank's PE (NVLink/PCIe
// P2P, or the PE itself): then the kernel stores directly and publishes completion
// with a st.release.sys flag. Otherwise the data goes by RDMA:
//   * NVSHMEM >= 3.5.19 (public QP API): one queue pair per destination local
//     expert; data puts and then the completion flag as a signal op on the
//     *same* QP. InfiniBand executes an atomic only after the earlier writes on
//     its QP (IBA spec, o9-20), so the flag cannot overtake the data, adaptive
//     routing included, and experts never wait on each other's traffic.
//   * older NVSHMEM: default QP; each block completes its puts with
//     nvshmem_quiet() before the flag is signalled.
// RDMA sources must be symmetric memory: kernels stage rows into a local
// symmetric buffer first.
#ifndef JAX_EP_CUDA_TRANSPORT_CUH_
#define JAX_EP_CUDA_TRANSPORT_CUH_

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "cuda/device_common.cuh"

#if defined(NVSHMEM_VENDOR_MAJOR_VERSION) &&                                     \
    (NVSHMEM_VENDOR_MAJOR_VERSION * 10000 + NVSHMEM_VENDOR_MINOR_VERSION * 100 + \
     NVSHMEM_VENDOR_PATCH_VERSION) >= 30519
#define JAX_EP_HAVE_QP_API 1
#else
#define JAX_EP_HAVE_QP_API 0
#endif

namespace jax_ep::cuda::transport {

// Kernels address peers by EP RANK (0 .. R-1 within this process's EP group);
// NVSHMEM addresses them by PE (0 .. npes-1 over every process). One table,
// set once per allocation (Runtime::Allocate from the mesh), maps one to the
// other: group_pes[r] is the PE of EP rank r. A process belongs to exactly one
// group, so the table is per process. The rank-level functions below are the
// kernels' interface; the *_pe ones serve the host's world-wide barrier.
// Defined in runtime.cu.
constexpr int kMaxGroupRanks = 1024;
extern __constant__ int32_t group_pes[kMaxGroupRanks];

// Testing only: bit pe set = treat PE pe as reachable only by RDMA even where
// nvshmem_ptr maps it, so that the RDMA branch runs over NVSHMEM's own P2P
// implementation on a machine without a NIC (JAX_EP_TESTING_RDMA_PEERS,
// jax_ep/cuda_runtime.py; Runtime::SetRdmaOnlyPeers). All zero in normal use;
// never set for the PE itself. Defined in runtime.cu.
constexpr int kRdmaOnlyPeerWords = 32;  // 1024 PEs
extern __constant__ uint32_t rdma_only_peers[kRdmaOnlyPeerWords];

__device__ __forceinline__ int pe_of(int rank) { return group_pes[rank & (kMaxGroupRanks - 1)]; }

// Pointer through which this thread can load/store PE `pe`'s copy of the
// symmetric object at local address `local`; null when only RDMA reaches it.
__device__ __forceinline__ void* pe_ptr(const void* local, int pe) {
  if ((rdma_only_peers[(pe >> 5) & (kRdmaOnlyPeerWords - 1)] >> (pe & 31)) & 1u) return nullptr;
  return nvshmem_ptr(local, pe);
}

// The same for EP rank `rank` of this group.
__device__ __forceinline__ void* peer_ptr(const void* local, int rank) {
  return pe_ptr(local, pe_of(rank));
}

// Warp-collective RDMA put of `bytes` from local symmetric `src` into EP rank
// `rank`'s copy of `dst`, on the queue pair of destination local expert `qp`.
__device__ __forceinline__ void put_warp(void* dst, const void* src, size_t bytes, int rank,
                                         const int* qp_handles, int qp) {
  const int pe = pe_of(rank);
#if JAX_EP_HAVE_QP_API
  if (qp_handles != nullptr) {
    nvshmemx_qp_uint8_put_nbi_warp(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src),
                                   bytes, pe, qp_handles[qp]);
    return;
  }
#endif
  (void)qp_handles;
  (void)qp;
  nvshmemx_putmem_nbi_warp(dst, src, bytes, pe);
}

// Sets PE pe's copy of `flag` to `value` after this QP's earlier puts (see above).
__device__ __forceinline__ void signal_set_pe(uint64_t* flag, uint64_t value, int pe,
                                              const int* qp_handles, int qp) {
#if JAX_EP_HAVE_QP_API
  if (qp_handles != nullptr) {
    nvshmemx_qp_signal_op(flag, value, NVSHMEM_SIGNAL_SET, pe, qp_handles[qp]);
    return;
  }
#endif
  (void)qp_handles;
  (void)qp;
  nvshmemx_signal_op(flag, value, NVSHMEM_SIGNAL_SET, pe);
}

// Sets PE pe's copy of the flag at local symmetric address `flag`: a
// st.release.sys through the peer mapping for load/store peers (after the
// caller's system-scope fence), else the RDMA signal above.
__device__ __forceinline__ void set_flag_pe(uint64_t* flag, uint64_t value, int pe,
                                            const int* qp_handles, int qp) {
  auto* mapped = static_cast<uint64_t*>(pe_ptr(flag, pe));
  if (mapped != nullptr) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(mapped), "l"(value) : "memory");
  } else {
    signal_set_pe(flag, value, pe, qp_handles, qp);
  }
}

// The same for EP rank `rank` of this group.
__device__ __forceinline__ void set_flag(uint64_t* flag, uint64_t value, int rank,
                                         const int* qp_handles, int qp) {
  set_flag_pe(flag, value, pe_of(rank), qp_handles, qp);
}

// Whether puts must be completed (quiet) before their flag is signalled.
__device__ __forceinline__ bool needs_quiet(const int* qp_handles) {
  return !JAX_EP_HAVE_QP_API || qp_handles == nullptr;
}

// Block-collective: completes this block's RDMA puts when the path needs it.
// `used_rdma` must be uniform across the block. After a fault the call's
// results are void and a peer may be gone: the quiet (unbounded: it waits for
// the transport) is skipped.
__device__ __forceinline__ void complete_block_puts(bool used_rdma, const int* qp_handles,
                                                    const DeviceStatus* status) {
  if (!used_rdma || !needs_quiet(qp_handles)) return;
  __syncthreads();
  if (threadIdx.x == 0 && !fault_recorded(status)) nvshmem_quiet();
  __syncthreads();
}

}  // namespace jax_ep::cuda::transport

#endif  // JAX_EP_CUDA_TRANSPORT_CUH_
