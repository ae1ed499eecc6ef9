"""GPU tests: run under the launcher, one process per GPU:

    python -m jax_ep.launch -n 2 -m pytest tests/gpu

Every process runs the same tests in the same order (the ops are collective).
Skipped cleanly with fewer than 2 GPUs or without the launcher.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from jax_ep import launch  # noqa: E402

_LAUNCHED = launch.initialize_distributed_from_env()

import jax_ep  # noqa: E402
from gpu_testing import missing_gpus, skip_all  # noqa: E402


# Developers may run these tests' logic on CPU processes with the portable
# backend (JAX_EP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu); the kernels need GPUs.
ON_CPU = os.environ.get("JAX_EP_GPU_TESTS_ON_CPU") == "1"


def _skip_reason() -> str | None:
  if not _LAUNCHED:
    return "GPU tests run under `python -m jax_ep.launch -n 2 -m pytest tests/gpu`"
  if ON_CPU:
    return None
  return missing_gpus()


_SKIP = _skip_reason()


def pytest_collection_modifyitems(config, items):
  del config
  skip_all(items, _SKIP)


def pytest_report_header(config):
  del config
  return [f"jax_ep GPU tests: rank {os.environ.get('JAX_EP_RANK')}, "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          f"skip: {_SKIP}" if _SKIP else "GPUs available"]


@pytest.fixture(autouse=True)
def _reset_fault_status():
  yield
  state = jax_ep.runtime_state()
  if state is not None and state.cuda is not None:
    status = jax_ep.status()
    assert status["ok"], f"a jax_ep kernel recorded a fault: {status}"


def pytest_sessionfinish(session, exitstatus):
  """Every rank finalises (collective) once all tests ran."""
  del session, exitstatus
  if not _SKIP:
    jax_ep.finalize()
