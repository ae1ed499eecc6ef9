"""benchmarks/plot_sweep.py: the HT ops against tokens per rank, from the meta.sweep of
one run of python -m jax_ep.bench --mode ht --sweep."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import plot_sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"
OURS, PORTABLE = "dispatch BF16 jax_ep", "dispatch BF16 portable"


def _point(tokens, ours, portable, errors=(), below_noise=()):
  """A sweep point as jax_ep/bench/ht.py's _point writes it."""
  us = {OURS: ours, PORTABLE: portable}
  return dict(tokens=tokens, num_sms=None, us=us,
              gbps={k: None if v is None else tokens / v for k, v in us.items()},
              errors={k: "RuntimeError: boom" for k in errors}, below_noise=list(below_noise))


def _run():
  """The portable path failed at 256 tokens and was below noise at 128."""
  sweep = [_point(512, 30.0, 90.0), _point(128, 10.0, None, below_noise=[PORTABLE]),
           _point(256, 20.0, None, errors=[PORTABLE])]
  return dict(mode="ht", ragged=False, commit=dict(short="abc1234", dirty=False),
              date="2026-12-04T10:00:00", machine=dict(device_kind="NVIDIA H200", device_count=2),
              meta=dict(num_ranks=2, tokens_per_rank=4096, sweep=sweep), rows=[])


def test_each_line_holds_the_points_with_a_time_by_tokens():
  lines = plot_sweep.lines_of(_run()["meta"]["sweep"])
  assert lines == {OURS: [(128, 10.0, 12.8), (256, 20.0, 12.8), (512, 30.0, 512 / 30.0)],
                   PORTABLE: [(512, 90.0, 512 / 90.0)]}
  nothing = [_point(128, None, None, errors=[OURS, PORTABLE])]
  assert plot_sweep.lines_of(nothing) == {}


def test_points_of_an_older_form_are_refused():
  with pytest.raises(ValueError, match="older form"):
    plot_sweep.lines_of([{"tokens": 128, OURS: 42.0}])


def test_the_command_line_writes_the_chart_and_refuses_a_run_without_a_sweep(tmp_path):
  path, out = tmp_path / "ht.json", tmp_path / "sweep.png"
  path.write_text(json.dumps(_run()))
  result = subprocess.run([sys.executable, "-m", "benchmarks.plot_sweep", str(path), "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and "(2 lines)" in result.stdout, result.stdout + result.stderr
  assert out.read_bytes().startswith(PNG)
  run = _run()
  del run["meta"]["sweep"]
  path.write_text(json.dumps(run))
  assert plot_sweep.main([str(path), "--out", str(tmp_path / "no.png")]) == 2
  assert not (tmp_path / "no.png").exists()
