// NVSHMEM bootstrap and symmetric buffers (see runtime.h for the lifecycle).
//
// This file is compiled into the CUDA extension with -rdc and device-linked
// against libnvshmem_device.a, so NVSHMEM's per-module device state lives in
// the extension; Init() registers it (nvshmemi_init_thread with this module's
// version, exactly what nvshmemx_init_attr does minus its exit(-1) on error).
#include "cuda/runtime.h"

#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/host_barrier.h"
#include "cuda/ht_launch.h"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"

namespace jax_ep::cuda {

namespace transport {
__constant__ int32_t group_pes[kMaxGroupRanks] = {};
__constant__ uint32_t rdma_only_peers[kRdmaOnlyPeerWords] = {};
}  // namespace transport

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kFreeMemoryMargin = size_t{512} << 20;
constexpr int kHtDefaultSms = 24;

size_t AlignUp(size_t value, size_t alignment = kAlign) {
  return (value + alignment - 1) / alignment * alignment;
}

std::string CudaError(const char* what, cudaError_t err) {
  return std::string("jax_ep CUDA runtime: ") + what + " failed: " + cudaGetErrorString(err);
}

// The LL kernels' arrival counters, device memory, zero between calls: [E]
// for the dispatch (LlContext::slot_counters), then [R] for the pre-summed
// combine (LlContext::rank_counters).
size_t SlotCounterBytes(const EpDims& dims) {
  return sizeof(int32_t) * (std::max(dims.num_experts, 1) + std::max(dims.num_ranks, 1));
}

std::string GiB(size_t bytes) {
  char text[32];
  snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return text;
}

}  // namespace

BufferLayout ComputeLayout(const EpDims& d, bool low_latency, bool high_throughput,
                           bool rdma_staging) {
  BufferLayout layout;
  size_t offset = 0;
  auto take = [&offset](size_t bytes) {
    const size_t at = offset;
    offset = AlignUp(offset + bytes);
    return at;
  };
  const size_t R = d.num_ranks, T = d.max_tokens, H = d.hidden, K = d.num_topk;
  const size_t E = d.num_experts, E_local = d.experts_per_rank;
  if (low_latency) {
    const size_t T_ll = d.ll_max_tokens;
    layout.ll_message_bytes = LlMessageBytes(d.hidden);
    for (int p = 0; p < 2; ++p) {
      layout.ll_dispatch_recv[p] = take(E_local * R * T_ll * layout.ll_message_bytes);
      layout.ll_dispatch_tokens[p] = take(R * T_ll * layout.ll_message_bytes);
      layout.ll_dispatch_flags[p] = take(E_local * R * sizeof(uint64_t));
      layout.ll_combine_recv[p] = take(E * T_ll * 2 * H);
      layout.ll_combine_values[p] = take(E * T_ll * sizeof(float));
      layout.ll_combine_flags[p] = take(E * sizeof(uint64_t));
    }
    if (rdma_staging) {
      layout.ll_dispatch_stage = take(T_ll * layout.ll_message_bytes);
      layout.ll_dispatch_header_stage = take(T_ll * K * 16);
      layout.ll_combine_stage = take(E_local * R * T_ll * 2 * H);
      layout.ll_combine_values_stage = take(E_local * R * T_ll * sizeof(float));
    }
  }
  if (high_throughput) {
    const size_t fp8_row = H + 4 * (H / 128);
    layout.ht_row_bytes = AlignUp(std::max(2 * H, fp8_row), 16);
    layout.ht_counts = take(2 * R * R * sizeof(int32_t));        // by seq parity
    layout.ht_notify_flags = take(2 * R * sizeof(uint64_t));
    layout.ht_recv_x = take(R * T * layout.ht_row_bytes);
    layout.ht_recv_scales = take(R * T * (H / 128) * sizeof(float));
    layout.ht_recv_src = take(R * T * sizeof(int32_t));
    layout.ht_recv_idx = take(R * T * K * sizeof(int32_t));
    layout.ht_recv_w = take(R * T * K * sizeof(float));
    layout.ht_chunk_arrived = take(R * ((T + kHtChunkRows - 1) / kHtChunkRows) * sizeof(uint32_t));
    for (int p = 0; p < 2; ++p) {
      layout.ht_combine_recv[p] = take(R * T * 2 * H);
      layout.ht_combine_flags[p] = take(R * sizeof(uint64_t));
    }
    layout.ht_expert_counts = take(2 * R * E_local * sizeof(int32_t));  // by seq parity
    layout.ht_recv_pair_rank = take(R * T * K * sizeof(int32_t));
    layout.ht_plan_block_counts = take(HtPlanBlockRows(d.num_ranks) * E * sizeof(int32_t));
    layout.ht_plan_pair_rank = take(T * K * sizeof(int32_t));
    layout.ht_plan_expert_totals = take(E * sizeof(int32_t));
    if (d.num_ranks == 1) {  // the one-rank expert-major dispatch's work taking
      layout.ht_plan_block_before = take(kHtOneRankPlanBlocks * E * sizeof(int32_t));
      layout.ht_plan_token_slot = take(T * sizeof(int32_t));
    }
  }
  layout.total = offset;
  return layout;
}

