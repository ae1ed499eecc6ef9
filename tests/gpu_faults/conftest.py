"""Fault-injection tests: one rank skips a call (a simulated hang or crash).

Each test leaves its EP group out of step on purpose, so each runs in its own
launcher invocation (tools/gpu_check.sh does this):

    python -m jax_ep.launch -n 2 -m pytest tests/gpu_faults -k ll

Skipped without 2 GPUs, and on CPU processes: the portable backend's exchange is
an XLA collective, which would simply wait for the missing rank.
"""

import os
import sys

# tests/gpu's helpers and the host oracle they use (tests/host_reference.py).
sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "gpu"),
                os.path.join(os.path.dirname(__file__), "..")]

from jax_ep import launch  # noqa: E402

_LAUNCHED = launch.initialize_distributed_from_env()

from gpu_testing import missing_gpus, skip_all  # noqa: E402


def _skip_reason() -> str | None:
  if not _LAUNCHED:
    return "run under `python -m jax_ep.launch -n 2 -m pytest tests/gpu_faults -k <test>`"
  if os.environ.get("JAX_EP_GPU_TESTS_ON_CPU") == "1":
    return "the portable backend cannot survive a missing rank (XLA collectives wait)"
  return missing_gpus()


_SKIP = _skip_reason()


def pytest_collection_modifyitems(config, items):
  del config
  skip_all(items, _SKIP)
