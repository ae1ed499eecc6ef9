"""python -m benchmarks.probe [the flags of python -m jax_ep.bench]: the bench with probes.

The bench (python -m jax_ep.bench) times and writes its JSON; this runs it with
what looks inside each timing (jax_ep.bench.measure.Probe), as the environment
asks (the JSON's ``environment`` records it):

  * JAX_EP_PROFILE=1: the CUDA kernels' in-kernel profile of the timed calls of
    each jax_ep system (kernel_profile.py), in ``meta.kernel_profile``. The
    kernels measure with their profiling stores on: time with it off;
  * JAX_EP_TIMELINE=1: every system's device and host timeline, from one more
    execution of its long loop under JAX's profiler (gpu_timeline.py), in
    ``meta.timeline``.

Each result is printed as it comes and again after the table. Without either
variable this is the bench. Under the launcher too, from the repository's root:
``JAX_EP_TIMELINE=1 python -m jax_ep.launch -n 2 -m benchmarks.probe --mode ll``.
"""

from __future__ import annotations

import os

from benchmarks import gpu_timeline, kernel_profile
from jax_ep.bench import __main__ as bench
from jax_ep.bench import measure


def from_env() -> list[measure.Probe]:
  """The probes the environment asks for. The in-kernel profile comes first: it is
  read before the timeline's extra execution runs the kernels again."""
  probes: list[measure.Probe] = []
  if os.environ.get(kernel_profile.ENV) == "1":
    probes.append(kernel_profile.KernelProfileProbe())
  if gpu_timeline.enabled():
    probes.append(gpu_timeline.TimelineProbe())
  return probes


def main(argv: list[str]) -> int:
  return bench.main(argv, run_as="benchmarks.probe", probes=from_env())


if __name__ == "__main__":
  bench.cli(main, __doc__ or "")