namespace {
// The runtime between Start and Stop (owned: Stop deletes it), and one whose
// collective teardown could not run (a peer died): that one is never freed,
// because its symmetric memory and NVSHMEM itself stay up until the process exits.
Runtime* current_runtime = nullptr;
Runtime* abandoned_runtime = nullptr;
std::string abandoned_why;
}  // namespace

Runtime* Runtime::Current() { return current_runtime; }

std::string Runtime::Start(int pe, int npes, const std::string& uid, int device) {
  if (abandoned_runtime != nullptr) {
    return "jax_ep: this process left NVSHMEM up after a failed teardown (" + abandoned_why +
           "); start a new process to use jax_ep again";
  }
  // A failed Init leaves the runtime current and not initialised, as it found
  // it: the next Start runs Init on it again.
  if (current_runtime == nullptr) current_runtime = new Runtime();
  return current_runtime->Init(pe, npes, uid, device);
}

std::string Runtime::Stop() {
  if (current_runtime == nullptr) return "";
  const std::string why = current_runtime->Finalize();
  if (!why.empty()) {
    abandoned_why = current_runtime->abandoned_why_.empty() ? why : current_runtime->abandoned_why_;
    abandoned_runtime = current_runtime;
  } else {
    delete current_runtime;  // Finalize freed every resource it holds
  }
  current_runtime = nullptr;
  return why;
}

NvshmemVersion Runtime::LoadedVersion() {
  NvshmemVersion v;
  nvshmemx_vendor_get_version_info(&v.major, &v.minor, &v.patch);
  return v;
}

NvshmemVersion Runtime::CompiledVersion() {
  return {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION, NVSHMEM_VENDOR_PATCH_VERSION};
}

bool Runtime::HasQpApi() { return JAX_EP_HAVE_QP_API != 0; }

bool Runtime::NvshmemAlreadyInitialized() {
  return nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED;
}

int Runtime::MyPe() const { return initialized_ ? nvshmem_my_pe() : -1; }

std::string Runtime::GetUniqueId(std::string* uid) {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (nvshmemx_get_uniqueid(&id) != 0) return "jax_ep: nvshmemx_get_uniqueid failed";
  uid->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return "";
}

