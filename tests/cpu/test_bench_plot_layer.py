"""benchmarks/plot_layer.py: each system's useful TFLOP/s of one run of
python -m jax_ep.bench --mode layer (tests/cpu/test_bench_smoke.py draws a real one)."""

import json

from benchmarks import plot_layer

PNG = b"\x89PNG\r\n\x1a\n"


def _row(mode, system, tflops, error=None):
  return dict(mode=mode, system=system, us=None if tflops is None else 1.0, tflops=tflops,
              error=error)


def test_a_bar_without_a_time_says_why():
  assert plot_layer.label_of(_row("forward", "a", 412.4)) == "412"
  assert plot_layer.label_of(_row("forward", "a", None, "RESOURCE_EXHAUSTED")) == "failed"
  assert plot_layer.label_of(_row("forward", "a", None)) == "below noise"
  assert plot_layer.label_of(None) == "not run"
  assert plot_layer.label_of(_row("forward", "a", None, "not run (a flag runs it)")) == "not run"


def test_the_chart_is_written_and_other_modes_are_refused(tmp_path):
  rows = [_row("forward", "jax_ep.moe", 400.0), _row("forward_backward", "jax_ep.moe", 380.0),
          _row("forward", "MaxText", 250.0),
          _row("forward_backward", "MaxText", None, "RESOURCE_EXHAUSTED")]
  run = dict(mode="layer", rows=rows,
             meta=dict(tokens=4096, hidden=7168, ffn=2048, experts=32, topk=8))
  path, out = tmp_path / "layer.json", tmp_path / "layer.png"
  path.write_text(json.dumps(run))
  assert plot_layer.main([str(path), "--out", str(out)]) == 0
  assert out.read_bytes().startswith(PNG)
  path.write_text(json.dumps(dict(run, mode="gmm")))
  assert plot_layer.main([str(path), "--out", str(tmp_path / "no.png")]) == 2
  assert not (tmp_path / "no.png").exists()
