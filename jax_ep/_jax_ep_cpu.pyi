"""Type stub of jax_ep._jax_ep_cpu (xla_ffi/cpu_module.cc): the CPU FFI
handlers of the portable backend and the tables of xla_ffi/exports.h."""

from typing import Any

ffi_api_version: tuple[int, int]
built_with_jaxlib: str

def handlers() -> dict[str, Any]:
  """{FFI target name: PyCapsule of its XLA FFI handler}."""

def cpu_targets() -> dict[str, str]:
  """{op: XLA FFI target name} of the CPU handlers."""

def cuda_targets() -> dict[str, str]:
  """{op: XLA FFI target name} of the CUDA handlers."""

def limits() -> dict[str, int]:
  """{name: value}: the kernels' limits (cuda/limits.h)."""