std::string Runtime::Init(int pe, int npes, const std::string& uid, int device) {
  if (!abandoned_why_.empty()) {  // a bounded barrier failed (ReleaseBuffers)
    return "jax_ep: this process left NVSHMEM up after a failed teardown (" + abandoned_why_ +
           "); start a new process to use jax_ep again";
  }
  if (initialized_) {
    if (device != device_ || nvshmem_my_pe() != pe || nvshmem_n_pes() != npes) {
      return "jax_ep: NVSHMEM is already initialised with another PE/size/device in this process";
    }
    return "";
  }
  const NvshmemVersion loaded = LoadedVersion(), compiled = CompiledVersion();
  if (loaded.major != compiled.major ||
      loaded.minor * 1000 + loaded.patch < compiled.minor * 1000 + compiled.patch) {
    return "jax_ep: the NVSHMEM host library in this process is " + std::to_string(loaded.major) +
           "." + std::to_string(loaded.minor) + "." + std::to_string(loaded.patch) +
           " but jax_ep was built with " + std::to_string(compiled.major) + "." +
           std::to_string(compiled.minor) + "." + std::to_string(compiled.patch) +
           "; install that nvidia-nvshmem-cu13 version (or newer, same major) or rebuild jax_ep";
  }
  // Another library of this process (nvshmem4py, for one) may have started
  // NVSHMEM already: then jax_ep joins it (pe/npes are NVSHMEM's; the caller
  // passes -1) and the init call below only registers this module's device state.
  joined_ = nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED;
  if (!joined_ && uid.size() != sizeof(nvshmemx_uniqueid_t)) {
    return "jax_ep: NVSHMEM unique id has " + std::to_string(uid.size()) + " bytes, expected " +
           std::to_string(sizeof(nvshmemx_uniqueid_t));
  }
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return CudaError("cudaSetDevice", err);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (!joined_) {
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, uid.data(), sizeof(id));
    if (nvshmemx_set_attr_uniqueid_args(pe, npes, &id, &attr) != 0) {
      return "jax_ep: nvshmemx_set_attr_uniqueid_args failed";
    }
  }
  // What nvshmemx_init_attr() does, returning the status instead of exiting.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  nvshmemx_init_init_attr_ver_only(attr);
  const int status = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided,
                                          joined_ ? 0u : NVSHMEMX_INIT_WITH_UNIQUEID, &attr,
                                          version);
  if (status != 0) {
    return "jax_ep: NVSHMEM initialisation failed (status " + std::to_string(status) +
           "); rerun with NVSHMEM_DEBUG=INFO for details";
  }
  if (!joined_ && (nvshmem_my_pe() != pe || nvshmem_n_pes() != npes)) {
    return "jax_ep: NVSHMEM PE " + std::to_string(nvshmem_my_pe()) + " of " +
           std::to_string(nvshmem_n_pes()) + " does not match the process's PE " +
           std::to_string(pe) + " of " + std::to_string(npes);
  }
  // From here on pe and npes are the running job's (a joining caller passes -1 for both).
  pe = nvshmem_my_pe();
  npes = nvshmem_n_pes();
  device_ = device;
  err = cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return CudaError("cudaDeviceGetAttribute", err);
  err = cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(DeviceStatus),
                      cudaHostAllocMapped);
  if (err != cudaSuccess) return CudaError("cudaHostAlloc (status word)", err);
  std::memset(status_host_, 0, sizeof(DeviceStatus));
  err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_host_, 0);
  if (err != cudaSuccess) return CudaError("cudaHostGetDevicePointer", err);
  err = cudaMalloc(reinterpret_cast<void**>(&counters_), sizeof(DeviceCounters));
  if (err == cudaSuccess) err = cudaMemset(counters_, 0, sizeof(DeviceCounters));
  if (err != cudaSuccess) return CudaError("cudaMalloc (counters)", err);
  err = cudaMalloc(reinterpret_cast<void**>(&masked_device_), sizeof(uint32_t) * kMaxMaskedRanks);
  if (err == cudaSuccess) {
    err = cudaMemset(masked_device_, 0, sizeof(uint32_t) * kMaxMaskedRanks);
  }
  if (err == cudaSuccess) {
    err = cudaHostAlloc(reinterpret_cast<void**>(&masked_host_),
                        sizeof(uint32_t) * kMaxMaskedRanks, cudaHostAllocMapped);
  }
  if (err == cudaSuccess) {
    std::memset(masked_host_, 0, sizeof(uint32_t) * kMaxMaskedRanks);
    err = cudaHostGetDevicePointer(reinterpret_cast<void**>(&masked_host_on_device_),
                                   masked_host_, 0);
  }
  if (err != cudaSuccess) return CudaError("allocating the rank mask", err);
  const char* profile_env = std::getenv("JAX_EP_PROFILE");
  if (profile_env != nullptr && std::string(profile_env) == "1") {
    err = cudaMalloc(reinterpret_cast<void**>(&profile_), sizeof(DeviceProfile));
    if (err == cudaSuccess) err = cudaMemset(profile_, 0, sizeof(DeviceProfile));
    if (err != cudaSuccess) return CudaError("cudaMalloc (profile)", err);
  }
  // The probe is also the bounded barrier's flags (host_barrier.cu): [npes] words.
  probe_ = static_cast<char*>(
      nvshmem_malloc(AlignUp(std::max<size_t>(kAlign, sizeof(uint64_t) * npes))));
  if (probe_ == nullptr) return "jax_ep: nvshmem_malloc of the peer probe failed";
  err = cudaMemset(probe_, 0, sizeof(uint64_t) * npes);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&barrier_result_), sizeof(int32_t));
  if (err != cudaSuccess) return CudaError("setting up the bounded barrier", err);
  err = PrepareLlKernels();
  if (err == cudaSuccess) err = PrepareLlPresummedKernels();
  if (err == cudaSuccess) err = PrepareHtKernels();
  if (err == cudaSuccess) err = PrepareHtPairPlan();
  if (err != cudaSuccess) return CudaError("loading the kernels", err);
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return CudaError("cudaDeviceSynchronize", err);
  nvshmem_barrier_all();
  initialized_ = true;
  return "";
}

