"""GPU tests: run under the launcher, one process per EP rank:

    python -m jax_ep.launch -n N -m pytest tests/gpu                   # N GPUs
    python -m jax_ep.launch -n N --devices 0,0,... -m pytest tests/gpu # N processes on one GPU

Every process runs the same tests in the same order (the ops are collective)
and checks its own results against the host oracle (gpu_testing). Skipped
cleanly without the launcher, without a GPU, or with fewer than 2 processes.
The 1000-call and 10,000-call tests carry those numbers in their names, so
`-k "not 1000_calls and not 10000_calls"` leaves them out.
"""

import os
import sys

import pytest

# This folder's helpers and the host oracle (tests/host_reference.py).
sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..")]

# XLA:GPU may keep an intermediate in float32 where the program rounds it to
# bfloat16 (excess precision, on by default); the host oracle rounds where the
# program says, so the tests ask XLA to do the same. Set before JAX's backends
# start.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_allow_excess_precision=false").strip()

from jax_ep import launch  # noqa: E402

_LAUNCHED = launch.initialize_distributed_from_env()

import jax_ep  # noqa: E402
from gpu_testing import ON_CPU, gpus_shared, missing_gpus, num_ranks, skip_all  # noqa: E402

GROUP_MESH_PROCESSES = (4, 8)  # test_groups_gpu.MESHES


def _skip_reason() -> str | None:
  if not _LAUNCHED:
    return "GPU tests run under `python -m jax_ep.launch -n 2 -m pytest tests/gpu`"
  if ON_CPU:
    return None
  return missing_gpus()


_SKIP = _skip_reason()


def pytest_ignore_collect(collection_path, config):
  """The remote-peer tests belong to that mode only (JAX_EP_TESTING_RDMA_PEERS set,
  tools/gpu_check.sh one-gpu rdma), and the EP-group tests to 4 or 8 processes
  (their meshes); elsewhere they are not collected at all (nothing skipped)."""
  del config
  if collection_path.name == "test_rdma_peers_gpu.py":
    return not os.environ.get("JAX_EP_TESTING_RDMA_PEERS")
  if collection_path.name == "test_groups_gpu.py":
    return not _LAUNCHED or num_ranks() not in GROUP_MESH_PROCESSES
  return None


def pytest_configure(config):
  config.addinivalue_line("markers", "kernels_only(why): deselected on CPU processes "
                          "(gpu_testing.kernels_only)")


def pytest_collection_modifyitems(config, items):
  if ON_CPU:  # the kernels' own behaviour: nothing to test on the portable backend
    deselected = [item for item in items if item.get_closest_marker("kernels_only")]
    if deselected:
      config.hook.pytest_deselected(items=deselected)
      items[:] = [item for item in items if item not in deselected]
  skip_all(items, _SKIP)


def pytest_report_header(config):
  del config
  mode = "CPU processes, portable backend" if ON_CPU else (
      "processes sharing one GPU" if gpus_shared() else "one GPU per process")
  return [f"jax_ep GPU tests: rank {os.environ.get('JAX_EP_RANK')} of "
          f"{os.environ.get('JAX_EP_NUM_PROCESSES')} ({mode}), "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          f"skip: {_SKIP}" if _SKIP else "devices available"]


@pytest.fixture(autouse=True)
def _reset_fault_status():
  yield
  state = jax_ep.runtime_state()
  if state is not None and state.cuda is not None:
    status = jax_ep.status()
    assert status["ok"], f"a jax_ep kernel recorded a fault: {status}"


def pytest_unconfigure(config):
  """Every rank finalises (collective) once all tests ran and were reported."""
  del config
  if not _SKIP:
    jax_ep.finalize()
