"""jax_ep joining an NVSHMEM runtime that nvshmem4py started in the same processes.

One launcher run (nvshmem4py must start NVSHMEM before jax_ep does):

    python -m jax_ep.launch -n 2 [--devices 0,0] -m pytest tests/gpu_nvshmem4py

Skipped without the launcher, GPUs or the nvshmem4py-cu13 package (the GPU
machine lacks it: tools/gpu_check.sh one-gpu nvshmem4py installs the carried
wheel).
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
    return "run under `python -m jax_ep.launch -n 2 -m pytest tests/gpu_nvshmem4py`"
  if os.environ.get("JAX_EP_GPU_TESTS_ON_CPU") == "1":
    return "nvshmem4py needs GPUs"
  try:
    import nvshmem.core  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    return f"nvshmem4py is not installed ({e}); carry the nvshmem4py-cu13 wheel"
  return missing_gpus()


_SKIP = _skip_reason()


def pytest_collection_modifyitems(config, items):
  del config
  skip_all(items, _SKIP)