std::vector<bool> Runtime::ProbePeers() const {
  std::vector<bool> p2p;
  if (!initialized_) return p2p;
  for (int pe = 0; pe < nvshmem_n_pes(); ++pe) {
    const bool forced = std::find(rdma_only_peers_.begin(), rdma_only_peers_.end(), pe) !=
                        rdma_only_peers_.end();
    p2p.push_back(!forced && nvshmem_ptr(probe_, pe) != nullptr);
  }
  return p2p;
}

std::string Runtime::SetRdmaOnlyPeers(const std::vector<int>& pes) {
  if (!initialized_) return "jax_ep: SetRdmaOnlyPeers before Init";
  uint32_t words[transport::kRdmaOnlyPeerWords] = {};
  std::vector<int> kept;
  for (int pe : pes) {
    if (pe < 0 || pe >= nvshmem_n_pes() || pe >= 32 * transport::kRdmaOnlyPeerWords) {
      return "jax_ep: RDMA-only peer " + std::to_string(pe) + " is not a PE of this job";
    }
    if (pe == nvshmem_my_pe()) continue;  // a PE always reaches itself
    words[pe >> 5] |= 1u << (pe & 31);
    kept.push_back(pe);
  }
  const cudaError_t err = cudaMemcpyToSymbol(transport::rdma_only_peers, words, sizeof(words));
  if (err != cudaSuccess) return CudaError("cudaMemcpyToSymbol (RDMA-only peers)", err);
  rdma_only_peers_ = kept;
  return "";
}

