"""Where a timed loop's time goes: its device and host timeline (JAX_EP_TIMELINE=1).

The slope (jax_ep/bench/timing.py) says how long a call takes, not where the
time goes. With JAX_EP_TIMELINE=1, python -m benchmarks.probe runs the bench with
TimelineProbe: every row runs its long executable once more under JAX's profiler
(CUPTI on GPUs) and keeps a summary of that one execution (``meta.timeline``):

  * device: per kernel name (XLA's instance numbers dropped), its count and
    median duration; the busy time (the union of all kernel intervals) and the
    span (first kernel start to last kernel end), each per call; span - busy is
    time the GPU sat idle between kernels (launch gaps, host-bound stretches);
  * host: the trace's host events with the largest total time, per call:
    the runtime's (XLA's thunk and command-buffer events; jax_ep's handlers
    show up as custom-call thunks when they are not inside a command buffer),
    not the Python tracer's "$file:line" frames.

The profiler adds its own cost per kernel and per host event, so the timeline
explains a row; it does not replace its slope.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import statistics
import tempfile
from typing import Callable, Iterable

ENV = "JAX_EP_TIMELINE"
TOP_HOST_EVENTS = 16


def enabled() -> bool:
  """Whether JAX_EP_TIMELINE=1 asks for timelines."""
  return os.environ.get(ENV) == "1"


def _union_ns(intervals: list[tuple[int, int]]) -> int:
  """Total length of the union of [start, end) intervals (ns)."""
  total, reach = 0, None
  for start, end in sorted(intervals):
    if reach is None or start > reach:
      total += end - start
      reach = end
    elif end > reach:
      total += end - reach
      reach = end
  return total


def _kind(name: str) -> str:
  """An event's name without XLA's instance numbers ("add_fusion.12" -> "add_fusion"),
  so that the calls of one op add up under one name."""
  return re.sub(r"([._]\d+)+$", "", name)


def _is_device_plane(name: str) -> bool:
  return name.startswith("/device:GPU") or name.startswith("/device:TPU")


def summarize(planes: Iterable, num_calls: int) -> dict:
  """The summary (module docstring) of profile ``planes`` (jax.profiler
  ProfilePlane-like: .name, .lines[.name, .events[.name, .start_ns, .duration_ns]])
  of a trace that held one execution of ``num_calls`` calls and nothing else."""
  kernels: dict[str, list[float]] = {}
  intervals: list[tuple[int, int]] = []
  host: dict[str, float] = {}
  host_count: dict[str, int] = {}
  device_lines: list[str] = []
  for plane in planes:
    device = _is_device_plane(plane.name)
    for line in plane.lines:
      if device:
        # Per-stream lines hold the kernels; "XLA Ops"/"XLA Modules" are
        # derived views of the same time.
        if not line.name.startswith("Stream"):
          continue
        device_lines.append(f"{plane.name} {line.name}")
      for event in line.events:
        start, duration = int(event.start_ns), int(event.duration_ns)
        name = _kind(event.name)
        if device:
          kernels.setdefault(name, []).append(duration / 1e3)
          intervals.append((start, start + duration))
        elif not event.name.startswith("$"):  # Python frames: the caller, not the runtime
          host[name] = host.get(name, 0.0) + duration / 1e3
          host_count[name] = host_count.get(name, 0) + 1
  calls = max(num_calls, 1)
  summary: dict = dict(calls=num_calls, device_lines=device_lines)
  if intervals:
    span_ns = max(e for _, e in intervals) - min(s for s, _ in intervals)
    busy_ns = _union_ns(intervals)
    summary.update(
        kernels_per_call=len(intervals) / calls,
        busy_us_per_call=busy_ns / 1e3 / calls,
        span_us_per_call=span_ns / 1e3 / calls,
        idle_us_per_call=(span_ns - busy_ns) / 1e3 / calls)
  summary["kernels"] = {
      name: dict(count=len(d), median_us=statistics.median(d))
      for name, d in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))}
  top = sorted(host.items(), key=lambda kv: -kv[1])[:TOP_HOST_EVENTS]
  summary["host"] = {name: dict(count=host_count[name], us_per_call=total / calls)
                     for name, total in top}
  return summary


def record(run_once: Callable[[], None], num_calls: int) -> dict:
  """Runs ``run_once()`` (one execution of the warmed-up ``num_calls``-call
  executable, until its result exists) under JAX's profiler; its summary. The
  trace goes to a temporary directory and is read back from its XSpace file."""
  import jax.profiler  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory(prefix="jax_ep_timeline_") as log_dir:
    jax.profiler.start_trace(log_dir)
    try:
      run_once()
    finally:
      jax.profiler.stop_trace()
    traces = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    if len(traces) != 1:
      raise RuntimeError(f"expected one profiler trace under {log_dir}, found {traces}")
    data = jax.profiler.ProfileData.from_file(traces[0])
  return summarize(data.planes, num_calls)


def format_summary(summary: dict) -> str:
  """One line: per call busy / idle / span, the largest kernels and host events."""
  host = ", ".join(f"{name[:40]} {h['us_per_call']:.2f} us"
                   for name, h in list(summary["host"].items())[:3])
  if "busy_us_per_call" not in summary:
    return f"no device events; host: {host}"
  kernels = ", ".join(f"{name[:60]} x{k['count']} {k['median_us']:.2f} us"
                      for name, k in list(summary["kernels"].items())[:4])
  return (f"{summary['kernels_per_call']:.1f} kernels/call, busy "
          f"{summary['busy_us_per_call']:.2f} us, idle {summary['idle_us_per_call']:.2f} us, "
          f"span {summary['span_us_per_call']:.2f} us per call; {kernels}; host: {host}")


@dataclasses.dataclass(frozen=True)
class TimelineProbe:
  """jax_ep.bench.measure.Probe: every system's timeline (record), after its timing."""

  key: str = "timeline"
  title: str = "timeline (per call)"
  kernels_only: bool = False

  def after_warmup(self) -> None:
    """Nothing to reset: the timeline is of an execution of its own."""

  def after_timing(self, run_once: Callable[[], None], num_calls: int) -> dict:
    return record(run_once, num_calls)

  def format(self, result: dict) -> str:
    return format_summary(result)
