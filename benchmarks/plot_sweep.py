"""python -m benchmarks.plot_sweep FILE.json --out PNG

The HT ops against tokens per rank, from the ``meta.sweep`` of one
``python -m jax_ep.bench --mode ht --sweep`` run (jax_ep/bench/ht.py: jax_ep, the
portable all_to_all path and the bare all_to_all at 128..8192 tokens per rank):
the time per call and DeepEP-counted GB/s (received bytes over the time), one line
per (op, system), jax_ep's solid. A point without a time (failed or below noise in
that run) is left out of its line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Mapping, Sequence

from benchmarks import medians

# One point of a line: (tokens per rank, us per call, GB/s or None).
Point = tuple[int, float, float | None]


def lines_of(sweep: Sequence[Mapping]) -> dict[str, list[Point]]:
  """{key "<op> <system>": its points with a time, by tokens} of a run's
  ``meta.sweep`` (medians.point_times' rules), keys in the run's order; keys
  without any time are left out. Raises ValueError for points written before
  the sweep kept ``us`` and ``gbps`` per key."""
  out: dict[str, list[Point]] = {}
  for point in sweep:
    if not isinstance(point.get("us"), Mapping):
      raise ValueError("a sweep point without its us per key (a file of an older form)")
    gbps = point.get("gbps") or {}
    for key, (us, _) in medians.point_times(point).items():
      line = out.setdefault(key, [])
      if us is not None:
        line.append((int(point["tokens"]), us, gbps.get(key)))
  return {key: sorted(line) for key, line in out.items() if line}


def draw(lines: Mapping[str, Sequence[Point]], title: str, path: str) -> None:
  """Writes the two panels (us per call, GB/s) of ``lines`` to the PNG at ``path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  if not lines:
    raise ValueError("no sweep point has a time")
  fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
  for key, points in lines.items():
    style = "-" if key.endswith("jax_ep") else "--"
    ax_t.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=key)
    rates = [p for p in points if p[2] is not None]
    ax_b.plot([p[0] for p in rates], [p[2] for p in rates], style, marker="o", label=key)
  for ax, label in ((ax_t, "us per call"), (ax_b, "GB/s (received bytes / time)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_file(path: str, out: str) -> dict[str, list[Point]]:
  """The chart of the sweep of the bench JSON at ``path``, written to ``out``;
  returns its lines. Raises ValueError where there is no sweep to draw."""
  with open(path) as f:
    data = json.load(f)
  sweep = data.get("meta", {}).get("sweep")
  if not sweep:
    raise ValueError(f"{path} holds no meta.sweep (python -m jax_ep.bench --mode ht --sweep)")
  lines = lines_of(sweep)
  machine = data.get("machine") or {}
  draw(lines, f"HT dispatch/combine against tokens per rank, EP{data['meta'].get('num_ranks')} "
       f"on {machine.get('device_count')}x {machine.get('device_kind')}, commit "
       f"{medians.commit_label(data)} ({data.get('date')})", out)
  return lines


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("file", help="the JSON of python -m jax_ep.bench --mode ht --sweep")
  parser.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)
  try:
    lines = plot_file(args.file, args.out)
  except ValueError as e:
    print(f"benchmarks.plot_sweep: {e}", file=sys.stderr)
    return 2
  print(f"benchmarks.plot_sweep: {args.out} ({len(lines)} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