std::string Runtime::Allocate(const EpDims& dims, const std::vector<int>& group_pes,
                              bool low_latency, bool high_throughput, bool rdma_staging,
                              double timeout_s, int num_sms) {
  if (!initialized_) return "jax_ep: Allocate before Init";
  if (static_cast<int>(group_pes.size()) != dims.num_ranks ||
      dims.num_ranks > transport::kMaxGroupRanks || dims.rank < 0 ||
      dims.rank >= dims.num_ranks || group_pes[dims.rank] != nvshmem_my_pe()) {
    return "jax_ep: the EP group's PEs do not include this PE at its EP rank " +
           std::to_string(dims.rank);
  }
  for (int pe : group_pes) {
    if (pe < 0 || pe >= nvshmem_n_pes()) {
      return "jax_ep: EP group PE " + std::to_string(pe) + " is not a PE of this job";
    }
  }
  std::string released = ReleaseBuffers();
  if (!released.empty()) return released;
  cudaError_t group_err = cudaMemcpyToSymbol(transport::group_pes, group_pes.data(),
                                             sizeof(int32_t) * group_pes.size());
  if (group_err != cudaSuccess) return CudaError("cudaMemcpyToSymbol (EP group PEs)", group_err);
  const BufferLayout layout = ComputeLayout(dims, low_latency, high_throughput, rdma_staging);
  size_t free_bytes = 0, total_bytes = 0;
  cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (err != cudaSuccess) return CudaError("cudaMemGetInfo", err);
  if (layout.total + kFreeMemoryMargin > free_bytes) {
    return "jax_ep needs " + GiB(layout.total) + " of GPU memory for its symmetric buffers " +
           "(+" + GiB(kFreeMemoryMargin) + " margin) but only " + GiB(free_bytes) + " of " +
           GiB(total_bytes) + " are free. XLA preallocates most of the GPU by default: set " +
           "XLA_PYTHON_CLIENT_PREALLOCATE=false (jax_ep.launch does) or lower " +
           "XLA_PYTHON_CLIENT_MEM_FRACTION; or shrink EpConfig (max_tokens_per_rank, hidden, " +
           "enable_low_latency / enable_high_throughput: see jax_ep.buffer_bytes)";
  }
  base_ = static_cast<char*>(nvshmem_align(kAlign, layout.total));
  if (base_ == nullptr) {
    return "jax_ep: nvshmem_align(" + GiB(layout.total) + ") failed; raise NVSHMEM_SYMMETRIC_SIZE "
           "or NVSHMEM_MAX_MEMORY_PER_GPU";
  }
  err = cudaMemset(base_, 0, layout.total);
  if (err == cudaSuccess) {
    err = cudaMalloc(reinterpret_cast<void**>(&slot_counters_), SlotCounterBytes(dims));
  }
  if (err == cudaSuccess) err = cudaMemset(slot_counters_, 0, SlotCounterBytes(dims));
  if (err != cudaSuccess) return CudaError("clearing the symmetric buffers", err);
#if JAX_EP_HAVE_QP_API
  if (low_latency && rdma_staging) {
    nvshmemx_qp_handle_t* handles = nullptr;
    if (nvshmemx_qp_create(dims.experts_per_rank, &handles) != 0 || handles == nullptr) {
      return "jax_ep: nvshmemx_qp_create(" + std::to_string(dims.experts_per_rank) + ") failed";
    }
    err = cudaMalloc(reinterpret_cast<void**>(&qp_handles_), sizeof(int) * dims.experts_per_rank);
    if (err == cudaSuccess) {
      err = cudaMemcpy(qp_handles_, handles, sizeof(int) * dims.experts_per_rank,
                       cudaMemcpyHostToDevice);
    }
    if (err != cudaSuccess) return CudaError("copying the QP handles", err);
  }
#endif
  err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return CudaError("cudaDeviceSynchronize", err);
  host_timeout_ns_ = static_cast<uint64_t>(timeout_s * 1e9);
  // Every rank's buffers are zero before anyone writes.
  std::string arrived = BoundedBarrier("allocating the buffers");
  if (!arrived.empty()) return arrived;

  dims_ = dims;
  layout_ = layout;
  low_latency_ = low_latency;
  high_throughput_ = high_throughput;
  const uint64_t timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  ll_ = LlContext{};
  ll_.dims = dims;
  ll_.counters = counters_;
  ll_.status = status_device_;
  ll_.slot_counters = slot_counters_;
  ll_.rank_counters = reinterpret_cast<uint32_t*>(slot_counters_ + std::max(dims.num_experts, 1));
  ll_.qp_handles = qp_handles_;
  ll_.profile = profile_;
  ll_.masked = masked_device_;
  ll_.masked_mirror = masked_host_on_device_;
  ll_.mask_on_timeout = mask_on_timeout_;
  ll_.timeout_ns = timeout_ns;
  ll_.num_sms = num_sms_;
  if (low_latency) {
    for (int p = 0; p < 2; ++p) {
      ll_.buffers.dispatch_recv[p] = base_ + layout.ll_dispatch_recv[p];
      ll_.buffers.dispatch_tokens[p] = base_ + layout.ll_dispatch_tokens[p];
      ll_.buffers.dispatch_flags[p] = reinterpret_cast<uint64_t*>(base_ + layout.ll_dispatch_flags[p]);
      ll_.buffers.combine_recv[p] = base_ + layout.ll_combine_recv[p];
      ll_.buffers.combine_values[p] = reinterpret_cast<float*>(base_ + layout.ll_combine_values[p]);
      ll_.buffers.combine_flags[p] = reinterpret_cast<uint64_t*>(base_ + layout.ll_combine_flags[p]);
    }
    ll_.buffers.dispatch_stage = rdma_staging ? base_ + layout.ll_dispatch_stage : nullptr;
    ll_.buffers.dispatch_header_stage =
        rdma_staging ? base_ + layout.ll_dispatch_header_stage : nullptr;
    ll_.buffers.combine_stage = rdma_staging ? base_ + layout.ll_combine_stage : nullptr;
    ll_.buffers.combine_values_stage =
        rdma_staging ? reinterpret_cast<float*>(base_ + layout.ll_combine_values_stage) : nullptr;
    ll_.buffers.message_bytes = layout.ll_message_bytes;
  }
  ht_ = HtContext{};
  ht_.dims = dims;
  ht_.counters = counters_;
  ht_.status = status_device_;
  ht_.timeout_ns = timeout_ns;
  ht_.profile = profile_;
  // Experiment knobs (docs/benchmarks.md); the defaults are the measured kernels.
  const char* divisor_env = std::getenv("JAX_EP_HT_RECV_DIVISOR");
  ht_.recv_divisor = divisor_env != nullptr ? std::max(2, std::atoi(divisor_env)) : 3;
  // HT SM budget: EpGroup.num_sms, else kHtDefaultSms (DeepEP's 24; see docs/benchmarks.md).
  ht_.num_sms = std::max(1, std::min(num_sms > 0 ? num_sms : kHtDefaultSms, num_sms_));
  if (high_throughput) {
    HtBuffers& b = ht_.buffers;
    b.counts = reinterpret_cast<int32_t*>(base_ + layout.ht_counts);
    b.notify_flags = reinterpret_cast<uint64_t*>(base_ + layout.ht_notify_flags);
    b.recv_x = base_ + layout.ht_recv_x;
    b.recv_scales = reinterpret_cast<float*>(base_ + layout.ht_recv_scales);
    b.recv_src = reinterpret_cast<int32_t*>(base_ + layout.ht_recv_src);
    b.recv_idx = reinterpret_cast<int32_t*>(base_ + layout.ht_recv_idx);
    b.recv_w = reinterpret_cast<float*>(base_ + layout.ht_recv_w);
    b.chunk_arrived = reinterpret_cast<uint32_t*>(base_ + layout.ht_chunk_arrived);
    b.chunks_per_source = (dims.max_tokens + kHtChunkRows - 1) / kHtChunkRows;
    for (int p = 0; p < 2; ++p) {
      b.combine_recv[p] = base_ + layout.ht_combine_recv[p];
      b.combine_flags[p] = reinterpret_cast<uint64_t*>(base_ + layout.ht_combine_flags[p]);
    }
    b.row_bytes = layout.ht_row_bytes;
    b.expert_counts = reinterpret_cast<int32_t*>(base_ + layout.ht_expert_counts);
    b.recv_pair_rank = reinterpret_cast<int32_t*>(base_ + layout.ht_recv_pair_rank);
    b.plan_block_counts = reinterpret_cast<int32_t*>(base_ + layout.ht_plan_block_counts);
    b.plan_pair_rank = reinterpret_cast<int32_t*>(base_ + layout.ht_plan_pair_rank);
    b.plan_expert_totals = reinterpret_cast<int32_t*>(base_ + layout.ht_plan_expert_totals);
    if (dims.num_ranks == 1) {
      b.plan_block_before = reinterpret_cast<int32_t*>(base_ + layout.ht_plan_block_before);
      b.plan_token_slot = reinterpret_cast<int32_t*>(base_ + layout.ht_plan_token_slot);
    }
  }
  return "";
}

