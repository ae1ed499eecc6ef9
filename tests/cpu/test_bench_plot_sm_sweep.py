"""benchmarks/plot_sm_sweep.py: the jax_ep HT ops' time against their SM budget, from
the medians of runs or one run, with the per-SM copy ceilings and the targets."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import medians, plot_sm_sweep

# The charts need matplotlib (requirements-dev.txt); the arithmetic does not.
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="the charts need matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"
BF16, FP8, COMBINE = "dispatch BF16 jax_ep", "dispatch FP8 jax_ep", "combine BF16 jax_ep"
BUDGETS = (4, 6, 8, 12)


def _run(i):
  """A bench run of --mode ht --sm_sweep 4,6,8,12: one FP8 point failed in run 1,
  one combine point below noise in run 2."""
  points = []
  for n in BUDGETS:
    us = {BF16: 4000.0 / n + i, FP8: 2500.0 / n + i, COMBINE: 3800.0 / n + i}
    errors, noise = {}, []
    if i == 1 and n == 6:
      us[FP8], errors[FP8] = None, "RuntimeError: boom"
    if i == 2 and n == 12:
      us[COMBINE] = None
      noise.append(COMBINE)
    points.append(dict(tokens=4096, num_sms=n, us=us, gbps={k: None for k in us},
                       errors=errors, below_noise=noise))
  return dict(mode="ht", ragged=False, commit=dict(short="abc1234", dirty=False),
              date=f"2026-12-04T10:0{i}:00",
              machine=dict(device_kind="NVIDIA H200", device_count=1),
              meta=dict(tokens_per_rank=4096, hidden=7168, num_ranks=1, sm_sweep=points),
              rows=[dict(op="HT dispatch BF16", system="jax_ep", us=80.0)])


def _ceilings():
  """An sm_bandwidth.cu JSON: tma_copy faster than copy at 6 SMs only, a wrong
  copy at 8 (left out), read faster than both (not a copy), no grid 12."""
  results = []
  for grid in (1, 4, 6, 8, 16):
    copy = 1000.0 / grid
    results += [dict(design="copy", grid=grid, us=copy, correct=True),
                dict(design="tma_copy", grid=grid, us=copy * (0.9 if grid == 6 else 1.1),
                     correct=True),
                dict(design="read", grid=grid, us=copy / 4, correct=True)]
  results.append(dict(design="copy", grid=8, us=1.0, correct=False))
  return dict(mode="sm-bandwidth", rows=4096, row_bytes=14336, results=results)


def test_the_ceiling_is_the_copy_scaled_to_the_ops_row_bytes():
  assert plot_sm_sweep.row_bytes(BF16, 7168) == 14336
  assert plot_sm_sweep.row_bytes(COMBINE, 7168) == 14336
  assert plot_sm_sweep.row_bytes(FP8, 7168) == 7168 + 224
  assert plot_sm_sweep.row_bytes(FP8, 4096) == 4096 + 128
  assert plot_sm_sweep.row_bytes("get_dispatch_layout jax_ep", 7168) is None
  assert plot_sm_sweep.ceiling_us(200.0, 14336) == 200.0
  assert plot_sm_sweep.ceiling_us(200.0, 7392) == pytest.approx(200.0 * 7392 / 14336)
  assert plot_sm_sweep.ceiling_us(200.0, 7392) == pytest.approx(103.125)
  # Twice the tokens of the copy's rows: twice the time.
  assert plot_sm_sweep.ceiling_us(200.0, 14336, tokens=8192) == pytest.approx(400.0)


def test_the_ceiling_takes_the_fastest_correct_copy_at_each_grid():
  times = plot_sm_sweep.copy_times(_ceilings())
  assert times == pytest.approx({1: 1000.0, 4: 250.0, 6: 1000.0 / 6 * 0.9, 8: 125.0, 16: 62.5})
  lines = plot_sm_sweep.ceilings_of(_ceilings(), [BF16, FP8, "other jax_ep"], 7168, 4096,
                                    BUDGETS)
  assert set(lines) == {BF16, FP8}
  # Only the file's grids, within the sweep's budgets 4..12: not 1, 16 or 12.
  assert [n for n, _ in lines[BF16]] == [4, 6, 8]
  assert [us for _, us in lines[BF16]] == pytest.approx([250.0, 150.0, 125.0])
  assert [us for _, us in lines[FP8]] == pytest.approx(
      [us * 7392 / 14336 for us in (250.0, 150.0, 125.0)])


def test_points_of_the_medians_and_of_one_run():
  runs = [_run(i) for i in range(3)]
  summary = medians.summarize(runs, ["r0", "r1", "r2"])
  points = {(p.key, p.num_sms): p for p in plot_sm_sweep.points_of(summary)}
  six = points[(FP8, 6)]
  assert six.us == pytest.approx(2500.0 / 6 + 1) and six.runs == 2
  assert (six.min_us, six.max_us) == pytest.approx((2500.0 / 6, 2500.0 / 6 + 2))
  assert six.left_out == "1 failed"
  assert points[(COMBINE, 12)].left_out == "1 below noise"
  one = {(p.key, p.num_sms): p for p in plot_sm_sweep.points_of(runs[1])}
  assert one[(FP8, 6)].us is None and one[(FP8, 6)].left_out == "failed"
  assert one[(BF16, 8)].us == one[(BF16, 8)].min_us == pytest.approx(501.0)
  with pytest.raises(ValueError, match="no meta.sm_sweep"):
    plot_sm_sweep.points_of(dict(meta={}, rows=[]))
  with pytest.raises(ValueError, match="no sm_sweep"):
    plot_sm_sweep.points_of(medians.summarize([_run(0) | dict(meta={})], ["r0"]))


def test_a_point_without_a_time_in_every_run_says_why():
  runs = [_run(1), _run(1)]
  summary = medians.summarize(runs, ["a", "b"])
  points = {(p.key, p.num_sms): p for p in plot_sm_sweep.points_of(summary)}
  assert points[(FP8, 6)].us is None and points[(FP8, 6)].left_out == "failed"


@needs_matplotlib
@pytest.mark.parametrize("ceilings", [False, True])
@pytest.mark.parametrize("form", ["medians", "run"])
def test_the_chart_is_written(tmp_path, form, ceilings):
  runs = [_run(i) for i in range(3)]
  data = medians.summarize(runs, ["r0", "r1", "r2"]) if form == "medians" else runs[1]
  path = tmp_path / "in.json"
  path.write_text(json.dumps(data))
  argv = [str(path), "--out", str(tmp_path / "sm.png"), "--targets"]
  if ceilings:
    (tmp_path / "ceilings.json").write_text(json.dumps(_ceilings()))
    argv += ["--ceilings", str(tmp_path / "ceilings.json")]
  assert plot_sm_sweep.main(argv) == 0
  data = (tmp_path / "sm.png").read_bytes()
  assert data.startswith(PNG) and len(data) > 10_000


def test_title_names_machine_commit_and_dates():
  runs = [_run(i) for i in range(2)]
  title = plot_sm_sweep.title_of(medians.summarize(runs, ["r0", "r1"]))
  assert "1x NVIDIA H200" in title and "abc1234" in title
  assert "2026-12-04T10:00:00 to 2026-12-04T10:01:00" in title and "of 2 runs" in title
  title = plot_sm_sweep.title_of(runs[1])
  assert "abc1234" in title and "2026-12-04T10:01:00" in title and "one run" in title


@needs_matplotlib
def test_the_command_line(tmp_path):
  """python -m benchmarks.medians --out, then python -m benchmarks.plot_sm_sweep;
  a file without an SM sweep is refused."""
  paths = []
  for i in range(3):
    paths.append(tmp_path / f"ht_{i}.json")
    paths[-1].write_text(json.dumps(_run(i)))
  summary = tmp_path / "medians.json"
  ceilings = tmp_path / "ceilings.json"
  ceilings.write_text(json.dumps(_ceilings()))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "benchmarks.medians", *map(str, paths),
                           "--out", str(summary)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  out = tmp_path / "sm.png"
  result = subprocess.run([sys.executable, "-m", "benchmarks.plot_sm_sweep", str(summary),
                           "--ceilings", str(ceilings), "--out", str(out), "--targets"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert out.read_bytes().startswith(PNG)
  result = subprocess.run([sys.executable, "-m", "benchmarks.plot_sm_sweep", str(ceilings),
                           "--out", str(tmp_path / "no.png")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 2 and "no meta.sm_sweep" in result.stderr, result.stderr
  assert not (tmp_path / "no.png").exists()
