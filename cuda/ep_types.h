// Plain structs shared by the host runtime, the FFI glue (host compiler) and
// the kernels (nvcc). No CUDA, NVSHMEM or XLA headers here.
#ifndef JAX_EP_CUDA_EP_TYPES_H_
#define JAX_EP_CUDA_EP_TYPES_H_

#include <cstddef>
#include <cstdint>

namespace jax_ep::cuda {

// Fault codes of DeviceStatus::code.
constexpr uint32_t kStatusOk = 0;
constexpr uint32_t kStatusTimeout = 1;
constexpr uint32_t kStatusProtocol = 2;  // an LL send issued while another awaits its recv

// Ops named in DeviceStatus::op.
enum OpCode : uint32_t {
  kOpNone = 0,
  kOpLlDispatch = 1,
  kOpLlCombine = 2,
  kOpHtNotify = 3,
  kOpHtDispatch = 4,
  kOpHtCombine = 5,
};

// The process's fault word, in host-mapped pinned memory: kernels write it on
// a timeout, the host reads it without synchronising the stream.
struct DeviceStatus {
  uint32_t code;         // kStatus*; the first fault wins
  uint32_t op;           // OpCode of the faulting op
  int32_t peer;          // EP rank the op was waiting for
  int32_t detail;        // op-specific (e.g. local expert)
  uint32_t fault_count;  // faults recorded (only the first is described)
  uint32_t reserved[3];
};

// Most blocks of one HT dispatch at one rank (its grid is EpGroup.num_sms).
constexpr int kMaxHtBlocks = 1024;

// Call sequence numbers, send/recv pairing state and the per-launch arrival
// counters, in device memory. A send advances its sequence number (identically
// on every rank: all ranks run the same calls in the same order) and hands it
// to its recv as a *ticket* (a device value, never the host's), so pairing
// follows data dependencies, not the order XLA happens to schedule calls in.
struct DeviceCounters {
  uint32_t ll_dispatch_seq;         // last LL dispatch send's sequence number
  uint32_t ll_combine_seq;          // last LL combine send's sequence number
  uint32_t ht_dispatch_seq;
  uint32_t ht_combine_seq;
  uint32_t ll_dispatch_outstanding; // 1 between an LL dispatch send and its recv
  uint32_t ll_combine_outstanding;  // 1 between an LL combine send and its recv
  uint32_t ll_dispatch_send_done;   // arrival counters of "last block" epilogues
  uint32_t ll_dispatch_recv_done;
  uint32_t ll_combine_send_done;
  uint32_t ll_combine_recv_done;
  uint32_t ht_dispatch_done;
  uint32_t ht_combine_send_done;
  uint32_t ht_combine_recv_done;
  uint32_t ht_recv_ticket;          // HT dispatch: next chunk to copy out (reset by the last block)
  uint32_t ll_dispatch_lost;        // 1: a wait of this LL dispatch receive lost rows (reset by
                                    // its last block)
  uint32_t reserved[1];
  // One-rank expert-major HT dispatch (ht_dispatch.cu): (seq, the next work
  // item: tokens, then padding rows), set to (seq, 0) by block 0 before its
  // ht_block_rows word, then taken by every warp (atomicAdd); never reset.
  uint64_t ht_work_next;
  // One-rank HT dispatch: block b's (seq, rows of its token range), written once
  // per dispatch by block b, read by every block of the same kernel
  // (ht_dispatch.cu single_rank_plan); never reset.
  uint64_t ht_block_rows[kMaxHtBlocks];
  // One-rank expert-major HT dispatch: (seq, 0) from block b once its row of
  // plan_block_before is written (st.release.gpu), read by every warp that
  // takes a token of b's range; never reset.
  uint64_t ht_range_ready[kMaxHtBlocks];
};

// In-kernel profile (JAX_EP_PROFILE=1 at initialisation), from %globaltimer,
// accumulated over calls: block 0 stamps the start, the last block adds the
// duration. Slots 0-3:
// the LL kernels (ll_dispatch_send, ll_dispatch_recv, ll_combine_send,
// ll_combine_recv); 4-8: the HT ones (ht_dispatch's count exchange, its send
// role, its receive role, ht_combine_send, ht_combine_recv).
constexpr int kProfileSlots = 9;
constexpr int kHtTraceCalls = 64;
enum HtTraceEvent {
  kTraceStart,      // ht_dispatch's block 0 starts
  kTraceMasks,      // block 0 has every token's rank mask
  kTraceScan,       // ... and this rank's rows per destination
  kTracePlanBuilt,  // block 0 has every token's rank mask and row bases
  kTraceCounts,     // block 0 has every source's counts (the count exchange)
  kTraceSendEnd,    // the last sender block is done
  kTraceRecvEnd,    // the last receiver block is done
  kTraceEnd,        // the last block of ht_dispatch arrives
  kHtTraceEvents
};
struct DeviceProfile {
  uint64_t start[kProfileSlots];
  uint64_t end[kProfileSlots];
  uint64_t total_ns[kProfileSlots];  // sum of (end - start)
  uint64_t wait_ns[kProfileSlots];   // time until the peers' data had arrived (see blocks)
  uint64_t gap_ns[kProfileSlots];    // LL recv kernels: start - the matching send's end
  uint64_t calls[kProfileSlots];
  uint64_t role_end[kProfileSlots];  // HT: latest end of the role's blocks in this call
  uint64_t blocks[kProfileSlots];    // HT: blocks that added to wait_ns (0: one per call)
  // HT dispatch timeline of the last kHtTraceCalls calls, row seq % kHtTraceCalls:
  // %globaltimer at each HtTraceEvent (the host takes medians of the steps:
  // averages would count the skew between two processes' executions).
  uint64_t ht_trace[kHtTraceCalls][kHtTraceEvents];
};

// Sizes of one configuration on this EP group.
struct EpDims {
  int32_t num_ranks;        // R
  int32_t rank;             // this process's EP rank (= NVSHMEM PE)
  int32_t num_experts;      // E
  int32_t experts_per_rank; // E_local
  int32_t hidden;           // H
  int32_t max_tokens;       // T (per rank): the high-throughput ops
  int32_t ll_max_tokens;    // T_ll (per rank): the low-latency ops
  int32_t num_topk;         // K
};

// Bytes of one LL dispatch message: a 16-byte header (source token index),
// then the payload: H bf16, or H fp8 followed by H/128 float32 scales.
inline size_t LlMessageBytes(int hidden) {
  size_t bf16 = 2 * static_cast<size_t>(hidden);
  size_t fp8 = static_cast<size_t>(hidden) + 4 * static_cast<size_t>(hidden / 128);
  size_t payload = bf16 > fp8 ? bf16 : fp8;
  return (16 + payload + 15) / 16 * 16;
}

// Symmetric LL buffers (local addresses; peers' copies via nvshmem_ptr / RDMA),
// each double-buffered by call parity; T here is T_ll (EpDims::ll_max_tokens).
//   dispatch_recv[p]   [E_local][R][T] messages, filled by the source ranks
//                      (NVLink sources write only the 16-byte headers here)
//   dispatch_tokens[p] [R][T] messages: an NVLink source's payload of token t,
//                      once per destination rank, shared by its experts there
//   dispatch_flags[p]  [E_local][R] flags: (seq, rows from that source)
//   combine_recv[p]    [E][T] bf16 rows: expert e's output for local token t
//   combine_values[p]  [E][T] float: expert e's value for local token t (the
//                      combine's per-pair values, e.g. gradients of the weights)
//   combine_flags[p]   [E] flags: (seq, 0) once expert e's owner sent its rows
//   dispatch_stage     [T] messages, RDMA source staging (null when all peers are P2P)
//   dispatch_header_stage [T][K] 16-byte headers, RDMA staging of the pairs' own
//                      headers when they carry weights (or null)
//   combine_stage      [E_local][R*T] bf16 rows, RDMA source staging (or null)
//   combine_values_stage [E_local][R*T] float, RDMA source staging (or null)
struct LlBuffers {
  char* dispatch_recv[2];
  char* dispatch_tokens[2];
  uint64_t* dispatch_flags[2];
  char* combine_recv[2];
  float* combine_values[2];
  uint64_t* combine_flags[2];
  char* dispatch_stage;
  char* dispatch_header_stage;
  char* combine_stage;
  float* combine_values_stage;
  size_t message_bytes;
};

// Everything a kernel needs from the runtime besides its XLA buffers.
struct LlContext {
  EpDims dims;
  LlBuffers buffers;
  DeviceCounters* counters;     // device memory
  DeviceStatus* status;         // host-mapped
  int32_t* slot_counters;       // [E] device memory, zero between calls
  uint32_t* rank_counters;      // [R] device memory, zero between calls (pre-summed combine)
  const int* qp_handles;        // [E_local] device memory (RDMA QP per local expert) or null
  DeviceProfile* profile;       // device memory, or null (profiling off)
  // LL rank mask, [kMaxMaskedRanks], 1 = masked: skipped by the LL kernels.
  // Device copy (read by the kernels) and host-mapped mirror (read by the
  // host); the host sets both between calls, a kernel sets both when it masks
  // a peer on a timeout (mask_on_timeout).
  uint32_t* masked;
  uint32_t* masked_mirror;
  bool mask_on_timeout;
  uint64_t timeout_ns;
  int num_sms;
};

// Ranks the LL rank mask covers (the LL kernels' rank limit).
constexpr int kMaxMaskedRanks = 1024;

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_EP_TYPES_H_
