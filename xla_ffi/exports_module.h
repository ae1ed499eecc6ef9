// The nanobind functions both modules define from xla_ffi/exports.h:
// cpu_targets(), cuda_targets() ({op: FFI target name}) and limits()
// ({name: value}). Included by cpu_module.cc and cuda_module.cc only.
#ifndef JAX_EP_XLA_FFI_EXPORTS_MODULE_H_
#define JAX_EP_XLA_FFI_EXPORTS_MODULE_H_

#include <nanobind/nanobind.h>

#include "xla_ffi/exports.h"

namespace jax_ep::exports {

template <size_t N>
nanobind::dict TargetDict(const Named (&table)[N]) {
  nanobind::dict result;
  for (const Named& entry : table) result[entry.op] = entry.target;
  return result;
}

inline void DefineExports(nanobind::module_& m) {
  m.def("cpu_targets", []() { return TargetDict(kCpuTargets); },
        "{op: XLA FFI target name} of the CPU handlers.");
  m.def("cuda_targets", []() { return TargetDict(kCudaTargets); },
        "{op: XLA FFI target name} of the CUDA handlers.");
  m.def("limits", []() {
    nanobind::dict result;
    for (const Limit& limit : kLimits) result[limit.name] = limit.value;
    return result;
  }, "{name: value}: the kernels' limits (cuda/limits.h).");
}

}  // namespace jax_ep::exports

#endif  // JAX_EP_XLA_FFI_EXPORTS_MODULE_H_