std::string Runtime::BoundedBarrier(const char* step) {
  int first_missing = -1;
  const cudaError_t err =
      RunBoundedBarrier(reinterpret_cast<uint64_t*>(probe_), nvshmem_my_pe(), nvshmem_n_pes(),
                        ++barrier_seq_, host_timeout_ns_, barrier_stream_, barrier_result_,
                        &first_missing);
  if (err != cudaSuccess) return CudaError("the bounded barrier", err);
  if (first_missing < 0) return "";
  abandoned_why_ = "EP rank " + std::to_string(first_missing) + " did not reach " + step +
                   " within " + std::to_string(host_timeout_ns_ / 1000000000) + " s";
  return "jax_ep: " + abandoned_why_ +
         " (it died or is out of step); NVSHMEM's collective teardown is skipped, so this "
         "process must exit to free its GPU memory";
}

std::string Runtime::ReleaseBuffers() {
  if (base_ == nullptr) return "";
  cudaError_t err = cudaDeviceSynchronize();  // no kernel may still use the buffers
  if (err != cudaSuccess) return CudaError("cudaDeviceSynchronize", err);
  std::string arrived = BoundedBarrier("releasing the buffers");
  if (!arrived.empty()) return arrived;  // nvshmem_free is collective: skipped
  nvshmem_free(base_);
  base_ = nullptr;
  if (slot_counters_ != nullptr) cudaFree(slot_counters_);
  slot_counters_ = nullptr;
  if (qp_handles_ != nullptr) cudaFree(qp_handles_);
  qp_handles_ = nullptr;
  ll_ = LlContext{};
  ht_ = HtContext{};
  low_latency_ = high_throughput_ = false;
  return "";
}

