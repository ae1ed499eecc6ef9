"""The timeline summary of benchmarks/gpu_timeline.py: busy, idle and span per call
from synthetic profile planes, a real profile of a CPU loop, and its probe."""

import dataclasses

import jax
import numpy as np
import pytest

from benchmarks import gpu_timeline
from jax_ep.bench import timing


@dataclasses.dataclass
class Event:
  name: str
  start_ns: int
  duration_ns: int


@dataclasses.dataclass
class Line:
  name: str
  events: list


@dataclasses.dataclass
class Plane:
  name: str
  lines: list


def test_busy_is_the_union_of_kernels_and_idle_the_rest_of_the_span():
  # Two calls on two streams: kernels [0, 4) and [2, 6) overlap (busy 6 us),
  # then a 3 us gap, then [9, 10): span 10 us, busy 7, idle 3.
  us = 1000
  stream = Line("Stream #13(compute)", [Event("ll_dispatch<true, 3, true>", 0, 4 * us),
                                        Event("loop_add_fusion.12", 9 * us, 1 * us)])
  other = Line("Stream #14(compute)", [Event("ll_dispatch<true, 3, true>", 2 * us, 4 * us)])
  derived = Line("XLA Ops", [Event("custom-call.3", 0, 100 * us)])  # a view, not a stream
  host = Plane("/host:CPU", [Line("thread", [Event("CommandBufferThunk", 0, 5 * us),
                                             Event("CommandBufferThunk", 6 * us, 1 * us),
                                             Event("ParseArguments", 0, 1 * us),
                                             Event("$timing.py:149 <lambda>", 0, 50 * us)])])
  summary = gpu_timeline.summarize([Plane("/device:GPU:0", [stream, other, derived]), host],
                                   num_calls=2)
  assert summary["kernels_per_call"] == 1.5
  assert summary["busy_us_per_call"] == pytest.approx(3.5)
  assert summary["span_us_per_call"] == pytest.approx(5.0)
  assert summary["idle_us_per_call"] == pytest.approx(1.5)
  assert summary["kernels"]["ll_dispatch<true, 3, true>"] == dict(count=2, median_us=4.0)
  assert summary["kernels"]["loop_add_fusion"] == dict(count=1, median_us=1.0)
  assert "custom-call" not in summary["kernels"]
  # Host events add up under one name, per call, largest first; Python frames
  # ("$file:line") are left out.
  assert list(summary["host"]) == ["CommandBufferThunk", "ParseArguments"]
  assert summary["host"]["CommandBufferThunk"] == dict(count=2, us_per_call=3.0)
  assert "idle 1.50 us" in gpu_timeline.format_summary(summary)


def test_a_trace_without_device_events_says_so():
  summary = gpu_timeline.summarize([Plane("/host:CPU", [Line("t", [Event("a.1", 0, 10)])])], 1)
  assert "busy_us_per_call" not in summary
  assert gpu_timeline.format_summary(summary).startswith("no device events")


def _cpu_loop():
  """run_once of an 8-call loop on one CPU device, compiled and run once."""
  mesh = jax.make_mesh((1,), ("ep",))
  loop = timing.executable(lambda r: (r + 1,), mesh, 8)
  routing = timing.global_array(mesh, np.zeros((4, 2), np.int32))
  jax.block_until_ready(loop(routing))
  return lambda: jax.block_until_ready(loop(routing))


def test_record_profiles_one_execution_of_a_cpu_loop():
  summary = gpu_timeline.record(_cpu_loop(), 8)
  assert summary["calls"] == 8
  # The CPU runtime's own events are there; every add of the loop under one name.
  assert any(h["count"] >= 8 for h in summary["host"].values()), summary["host"]


def test_the_probe_keeps_every_systems_timeline_under_meta_timeline():
  """TimelineProbe (jax_ep.bench.measure.Probe): every system, not only jax_ep's
  kernels; the timeline of one more execution after the timing."""
  probe = gpu_timeline.TimelineProbe()
  assert (probe.key, probe.kernels_only) == ("timeline", False)
  probe.after_warmup()
  summary = probe.after_timing(_cpu_loop(), 8)
  assert summary["calls"] == 8 and probe.format(summary) == gpu_timeline.format_summary(summary)


def test_enabled_by_the_environment(monkeypatch):
  monkeypatch.delenv(gpu_timeline.ENV, raising=False)
  assert not gpu_timeline.enabled()
  monkeypatch.setenv(gpu_timeline.ENV, "1")
  assert gpu_timeline.enabled()
