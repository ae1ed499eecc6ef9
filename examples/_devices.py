"""Shared start of the examples: where they run when started without the launcher.

Imported, and ``set_up()`` called, before jax is imported (JAX reads these
variables at import and start-up); imports nothing that imports jax.
  * under ``python -m jax_ep.launch`` (one process per GPU): as launched;
  * JAX_PLATFORMS set by the caller: as asked;
  * on a machine with a GPU: one process on it (EP1 on one GPU: the CUDA
    backend in this process), with the environment the launcher gives its
    processes; with several GPUs jax_ep.initialize asks for the launcher;
  * otherwise: 8 CPU devices (the portable backend).
"""

import os
import sys

CPU_DEVICES = 8

# jax_ep.launch.CHILD_ENV_DEFAULTS (tests/cpu/test_example.py checks they agree):
# NVSHMEM without NVLink multicast or a remote transport, no XLA preallocation
# (NVSHMEM allocates its symmetric heap beside XLA's).
LAUNCH_ENV_DEFAULTS = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "PYTHONUNBUFFERED": "1",
}


def has_gpu() -> bool:
  return os.path.exists("/dev/nvidia0")


def set_up() -> None:
  if "JAX_EP_LAUNCHED" in os.environ or "JAX_PLATFORMS" in os.environ:
    return
  if has_gpu():
    for key, value in LAUNCH_ENV_DEFAULTS.items():
      os.environ.setdefault(key, value)
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={CPU_DEVICES}").strip()


# The examples import jax_ep from this checkout.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