std::string Runtime::Finalize() {
  if (!initialized_) return "";
  std::string released = ReleaseBuffers();
  if (released.empty()) released = BoundedBarrier("finalize");
  if (!released.empty()) {
    // A peer is gone: NVSHMEM's collectives (nvshmem_free, nvshmem_finalize)
    // would wait for it forever. Keep NVSHMEM up; the process exits later.
    initialized_ = false;
    return released;
  }
  if (probe_ != nullptr) nvshmem_free(probe_);
  probe_ = nullptr;
  if (counters_ != nullptr) cudaFree(counters_);
  counters_ = nullptr;
  if (profile_ != nullptr) cudaFree(profile_);
  profile_ = nullptr;
  if (masked_device_ != nullptr) cudaFree(masked_device_);
  masked_device_ = nullptr;
  if (masked_host_ != nullptr) cudaFreeHost(masked_host_);
  masked_host_ = masked_host_on_device_ = nullptr;
  if (!joined_) nvshmem_finalize();  // a runtime jax_ep joined is its starter's to end
  if (barrier_stream_ != nullptr) cudaStreamDestroy(barrier_stream_);
  barrier_stream_ = nullptr;
  if (barrier_result_ != nullptr) cudaFree(barrier_result_);
  barrier_result_ = nullptr;
  if (status_host_ != nullptr) cudaFreeHost(status_host_);
  status_host_ = status_device_ = nullptr;
  initialized_ = false;
  return "";
}

DeviceStatus Runtime::status() const {
  DeviceStatus snapshot{};
  if (status_host_ != nullptr) {
    std::memcpy(&snapshot, const_cast<const DeviceStatus*>(status_host_), sizeof(snapshot));
  }
  return snapshot;
}

std::string Runtime::ReadProfile(DeviceProfile* out) {
  std::memset(out, 0, sizeof(*out));
  if (profile_ == nullptr) return "jax_ep: profiling is off (set JAX_EP_PROFILE=1 before initialize)";
  cudaError_t err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(out, profile_, sizeof(*out), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) err = cudaMemset(profile_, 0, sizeof(DeviceProfile));
  return err == cudaSuccess ? "" : CudaError("reading the profile", err);
}

std::string Runtime::SetMasked(const std::vector<int>& ranks) {
  if (masked_device_ == nullptr) return "jax_ep: the rank mask needs an initialised runtime";
  std::vector<uint32_t> mask(kMaxMaskedRanks, 0u);
  for (int rank : ranks) {
    if (rank < 0 || rank >= kMaxMaskedRanks) {
      return "jax_ep: rank " + std::to_string(rank) + " is outside the rank mask";
    }
    mask[rank] = 1u;
  }
  const cudaError_t err = cudaMemcpy(masked_device_, mask.data(), sizeof(uint32_t) * mask.size(),
                                     cudaMemcpyHostToDevice);
  if (err != cudaSuccess) return CudaError("setting the rank mask", err);
  std::memcpy(masked_host_, mask.data(), sizeof(uint32_t) * mask.size());
  return "";
}

std::vector<int> Runtime::Masked() const {
  std::vector<int> ranks;
  if (masked_host_ == nullptr) return ranks;
  const int limit = std::min(std::max(dims_.num_ranks, 0), kMaxMaskedRanks);
  for (int r = 0; r < limit; ++r) {
    if (reinterpret_cast<const volatile uint32_t*>(masked_host_)[r] != 0u) ranks.push_back(r);
  }
  return ranks;
}

void Runtime::SetMaskOnTimeout(bool on) {
  mask_on_timeout_ = on;
  ll_.mask_on_timeout = on;
}

void Runtime::ClearStatus() {
  if (status_host_ != nullptr) std::memset(status_host_, 0, sizeof(DeviceStatus));
}

}  // namespace jax_ep::cuda
