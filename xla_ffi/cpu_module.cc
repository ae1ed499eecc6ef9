// nanobind module `jax_ep._jax_ep_cpu`: exports the CPU FFI handlers of the
// portable backend as PyCapsules, the FFI API version it was built with
// (jax_ep checks it against the running jaxlib at import), and the target
// names and kernel limits of xla_ffi/exports.h (always built, so they are
// there also where the CUDA module is not).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"
#include "xla_ffi/cpu/cpu_handlers.h"
#include "xla_ffi/exports_module.h"

namespace nb = nanobind;

#ifndef JAX_EP_BUILT_WITH_JAXLIB
#define JAX_EP_BUILT_WITH_JAXLIB "unknown"
#endif

NB_MODULE(_jax_ep_cpu, m) {
  m.doc() = "jax_ep CPU FFI handlers (portable backend local steps)";
  m.def("handlers", []() {
    nb::dict result;
    for (const auto* entry = jax_ep::cpu::CpuHandlers(); entry->name != nullptr; ++entry) {
      result[entry->name] = nb::capsule(reinterpret_cast<void*>(entry->handler));
    }
    return result;
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
  m.attr("built_with_jaxlib") = JAX_EP_BUILT_WITH_JAXLIB;
  jax_ep::exports::DefineExports(m);
}
