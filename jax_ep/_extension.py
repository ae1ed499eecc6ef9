"""Loads jax_ep's compiled extension modules and registers their FFI targets.

* ``jax_ep._jax_ep_cpu`` (always built): CPU handlers of the portable backend.
* ``jax_ep._jax_ep_cuda`` (built where nvcc and the NVSHMEM wheel were found):
  the CUDA kernels and the NVSHMEM runtime. Its absence is reported by
  :func:`cuda_module_status`, never raised at import.

This is the one place where Python reads what C++ defines: the FFI target
names (:func:`cpu_target`, :func:`cuda_target`) and the kernels' limits
(:func:`limits`), from the tables of xla_ffi/exports.h that both modules
export. No Python literal copies them.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class KernelLimits:
  """The CUDA kernels' limits (cuda/limits.h), as the extension exports them.

  Attributes:
    max_topk: top-k entries per token (one lane or thread each).
    ht_max_ranks: EP ranks of the high-throughput kernels (one NVLink domain).
    ht_max_tokens: tokens per rank of one HT dispatch.
    ht_max_experts_per_rank: experts per rank of the HT dispatch.
    ht_chunk_rows: rows per completion counter of an HT dispatch.
    ht_plan_blocks: blocks of the HT pair plan's kernels.
    ht_one_rank_plan_blocks: the expert-major dispatch's grid at one rank.
    ll_max_ranks: EP ranks of the low-latency kernels.
    ll_max_dynamic_smem_bytes: dynamic shared memory of the LL dispatch's send
      part (its routing table).
  """

  max_topk: int
  ht_max_ranks: int
  ht_max_tokens: int
  ht_max_experts_per_rank: int
  ht_chunk_rows: int
  ht_plan_blocks: int
  ht_one_rank_plan_blocks: int
  ll_max_ranks: int
  ll_max_dynamic_smem_bytes: int


@functools.cache
def limits() -> KernelLimits:
  """The kernels' limits, from the (always built) CPU module."""
  return KernelLimits(**cpu_module().limits())


def cpu_target(op: str) -> str:
  """The XLA FFI target name of CPU handler ``op`` (e.g. "gather_rows")."""
  return _targets("cpu")[op]


def cuda_target(op: str) -> str:
  """The XLA FFI target name of CUDA handler ``op`` (e.g. "ht_dispatch"),
  known also where the CUDA module is not built (lowering for CUDA on CPU)."""
  return _targets("cuda")[op]


@functools.cache
def _targets(platform: str) -> dict[str, str]:
  module = cpu_module()
  return dict(module.cpu_targets() if platform == "cpu" else module.cuda_targets())


def _check_agrees_with_cpu_module(module: types.ModuleType) -> None:
  """The CUDA module's tables equal the CPU module's (one build of one tree)."""
  cpu = cpu_module()
  for table in ("cpu_targets", "cuda_targets", "limits"):
    if getattr(module, table)() != getattr(cpu, table)():
      raise EpError(
          f"jax_ep's CUDA and CPU extension modules disagree on {table} (xla_ffi/exports.h): "
          "they come from different builds. Rebuild jax_ep: pip install --no-build-isolation "
          "-e .")


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
    _check_agrees_with_cpu_module(module)
  except EpError as e:
    return None, str(e)
  _register_cuda_targets(module)
  return module, "built"


# Whether the status check carries its prepare stage (see
# _register_cuda_targets); read by jax_ep.status().
_prepare_check = {"enabled": False, "why": "not registered"}

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
      jax.ffi.register_ffi_target(cuda_target("status_check"),
                                  {"prepare": module.prepare_status_check(), "execute": check},
                                  platform="CUDA")
      _prepare_check.update(enabled=True, why="registered")
      return
    except Exception as e:  # pylint: disable=broad-except
      _prepare_check["why"] = f"jaxlib refused a handler bundle: {e}"
  jax.ffi.register_ffi_target(cuda_target("status_check"), check, platform="CUDA")


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
