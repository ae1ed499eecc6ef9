// The process-wide CUDA runtime of jax_ep: NVSHMEM bootstrap (compiled into
// this extension so its device state is registered), the symmetric buffers,
// device counters and the host-mapped fault word. Plain C++ interface; the
// implementation (runtime.cu) is the only host code that includes NVSHMEM.
//
// Lifecycle (driven from jax_ep/cuda_runtime.py, outside any jit):
//   GetUniqueId (EP rank 0) -> Init (every rank) -> ProbePeers ->
//   Allocate(config) [-> ReleaseBuffers -> Allocate(other config)] -> Finalize.
// Init/Allocate/ReleaseBuffers/Finalize are collective over the EP group.
#ifndef JAX_EP_CUDA_RUNTIME_H_
#define JAX_EP_CUDA_RUNTIME_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/ep_types.h"
#include "cuda/ht_types.h"

namespace jax_ep::cuda {

// Byte offsets of every buffer in the one symmetric allocation.
struct BufferLayout {
  size_t total = 0;
  // LL (0 when disabled)
  size_t ll_dispatch_recv[2] = {0, 0};
  size_t ll_dispatch_tokens[2] = {0, 0};
  size_t ll_dispatch_flags[2] = {0, 0};
  size_t ll_combine_recv[2] = {0, 0};
  size_t ll_combine_values[2] = {0, 0};
  size_t ll_combine_flags[2] = {0, 0};
  size_t ll_dispatch_stage = 0;
  size_t ll_dispatch_header_stage = 0;
  size_t ll_combine_stage = 0;
  size_t ll_combine_values_stage = 0;
  size_t ll_message_bytes = 0;
  // HT (0 when disabled)
  size_t ht_counts = 0;
  size_t ht_notify_flags = 0;
  size_t ht_recv_x = 0;
  size_t ht_recv_scales = 0;
  size_t ht_recv_src = 0;
  size_t ht_recv_idx = 0;
  size_t ht_recv_w = 0;
  size_t ht_chunk_arrived = 0;
  size_t ht_combine_recv[2] = {0, 0};
  size_t ht_combine_flags[2] = {0, 0};
  size_t ht_row_bytes = 0;
  size_t ht_expert_counts = 0;
  size_t ht_recv_pair_rank = 0;
  size_t ht_plan_block_counts = 0;
  size_t ht_plan_pair_rank = 0;
  size_t ht_plan_expert_totals = 0;
  size_t ht_plan_block_before = 0;  // one rank only
  size_t ht_plan_token_slot = 0;    // one rank only
};

// The layout for `dims`; the formula behind jax_ep.buffer_bytes().
BufferLayout ComputeLayout(const EpDims& dims, bool low_latency, bool high_throughput,
                           bool rdma_staging);

struct NvshmemVersion {
  int major = 0, minor = 0, patch = 0;
};

// One Runtime object per initialise-finalise span of the process: Start
// (jax_ep.initialize) creates it, Stop (jax_ep.finalize) tears NVSHMEM down and
// destroys it, so the next span starts from a new object, never from a reset
// one. Current() is how the FFI handlers and the module reach it.
class Runtime {
 public:
  // The runtime between Start and Stop, or nullptr.
  static Runtime* Current();
  // Creates the runtime if there is none and runs Init on it (idempotent, as
  // Init is). Refused for good after a teardown that could not run (Stop).
  static std::string Start(int pe, int npes, const std::string& uid, int device);
  // Finalize, then destroys the runtime. When the collective teardown was
  // skipped (a peer did not arrive: it died), the runtime is set aside, never
  // destroyed (NVSHMEM stays up until the process exits), and returns why.
  static std::string Stop();

  // Version of the NVSHMEM host library in this process / of the headers and
  // device library this extension was built with.
  static NvshmemVersion LoadedVersion();
  static NvshmemVersion CompiledVersion();
  static bool HasQpApi();
  // Whether NVSHMEM is up in this process already (another library started it).
  static bool NvshmemAlreadyInitialized();
  // This process's PE, or -1 before Init.
  int MyPe() const;

