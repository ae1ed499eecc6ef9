"""pytest setup: 8 CPU devices and the fast-compile XLA flags (cpu_flags.py), set
before jax is imported anywhere."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
# This folder's helpers, the host oracle (tests/host_reference.py) and the
# repository root (benchmarks/), under pytest and under Bazel alike (its runner
# runs these files from the source tree).
sys.path[:0] = [_HERE, _TESTS, os.path.dirname(_TESTS)]

from cpu_flags import xla_flags  # noqa: E402  (before jax is imported)

os.environ["XLA_FLAGS"] = xla_flags(os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

import jax_ep  # noqa: E402


@pytest.fixture(autouse=True)
def _finalize_jax_ep():
  """Every test starts without jax_ep state."""
  yield
  jax_ep.finalize()
