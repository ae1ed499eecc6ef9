// nanobind module `jax_ep._jax_ep_cuda`: the CUDA FFI handlers as PyCapsules
// and the runtime entry points jax_ep/cuda_runtime.py drives (NVSHMEM
// bootstrap, symmetric buffers, the fault word). Errors raise RuntimeError
// with the runtime's message.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/runtime.h"
#include "xla/ffi/api/c_api.h"
#include "xla_ffi/cuda/handler_common.h"
#include "xla_ffi/cuda/ht_handlers.h"
#include "xla_ffi/cuda/ll_handlers.h"
#include "xla_ffi/exports_module.h"

namespace nb = nanobind;
using jax_ep::cuda::EpDims;
using jax_ep::cuda::Runtime;

#ifndef JAX_EP_BUILT_WITH_JAXLIB
#define JAX_EP_BUILT_WITH_JAXLIB "unknown"
#endif

namespace {

void Check(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

// The runtime jax_ep.initialize started (Runtime::Start), for a step that needs one.
Runtime& Started(const char* step) {
  Runtime* runtime = Runtime::Current();
  if (runtime == nullptr) {
    throw std::runtime_error(std::string("jax_ep: ") + step +
                             " needs the CUDA runtime, which is not started (or was finalised): "
                             "call jax_ep.initialize(config, mesh) first");
  }
  return *runtime;
}

EpDims MakeDims(int num_ranks, int rank, int num_experts, int hidden, int max_tokens,
                int ll_max_tokens, int num_topk) {
  if (num_ranks <= 0 || num_experts % num_ranks != 0) {
    throw std::invalid_argument("num_experts must be a positive multiple of num_ranks");
  }
  return EpDims{num_ranks, rank, num_experts, num_experts / num_ranks, hidden, max_tokens,
                ll_max_tokens, num_topk};
}

nb::tuple Version(const jax_ep::cuda::NvshmemVersion& v) {
  return nb::make_tuple(v.major, v.minor, v.patch);
}

}  // namespace

NB_MODULE(_jax_ep_cuda, m) {
  m.doc() = "jax_ep CUDA kernels (XLA FFI handlers) and NVSHMEM runtime";
  m.def("handlers", []() {
    std::vector<jax_ep::ffi_cuda::HandlerEntry> entries;
    jax_ep::ffi_cuda::AppendLlHandlers(&entries);
    jax_ep::ffi_cuda::AppendHtHandlers(&entries);
    nb::dict result;
    for (const auto& entry : entries) {
      result[entry.name] = nb::capsule(reinterpret_cast<void*>(entry.handler));
    }
    return result;
  });
  m.def("prepare_status_check", []() {
    return nb::capsule(reinterpret_cast<void*>(jax_ep::ffi_cuda::PrepareStatusCheckHandler()));
  });
  m.def("status_check", []() {
    return nb::capsule(reinterpret_cast<void*>(jax_ep::ffi_cuda::StatusCheckHandler()));
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("built_with_jaxlib") = JAX_EP_BUILT_WITH_JAXLIB;
  jax_ep::exports::DefineExports(m);
  m.def("nvshmem_loaded_version", []() { return Version(Runtime::LoadedVersion()); });
  m.def("nvshmem_compiled_version", []() { return Version(Runtime::CompiledVersion()); });
  m.def("has_qp_api", &Runtime::HasQpApi);

  m.def("buffer_layout", [](int num_ranks, int num_experts, int hidden, int max_tokens,
                            int ll_max_tokens, int num_topk, bool low_latency,
                            bool high_throughput, bool rdma_staging) {
    const auto layout = jax_ep::cuda::ComputeLayout(
        MakeDims(num_ranks, 0, num_experts, hidden, max_tokens, ll_max_tokens, num_topk),
        low_latency, high_throughput, rdma_staging);
    nb::dict d;
    d["total"] = layout.total;
    d["ll_message_bytes"] = layout.ll_message_bytes;
    d["ht_row_bytes"] = layout.ht_row_bytes;
    return d;
  });

  // The handlers' check of a call against the allocation, without a GPU
  // (xla_ffi/cuda/handler_common.h CallDims): the dims a call traced with
  // `traced` (the "config" attribute jax_ep/backends/cuda.py config_attr
  // builds, as ints) runs with on buffers allocated for the given sizes, or
  // ValueError with the message the handlers return.
  m.def("call_dims", [](int num_ranks, int num_experts, int hidden, int max_tokens,
                        int ll_max_tokens, int num_topk,
                        const std::map<std::string, int64_t>& traced, bool low_latency,
                        bool high_throughput) {
    const EpDims allocated =
        MakeDims(num_ranks, 0, num_experts, hidden, max_tokens, ll_max_tokens, num_topk);
    jax_ep::ffi_cuda::CallConfig config{};
    const std::pair<const char*, int64_t*> fields[] = {
        {"num_ranks", &config.num_ranks}, {"num_experts", &config.num_experts},
        {"hidden", &config.hidden}, {"max_tokens", &config.max_tokens},
        {"ll_max_tokens", &config.ll_max_tokens}, {"num_topk", &config.num_topk}};
    for (const auto& [name, field] : fields) {
      auto it = traced.find(name);
      if (it == traced.end()) throw std::invalid_argument(std::string("traced lacks ") + name);
      *field = it->second;
    }
    EpDims call{};
    const std::string why =
        jax_ep::ffi_cuda::CallDims(config, allocated, low_latency, high_throughput, &call);
    if (!why.empty()) throw std::invalid_argument(why);
    nb::dict d;
    d["num_ranks"] = call.num_ranks;
    d["rank"] = call.rank;
    d["num_experts"] = call.num_experts;
    d["experts_per_rank"] = call.experts_per_rank;
    d["hidden"] = call.hidden;
    d["max_tokens"] = call.max_tokens;
    d["ll_max_tokens"] = call.ll_max_tokens;
    d["num_topk"] = call.num_topk;
    return d;
  });

  m.def("get_unique_id", []() {
    std::string uid;
    Check(Runtime::GetUniqueId(&uid));
    return nb::bytes(uid.data(), uid.size());
  });
  m.def("init", [](int pe, int npes, nb::bytes uid, int device) {
    Check(Runtime::Start(pe, npes, std::string(uid.c_str(), uid.size()), device));
  });
  m.def("nvshmem_already_initialized", &Runtime::NvshmemAlreadyInitialized);
  m.def("joined", []() { return Runtime::Current() != nullptr && Runtime::Current()->joined(); });
  m.def("my_pe", []() { return Runtime::Current() ? Runtime::Current()->MyPe() : -1; });
  m.def("probe_peers", []() { return Started("probe_peers").ProbePeers(); });
  m.def("set_rdma_only_peers",
        [](const std::vector<int>& pes) {
          Check(Started("set_rdma_only_peers").SetRdmaOnlyPeers(pes));
        });
  // group_pes[r]: the NVSHMEM PE of EP rank r of this process's EP group.
  m.def("allocate", [](const std::vector<int>& group_pes, int rank, int num_experts, int hidden,
                       int max_tokens, int ll_max_tokens, int num_topk, bool low_latency,
                       bool high_throughput, bool rdma_staging, double timeout_s, int num_sms) {
    Check(Started("allocate").Allocate(
        MakeDims(static_cast<int>(group_pes.size()), rank, num_experts, hidden, max_tokens,
                 ll_max_tokens, num_topk),
        group_pes, low_latency, high_throughput, rdma_staging, timeout_s, num_sms));
  });
  m.def("release_buffers", []() { Check(Started("release_buffers").ReleaseBuffers()); });
  // Returns "" or why NVSHMEM's collective teardown was skipped (a peer did
  // not arrive: it died); never raises, so that a survivor can exit.
  m.def("finalize", []() { return Runtime::Stop(); });
  m.def("initialized",
        []() { return Runtime::Current() != nullptr && Runtime::Current()->initialized(); });
  m.def("allocated",
        []() { return Runtime::Current() != nullptr && Runtime::Current()->allocated(); });
  m.def("status", []() {
    const auto s = Runtime::Current() ? Runtime::Current()->status() : jax_ep::cuda::DeviceStatus{};
    nb::dict d;
    d["code"] = s.code;
    d["op"] = s.op;
    d["peer"] = s.peer;
    d["detail"] = s.detail;
    d["fault_count"] = s.fault_count;
    return d;
  });
  m.def("clear_status", []() {
    if (Runtime::Current() != nullptr) Runtime::Current()->ClearStatus();
  });
  m.def("set_masked",
        [](const std::vector<int>& ranks) { Check(Started("set_masked").SetMasked(ranks)); });
  m.def("masked", []() {
    return Runtime::Current() ? Runtime::Current()->Masked() : std::vector<int>{};
  });
  m.def("set_mask_on_timeout",
        [](bool on) { Started("set_mask_on_timeout").SetMaskOnTimeout(on); });
  m.def("read_profile", []() {
    jax_ep::cuda::DeviceProfile p;
    Check(Started("read_profile").ReadProfile(&p));
    const char* names[jax_ep::cuda::kProfileSlots] = {
        "ll_dispatch_send", "ll_dispatch_recv", "ll_combine_send", "ll_combine_recv",
        "ht_dispatch_counts", "ht_dispatch_send_role", "ht_dispatch_recv_role", "ht_combine_send",
        "ht_combine_recv"};
    nb::dict d;
    for (int k = 0; k < jax_ep::cuda::kProfileSlots; ++k) {
      if (p.calls[k] == 0) continue;
      const double n = static_cast<double>(p.calls[k]);
      nb::dict e;
      e["calls"] = p.calls[k];
      e["kernel_us"] = p.total_ns[k] / n / 1e3;
      // Per block and call where several blocks wait (HT receive roles).
      e["wait_us"] = p.wait_ns[k] / (p.blocks[k] ? static_cast<double>(p.blocks[k]) : n) / 1e3;
      if (k < 4) e["gap_after_send_us"] = p.gap_ns[k] / n / 1e3;
      d[names[k]] = e;
    }
    // HT dispatch timeline rows (seq % kHtTraceCalls), %globaltimer ns per event.
    nb::list trace;
    for (const auto& row : p.ht_trace) {
      nb::list events;
      for (uint64_t at : row) events.append(at);
      trace.append(events);
    }
    if (p.calls[4] != 0) d["ht_trace"] = trace;
    return d;
  });
}
