"""Shared start of the examples: without a GPU (and not under jax_ep.launch), run
on 8 CPU devices. Imported before jax; imports nothing that imports jax."""

import os
import sys


def use_cpu_devices_without_gpu(count: int = 8) -> None:
  if ("JAX_PLATFORMS" in os.environ or os.path.exists("/dev/nvidia0")
      or "JAX_EP_LAUNCHED" in os.environ):
    return
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={count}").strip()


# The examples import jax_ep from this checkout.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
