"""Finds and preloads the NVSHMEM host library of the nvidia-nvshmem-cu13 wheel.

The CUDA extension links ``libnvshmem_host.so.3`` by soname. Loading the
wheel's copy with RTLD_GLOBAL first makes that resolve wherever the extension
lives, and keeps one NVSHMEM instance per process (JAX's CUDA plugin loads the
same file).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

LIBRARY_NAME = "libnvshmem_host.so.3"


def wheel_directory() -> str | None:
  """The nvidia/nvshmem directory of the installed wheel, or None."""
  try:
    spec = importlib.util.find_spec("nvidia.nvshmem")
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  return list(spec.submodule_search_locations)[0]


# Another NVSHMEM host library to load instead of the wheel's (the build must
# use the same version: e.g. a newer NVSHMEM for the per-QP RDMA API,
# tools/nvshmem_qp_bundle.sh).
HOST_LIB_ENV = "JAX_EP_NVSHMEM_HOST_LIB"


def library_path() -> str | None:
  """Path of the NVSHMEM host library: $JAX_EP_NVSHMEM_HOST_LIB, else the
  wheel's libnvshmem_host.so.3, or None."""
  override = os.environ.get(HOST_LIB_ENV)
  if override:
    return override if os.path.exists(override) else None
  directory = wheel_directory()
  if directory is None:
    return None
  path = os.path.join(directory, "lib", LIBRARY_NAME)
  return path if os.path.exists(path) else None


@functools.cache
def preload() -> str:
  """Loads the library globally; returns '' on success, else the reason."""
  path = library_path()
  if path is None:
    if os.environ.get(HOST_LIB_ENV):
      return f"{HOST_LIB_ENV}={os.environ[HOST_LIB_ENV]} does not exist"
    return f"the nvidia-nvshmem-cu13 wheel ({LIBRARY_NAME}) is not installed"
  try:
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
  except OSError as e:
    return f"cannot load {path}: {e}"
  return ""
