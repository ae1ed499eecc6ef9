"""In-kernel profiles of the CUDA kernels (JAX_EP_PROFILE=1), read around a timing.

With JAX_EP_PROFILE=1, python -m benchmarks.probe runs the bench with
KernelProfileProbe. The counters (cuda/ep_types.h DeviceProfile; the runtime keeps
them only when the variable is set before jax_ep.initialize) are reset after the
warm-up and read after the timed executions, so they cover exactly the timed
calls (``meta.kernel_profile``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import numpy as np

import jax_ep

ENV = "JAX_EP_PROFILE"


def _cuda():
  state = jax_ep.runtime_state()
  cuda = state.cuda if state is not None else None
  return cuda if cuda is not None and os.environ.get(ENV) == "1" else None


def enabled() -> bool:
  """Whether the CUDA kernels run (jax_ep initialized on them) and JAX_EP_PROFILE=1
  asks for their profile."""
  return _cuda() is not None


def reset() -> None:
  """Zeroes the counters (reading them does)."""
  _cuda().read_profile()


def read() -> dict:
  """{kernel: {calls, kernel_us, wait_us[, gap_after_send_us]}} since the last reset,
  plus "timeline_us" (HT dispatch step medians) where the HT dispatch ran."""
  profile = _cuda().read_profile()
  trace = profile.pop("ht_trace", None)
  if trace is not None:
    profile["timeline_us"] = timeline(trace)
  return profile


def format_profile(profile: dict) -> str:
  kernels = "; ".join(
      f"{k} kernel {v['kernel_us']:.1f} wait {v['wait_us']:.1f}"
      + (f" gap {v['gap_after_send_us']:.1f}" if "gap_after_send_us" in v else "")
      for k, v in profile.items() if k != "timeline_us")
  if "timeline_us" in profile:
    kernels += "\n    timeline (medians): " + ", ".join(
        f"{k} {v:.1f}" for k, v in profile["timeline_us"].items())
  return kernels


def timeline(trace: list[list[int]]) -> dict[str, float]:
  """Median us of each step of an HT dispatch over the traced calls
  (DeviceProfile::ht_trace rows, events in cuda/ep_types.h HtTraceEvent order:
  start, masks, scan, plan built, counts in, send end, receive end, end).
  Medians, because the first call of each execution waits for the other
  process to launch it (milliseconds), which an average would spread over all.

  At one rank (ht_kernels.cu single_rank_plan) there is no count exchange:
  "masks" is block 0's pass over its own tokens (their rank masks and, expert-
  major, the ranking of their pairs from its first token), "scan" and
  "tile_bases" are about 0, and "count_exchange" is the wait for every block's
  count and the column sums of the blocks' pair counts. "send_role" runs from
  the start and holds the expert-major place_groups and the row stores."""
  rows = np.asarray(trace, dtype=np.int64)
  steps: dict[str, list[float]] = {}
  names = ("masks", "scan", "tile_bases", "count_exchange", "send_role", "recv_role", "kernel",
           "gap_to_next_call", "cycle")
  for i, row in enumerate(rows):
    nxt = rows[(i + 1) % len(rows)]
    if np.any(row == 0) or np.any(np.diff(row[[0, 1, 2, 3, 4, 7]]) < 0):
      continue
    values = [row[1] - row[0], row[2] - row[1], row[3] - row[2], row[4] - row[3],
              row[5] - row[0], row[6] - row[0], row[7] - row[0]]
    if nxt[0] > row[7]:
      values += [nxt[0] - row[7], nxt[0] - row[0]]
    for name, ns in zip(names, values):
      steps.setdefault(name, []).append(ns / 1e3)
  return {name: float(np.median(v)) for name, v in steps.items()}


@dataclasses.dataclass(frozen=True)
class KernelProfileProbe:
  """jax_ep.bench.measure.Probe: the in-kernel profile of the timed calls of each
  system that runs jax_ep's kernels; none where the CUDA kernels do not run."""

  key: str = "kernel_profile"
  title: str = "in-kernel profile (us per call)"
  kernels_only: bool = True

  def after_warmup(self) -> None:
    if enabled():
      reset()

  def after_timing(self, run_once: Callable[[], None], num_calls: int) -> dict | None:
    del run_once, num_calls  # the counters of the timed calls, nothing run again
    return read() if enabled() else None

  def format(self, result: dict) -> str:
    return format_profile(result)
