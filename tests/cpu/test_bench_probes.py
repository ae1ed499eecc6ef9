"""The bench's probes (jax_ep.bench.measure.Probe): a Runner calls them around each
timing and keeps their results; benchmarks/probe.py picks them from the environment
and runs the bench with them, whose JSON then holds their results and names it."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np

from benchmarks import gpu_timeline, kernel_profile, probe
from jax_ep.bench import measure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--tokens", "16", "--hidden", "256", "--num_experts", "8", "--topk", "2",
        "--num_calls", "2", "--repeats", "1", "--warmup_calls", "2"]


@dataclasses.dataclass
class _Recording:
  """A probe that logs its calls into ``log`` and returns ``result``."""

  key: str
  kernels_only: bool
  log: list
  result: dict | None
  title: str = "recording"

  def after_warmup(self) -> None:
    self.log.append((self.key, "after_warmup"))

  def after_timing(self, run_once, num_calls):
    run_once()  # the long executable runs once more where a probe asks
    self.log.append((self.key, "after_timing", num_calls))
    return self.result

  def format(self, result: dict) -> str:
    return f"n={result['n']}"


def test_runner_calls_its_probes_in_order_and_keeps_what_they_return(capsys):
  log: list = []
  kernels = _Recording("kernels", True, log, dict(n=1))
  every = _Recording("every", False, log, dict(n=2))
  silent = _Recording("silent", False, log, None)
  runner = measure.Runner(jax.make_mesh((1,), ("ep",)), num_calls=2, repeats=1,
                          context="t=4 ", warmup_calls=2, probes=(kernels, every, silent))
  args = [np.zeros((4, 2), np.int32)]
  assert runner.time("plain", lambda r: (r + 1,), args).error is None
  assert log == [("every", "after_warmup"), ("silent", "after_warmup"),
                 ("every", "after_timing", 2), ("silent", "after_timing", 2)]
  log.clear()
  assert runner.time("kernels", lambda r: (r + 1,), args, profile=True).error is None
  assert [entry[:2] for entry in log] == [
      ("kernels", "after_warmup"), ("every", "after_warmup"), ("silent", "after_warmup"),
      ("kernels", "after_timing"), ("every", "after_timing"), ("silent", "after_timing")]
  # A probe with nothing to say (None) gets no entry.
  assert runner.probed == {"kernels": {"t=4 kernels": dict(n=1)},
                           "every": {"t=4 plain": dict(n=2), "t=4 kernels": dict(n=2)}}
  assert "recording rank 0: t=4 kernels: n=1" in capsys.readouterr().out


def test_a_single_shot_timing_has_no_probe():
  log: list = []
  runner = measure.Runner(jax.make_mesh((1,), ("ep",)), num_calls=3, repeats=1,
                          probes=(_Recording("every", False, log, dict(n=0)),))
  outcome = runner.time("once", lambda r: (r + 1,), [np.zeros((4, 2), np.int32)],
                        single_shot=True)
  assert outcome.error is None and log == [] and runner.probed == {}


def test_the_environment_picks_the_probes_the_kernel_profile_first(monkeypatch):
  monkeypatch.delenv(kernel_profile.ENV, raising=False)
  monkeypatch.delenv(gpu_timeline.ENV, raising=False)
  assert probe.from_env() == []
  monkeypatch.setenv(gpu_timeline.ENV, "1")
  monkeypatch.setenv(kernel_profile.ENV, "1")
  assert [type(p) for p in probe.from_env()] == [kernel_profile.KernelProfileProbe,
                                                 gpu_timeline.TimelineProbe]


def test_the_kernel_profile_has_nothing_without_the_cuda_kernels(monkeypatch):
  """On the portable backend (or before initialize) there is no profile to read."""
  monkeypatch.setenv(kernel_profile.ENV, "1")
  found = kernel_profile.KernelProfileProbe()
  assert (found.key, found.kernels_only) == ("kernel_profile", True)
  found.after_warmup()
  assert found.after_timing(lambda: None, 2) is None


def test_the_bench_with_the_timeline_probe_keeps_each_systems_timeline(tmp_path):
  """python -m benchmarks.probe with JAX_EP_TIMELINE=1, one process of 8 CPU devices:
  the JSON's meta.timeline has every system's timeline, its command names the probe
  module and its environment the variable; the lines follow the table."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_EP_TIMELINE="1",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env.pop(kernel_profile.ENV, None)
  out = tmp_path / "ll.json"
  result = subprocess.run([sys.executable, "-m", "benchmarks.probe", "--mode", "ll",
                           "--nobaselines", *TINY, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  data = json.loads(out.read_text())
  timelines = data["meta"]["timeline"]
  # jax_ep's systems and the others alike (kernels_only is False).
  assert {"LL dispatch FP8, jax_ep", "bare all_to_all BF16"} <= set(timelines), sorted(timelines)
  assert all(summary["calls"] == 2 for summary in timelines.values())
  assert "kernel_profile" not in data["meta"]
  assert data["command"].startswith("python -m benchmarks.probe --mode ll")
  assert data["environment"]["JAX_EP_TIMELINE"] == "1"
  table = result.stdout[result.stdout.index("us/call"):]
  assert "timeline (per call) (rank 0): LL dispatch FP8, jax_ep: " in table


def test_the_probe_module_asks_for_help_with_the_bench_flags():
  result = subprocess.run([sys.executable, "-m", "benchmarks.probe", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "JAX_EP_TIMELINE=1" in result.stdout and "--mode" in result.stdout


def test_a_one_device_timing_runs_its_probes_after_the_timed_executions():
  """single_device.measure (the gmm and layer modes): each probe gets the long
  executable (num_calls calls) after the timing; a None result leaves no entry."""
  from jax_ep.bench import single_device  # pylint: disable=import-outside-toplevel
  log: list = []
  every = _Recording("every", False, log, dict(n=3))
  silent = _Recording("silent", False, log, None)
  measured = single_device.measure(lambda a: a * 2, (np.ones((8, 8), np.float32),),
                                   num_calls=4, repeats=1, warmup_calls=1,
                                   probes=(every, silent))
  assert measured.error is None, measured.error
  assert log == [("every", "after_warmup"), ("silent", "after_warmup"),
                 ("every", "after_timing", 4), ("silent", "after_timing", 4)]
  assert measured.probed == {"every": dict(n=3)}


def test_the_layer_bench_with_the_timeline_probe_keeps_each_rows_timeline(tmp_path):
  """python -m benchmarks.probe --mode layer with JAX_EP_TIMELINE=1 on CPU: every
  timed row's timeline under meta.timeline, by "mode: system"."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_EP_TIMELINE="1")
  env.pop(kernel_profile.ENV, None)
  out = tmp_path / "layer.json"
  result = subprocess.run(
      [sys.executable, "-m", "benchmarks.probe", "--mode", "layer", "--tokens", "16",
       "--hidden", "128", "--ffn", "64", "--num_experts", "4", "--topk", "2", "--repeats",
       "1", "--nolayer_lax_forward", "--out", str(out)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  data = json.loads(out.read_text())
  # A row below the harness's noise has no time but ran, and was looked at.
  timed = {f"{row['mode']}: {row['system']}" for row in data["rows"] if row["us"] is not None}
  ran = {f"{row['mode']}: {row['system']}" for row in data["rows"] if row["error"] is None}
  assert timed and timed <= set(data["meta"]["timeline"]) <= ran
  assert all(summary["calls"] == 5 for summary in data["meta"]["timeline"].values())
  assert "  timeline: " in result.stdout
