"""pytest setup: 8 CPU devices, set before jax is imported anywhere."""

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

import jax_ep  # noqa: E402


@pytest.fixture(autouse=True)
def _finalize_jax_ep():
  """Every test starts without jax_ep state."""
  yield
  jax_ep.finalize()
