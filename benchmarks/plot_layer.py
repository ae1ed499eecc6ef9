"""python -m benchmarks.plot_layer FILE.json --out PNG

The useful TFLOP/s of each system of one ``python -m jax_ep.bench --mode layer``
run (jax_ep/bench/layer.py: jax_ep's MoE layer, MaxText's algorithm on
jax.lax.ragged_dot and on grouped_matmul, and the dense floor), forward and
forward+backward side by side. A row without a time is a bar of 0 that says why
(failed, out of memory included, or below noise).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Mapping, Sequence

MODES = ("forward", "forward_backward")


def label_of(row: Mapping | None) -> str:
  """A bar's label: its TFLOP/s, or why it has none."""
  if row is None:
    return "not run"
  if row.get("tflops"):
    return f"{row['tflops']:.0f}"
  if str(row.get("error") or "").startswith("not run"):
    return "not run"
  return "failed" if row.get("error") else "below noise"


def draw(rows: Sequence[Mapping], meta: Mapping, path: str) -> None:
  """Writes the chart of a layer run's ``rows`` (dicts: mode, system, tflops or
  None, error or None) and ``meta`` (tokens, hidden, ffn, experts, topk) to the PNG
  at ``path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  systems = list(dict.fromkeys(r["system"] for r in rows))
  if not systems:
    raise ValueError("no rows to plot")
  fig, ax = plt.subplots(figsize=(10, 4.5))
  width = 0.8 / len(systems)
  for i, system in enumerate(systems):
    found = [next((r for r in rows if r["system"] == system and r["mode"] == mode), None)
             for mode in MODES]
    values = [(row or {}).get("tflops") or 0.0 for row in found]
    bars = ax.bar([m + i * width for m in range(len(MODES))], values, width, label=system)
    for bar, row in zip(bars, found):
      ax.annotate(label_of(row), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                  ha="center", va="bottom", fontsize=8)
  ax.set_xticks([m + width * (len(systems) - 1) / 2 for m in range(len(MODES))], MODES)
  ax.set_ylabel("useful TFLOP/s")
  ax.set_title(f"MoE layer, EP1: {meta['tokens']} tokens, H {meta['hidden']}, F {meta['ffn']}, "
               f"{meta['experts']} experts, top-{meta['topk']}, SwiGLU, bf16")
  ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_file(path: str, out: str) -> int:
  """The chart of the layer run's JSON at ``path``, written to ``out``; returns its
  rows' count. Raises ValueError for a JSON of another mode."""
  with open(path) as f:
    data = json.load(f)
  if data.get("mode") != "layer":
    raise ValueError(f"{path} is a run of --mode {data.get('mode')}, not --mode layer")
  draw(data["rows"], data["meta"], out)
  return len(data["rows"])


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("file", help="the JSON of python -m jax_ep.bench --mode layer")
  parser.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)
  try:
    count = plot_file(args.file, args.out)
  except ValueError as e:
    print(f"benchmarks.plot_layer: {e}", file=sys.stderr)
    return 2
  print(f"benchmarks.plot_layer: {args.out} ({count} rows)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