  // 128-byte NVSHMEM unique id (EP rank 0 creates it, before Start). Returns "" or an error.
  static std::string GetUniqueId(std::string* uid);
  // Whether Init joined an NVSHMEM runtime another library had started (it is
  // then that library's to finalise).
  bool joined() const { return joined_; }
  // P2P (load/store) reachability of every PE from this one (PEs set by
  // SetRdmaOnlyPeers count as unreachable).
  std::vector<bool> ProbePeers() const;
  // Testing only: the kernels treat these PEs as reachable only by RDMA
  // (transport.cuh rdma_only_peers). Call after Init, before Allocate.
  std::string SetRdmaOnlyPeers(const std::vector<int>& pes);
  // (Re)allocates the symmetric buffers for `dims` (num_ranks and rank: the EP
  // group's size and this process's EP rank in it); group_pes[r] is the PE of
  // EP rank r (transport.cuh). Collective over every PE. With several configs,
  // `dims` is their element-wise maximum and dims() below stays that: the FFI
  // handlers hand each kernel its own call's dims, checked to fit these
  // (xla_ffi/cuda/handler_common.h CallDims).
  std::string Allocate(const EpDims& dims, const std::vector<int>& group_pes, bool low_latency,
                       bool high_throughput, bool rdma_staging, double timeout_s, int num_sms);
  // Frees the symmetric buffers (collective); the transport stays up.
  std::string ReleaseBuffers();

  bool initialized() const { return initialized_; }
  bool allocated() const { return base_ != nullptr; }
  bool low_latency() const { return low_latency_; }
  bool high_throughput() const { return high_throughput_; }
  const EpDims& dims() const { return dims_; }
  const LlContext& ll_context() const { return ll_; }
  const HtContext& ht_context() const { return ht_; }
  const BufferLayout& layout() const { return layout_; }
  int device() const { return device_; }
  // Snapshot of the fault word (host-mapped: no stream sync).
  DeviceStatus status() const;
  // Clears the fault word (after the host reported it).
  void ClearStatus();
  // Reads and resets the in-kernel profile (JAX_EP_PROFILE=1); synchronises.
  std::string ReadProfile(DeviceProfile* out);
  // The LL rank mask (LlContext::masked): sets exactly `ranks` (synchronous
  // copy; takes effect for the calls launched afterwards), reads the mirror.
  std::string SetMasked(const std::vector<int>& ranks);
  std::vector<int> Masked() const;
  // Whether an LL wait that times out masks its peer instead of recording a fault.
  void SetMaskOnTimeout(bool on);

 private:
  Runtime() = default;
  // Bootstraps NVSHMEM with PE = pe of npes (every process of the job: one PE
  // each) on CUDA device `device`, and registers this extension's device
  // state. Idempotent. When another library of the process started NVSHMEM
  // already, joins it instead (pe, npes and uid are then not used; see joined()).
  std::string Init(int pe, int npes, const std::string& uid, int device);
  // Frees everything and finalises NVSHMEM (collective). When a peer does not
  // arrive within the timeout (it died), NVSHMEM's collectives are skipped and
  // the runtime is left for the process to exit: returns why (else "").
  std::string Finalize();
  // The bounded barrier (host_barrier.cu) before each collective host step;
  // "" when every PE arrived, else why (and the runtime is abandoned).
  std::string BoundedBarrier(const char* step);

  bool initialized_ = false;
  bool joined_ = false;
  int device_ = -1;
  int num_sms_ = 0;
  char* base_ = nullptr;
  char* probe_ = nullptr;
  EpDims dims_{};
  bool low_latency_ = false;
  bool high_throughput_ = false;
  BufferLayout layout_{};
  LlContext ll_{};
  HtContext ht_{};
  DeviceStatus* status_host_ = nullptr;
  DeviceStatus* status_device_ = nullptr;
  DeviceCounters* counters_ = nullptr;
  int32_t* slot_counters_ = nullptr;
  int* qp_handles_ = nullptr;
  DeviceProfile* profile_ = nullptr;
  uint32_t* masked_device_ = nullptr;         // [kMaxMaskedRanks] device memory
  uint32_t* masked_host_ = nullptr;           // [kMaxMaskedRanks] host-mapped mirror
  uint32_t* masked_host_on_device_ = nullptr; // the mirror's device address
  bool mask_on_timeout_ = false;
  std::vector<int> rdma_only_peers_;
  cudaStream_t barrier_stream_ = nullptr;
  int32_t* barrier_result_ = nullptr;
  uint32_t barrier_seq_ = 0;
  uint64_t host_timeout_ns_ = 60ull * 1000 * 1000 * 1000;
  std::string abandoned_why_;  // set when a bounded barrier failed
};

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_RUNTIME_H_
