"""Loads jax_ep's compiled extension modules and registers their FFI targets.

* ``jax_ep._jax_ep_cpu`` (always built): CPU handlers of the portable backend.
* ``jax_ep._jax_ep_cuda`` (built where nvcc and the NVSHMEM wheel were found):
  the CUDA kernels and the NVSHMEM runtime. Its absence is reported by
  :func:`cuda_module_status`, never raised at import.
"""

from __future__ import annotations

import functools
import importlib
import os
import types

import jax
import jaxlib

from jax_ep.errors import EpError


def _check_built_for_this_jaxlib(module: types.ModuleType) -> None:
  built_with = getattr(module, "built_with_jaxlib", "unknown")
  if built_with != jaxlib.__version__:
    raise EpError(
        f"{module.__name__} was built against jaxlib {built_with} but jaxlib "
        f"{jaxlib.__version__} is running; the XLA FFI call frame must match exactly. "
        "Rebuild jax_ep in this environment: pip install --no-build-isolation -e .")


@functools.cache
def cpu_module() -> types.ModuleType:
  """The CPU extension, with its FFI targets registered for platform 'cpu'."""
  try:
    module = importlib.import_module("jax_ep._jax_ep_cpu")
  except ImportError as e:
    raise EpError(
        "jax_ep's CPU extension (jax_ep._jax_ep_cpu) is not built. Install the package "
        "(pip install --no-build-isolation -e .) or run tools/setup_env.sh.") from e
  _check_built_for_this_jaxlib(module)
  for name, capsule in module.handlers().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  return module


@functools.cache
def _cuda_module_or_error() -> tuple[types.ModuleType | None, str]:
  from jax_ep import _nvshmem_lib  # pylint: disable=import-outside-toplevel

  preload_error = _nvshmem_lib.preload()
  if preload_error:
    return None, preload_error
  try:
    module = importlib.import_module("jax_ep._jax_ep_cuda")
  except ImportError as e:
    return None, f"jax_ep._jax_ep_cuda is not available: {e}"
  try:
    _check_built_for_this_jaxlib(module)
  except EpError as e:
    return None, str(e)
  _register_cuda_targets(module)
  return module, "built"


# Whether the status check carries its prepare stage (see
# _register_cuda_targets); read by jax_ep.status().
_prepare_check = {"enabled": False, "why": "not registered"}

# The FFI target every jax_ep CUDA call takes its last operand from
# (backends/cuda.py; xla_ffi/cuda/handler_common.h StatusToken).
STATUS_CHECK_TARGET = "jax_ep_status_check"


def _register_cuda_targets(module: types.ModuleType) -> None:
  """Registers the CUDA handlers, and the status check with a prepare stage
  that XLA runs on the host before every execution, also inside command
  buffers, so that a fault recorded by a kernel fails the next execution
  (docs/reliability.md). XLA merges a computation's checks into one, so the
  check costs once per computation, not once per call.
  JAX_EP_PREPARE_STATUS_CHECK=0 leaves the prepare stage out; registration
  falls back to the plain check where this jaxlib refuses handler bundles."""
  for name, capsule in module.handlers().items():
    jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  check = module.status_check()
  if os.environ.get("JAX_EP_PREPARE_STATUS_CHECK", "1") == "0":
    _prepare_check["why"] = "off (JAX_EP_PREPARE_STATUS_CHECK=0)"
  else:
    try:
      jax.ffi.register_ffi_target(STATUS_CHECK_TARGET,
                                  {"prepare": module.prepare_status_check(), "execute": check},
                                  platform="CUDA")
      _prepare_check.update(enabled=True, why="registered")
      return
    except Exception as e:  # pylint: disable=broad-except
      _prepare_check["why"] = f"jaxlib refused a handler bundle: {e}"
  jax.ffi.register_ffi_target(STATUS_CHECK_TARGET, check, platform="CUDA")


def prepare_status_check() -> dict:
  """{'enabled': bool, 'why': str}: whether faults fail the next execution
  also inside command buffers."""
  return dict(_prepare_check)


def cuda_module() -> types.ModuleType | None:
  """The CUDA extension, or None where it was not built or cannot load."""
  return _cuda_module_or_error()[0]


def cuda_module_status() -> str:
  """'built', or why the CUDA extension is unavailable."""
  return _cuda_module_or_error()[1]
