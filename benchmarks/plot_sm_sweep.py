"""python -m benchmarks.plot_sm_sweep FILE.json [--ceilings JSON] --out PNG [--targets]

The jax_ep HT ops' time against their SM budget (EpGroup.num_sms), from the
``sm_sweep`` of python -m jax_ep.bench --mode ht --sm_sweep N,...:

  * FILE.json: the medians of several runs (python -m benchmarks.medians
    --out, its ``sm_sweep``: median markers, min-max error bars), or one bench
    run's JSON (its ``meta.sm_sweep``: that run's times);
  * --ceilings: the per-SM copy ceiling of each op, dashed: the fastest of the
    "copy" and "tma_copy" designs of tools/sm_bandwidth.cu at each of its grids
    (one block per SM) within the sweep's budgets, scaled to the op's bytes per
    token row and its tokens (ceiling_us); ops of one row size share one line;
  * --targets: the targets at few SMs (TARGETS), as open triangles.

A point without a time (failed or below noise in every run) is marked at the
foot of the chart with why; the runs left out of a median are written beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Mapping, Sequence

from benchmarks import medians

SYSTEM = "jax_ep"
# The sm_bandwidth.cu designs that copy the rows (loads and stores of one SM).
CEILING_DESIGNS = ("copy", "tma_copy")
DEFAULT_HIDDEN = 7168
# The targets at few SMs: {sweep key: {num_sms: us at most}}.
TARGETS = {"dispatch BF16 jax_ep": {6: 125.0, 8: 95.0},
           "combine BF16 jax_ep": {6: 125.0, 8: 95.0},
           "dispatch FP8 jax_ep": {6: 85.0}}


@dataclasses.dataclass(frozen=True)
class Point:
  """One (key, SM budget) of the chart.

  Attributes:
    key: the sweep's key, "<op> jax_ep".
    num_sms: the SM budget.
    us: the median (or the one run's time), > 0; None when there is none.
    min_us, max_us: the spread over the runs (= us for one run); None without us.
    runs: the runs with a time.
    left_out: "2 failed, 1 below noise" of the runs without one; for a point
      without a time, why ("failed", "below noise").
  """

  key: str
  num_sms: int
  us: float | None
  min_us: float | None = None
  max_us: float | None = None
  runs: int = 1
  left_out: str = ""


def _left_out(failed: int, below_noise: int) -> str:
  return ", ".join(f"{count} {what}" for count, what in
                   ((failed, "failed"), (below_noise, "below noise")) if count)


def points_of_summary(summary: Mapping) -> list[Point]:
  """Points of a medians.summarize() result's ``sm_sweep``."""
  out = []
  for point in summary["sm_sweep"]:
    for op in point["ops"]:
      failed, noise = op.get("failed_runs", 0), op.get("below_noise_runs", 0)
      if op.get("median_us") is None:
        why = ("below noise" if noise and not failed else "failed" if not noise else
               _left_out(failed, noise))
        out.append(Point(op["key"], int(point["num_sms"]), None, runs=0, left_out=why))
      else:
        out.append(Point(op["key"], int(point["num_sms"]), float(op["median_us"]),
                         float(op["min_us"]), float(op["max_us"]), int(op["runs"]),
                         _left_out(failed, noise)))
  return out


def points_of_run(payload: Mapping) -> list[Point]:
  """Points of one bench run's ``meta.sm_sweep`` (medians.point_times' rules)."""
  out = []
  for point in payload["meta"]["sm_sweep"]:
    for key, (us, missing) in medians.point_times(point).items():
      out.append(Point(key, int(point["num_sms"]), us, us, us, 0 if us is None else 1,
                       missing))
  return out


def row_bytes(key: str, hidden: int) -> int | None:
  """Bytes of one token row the op moves: BF16 rows hidden * 2, FP8 rows hidden
  e4m3 bytes plus hidden / 128 float32 scales; None for an op of neither."""
  if "FP8" in key:
    return hidden + hidden // 128 * 4
  if "BF16" in key:
    return hidden * 2
  return None


def copy_times(ceilings: Mapping) -> dict[int, float]:
  """{grid: us}: the fastest correct CEILING_DESIGNS time at each grid of an
  sm_bandwidth.cu JSON (its ``rows`` rows of ``row_bytes`` bytes)."""
  out: dict[int, float] = {}
  for result in ceilings.get("results", []):
    us = result.get("us")
    if (result.get("design") not in CEILING_DESIGNS or result.get("correct") is False
        or us is None or not us > 0):
      continue
    grid = int(result["grid"])
    out[grid] = min(out.get(grid, float(us)), float(us))
  return out


def ceiling_us(copy_us: float, op_row_bytes: int, ceiling_row_bytes: int = 14336,
               ceiling_rows: int = 4096, tokens: int | None = None) -> float:
  """The time of the copy of ``tokens`` rows of ``op_row_bytes`` bytes at the per-SM
  bandwidth of a copy of ``ceiling_rows`` rows of ``ceiling_row_bytes`` bytes that
  took ``copy_us``: copy_us * op_row_bytes / ceiling_row_bytes (* tokens /
  ceiling_rows; tokens None: as many rows as the copy)."""
  rows = ceiling_rows if tokens is None else tokens
  return copy_us * (op_row_bytes / ceiling_row_bytes) * (rows / ceiling_rows)


def ceilings_of(ceilings: Mapping, keys: Sequence[str], hidden: int, tokens: int | None,
                budgets: Sequence[int]) -> dict[str, list[tuple[int, float]]]:
  """{key: [(grid, ceiling us)]} of each key with a row size (row_bytes), at the
  ceilings file's grids from the least to the most SMs of ``budgets``."""
  times = copy_times(ceilings)
  lo, hi = min(budgets), max(budgets)
  rows = int(ceilings.get("rows", 4096))
  size = int(ceilings.get("row_bytes", 14336))
  out = {}
  for key in keys:
    nbytes = row_bytes(key, hidden)
    if nbytes is None:
      continue
    out[key] = [(grid, ceiling_us(us, nbytes, size, rows, tokens))
                for grid, us in sorted(times.items()) if lo <= grid <= hi]
  return out


def draw(points: Sequence[Point], title: str, path: str,
         ceilings: Mapping[str, Sequence[tuple[int, float]]] | None = None,
         targets: bool = False) -> None:
  """Writes the chart of ``points`` (jax_ep keys only) to the PNG at ``path``, with
  the dashed ``ceilings`` ({key: [(num_sms, us)]}) and, with ``targets``, the
  TARGETS of the keys drawn."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  from matplotlib import ticker  # pylint: disable=import-outside-toplevel

  points = [p for p in points if p.key.endswith(" " + SYSTEM)]
  if not points:
    raise ValueError("no jax_ep points in the SM sweep")
  keys = list(dict.fromkeys(p.key for p in points))
  colors = {key: f"C{i % 10}" for i, key in enumerate(keys)}
  budgets = sorted({p.num_sms for p in points})
  fig, ax = plt.subplots(figsize=(10, 6))
  handles: dict[str, list] = {"ops": [], "ceilings": [], "targets": []}
  for key in keys:
    timed = sorted((p for p in points if p.key == key and p.us is not None),
                   key=lambda p: p.num_sms)
    if timed:
      spread = [[p.us - p.min_us for p in timed], [p.max_us - p.us for p in timed]]
      handles["ops"].append(ax.errorbar(
          [p.num_sms for p in timed], [p.us for p in timed],
          yerr=spread if any(p.runs > 1 for p in timed) else None, fmt="o-",
          color=colors[key], capsize=3, label=key))
    for p in (p for p in points if p.key == key and p.us is None):
      ax.plot([p.num_sms], [0.02], "x", color=colors[key], transform=ax.get_xaxis_transform(),
              clip_on=False)
      ax.annotate(f"{key}: {p.left_out}", (p.num_sms, 0.02), xycoords=ax.get_xaxis_transform(),
                  textcoords="offset points", xytext=(5, 3 + 9 * keys.index(key)), fontsize=7,
                  color=colors[key])
  for n in budgets:  # each time's label, above its point or below where it is the lower
    here = sorted((p for p in points if p.num_sms == n and p.us is not None),
                  key=lambda p: -p.us)
    for i, p in enumerate(here):
      ax.annotate(f"{p.us:.0f}" + (f" ({p.left_out})" if p.left_out else ""), (n, p.us),
                  textcoords="offset points", xytext=(5, 4 if i % 2 == 0 else -11), fontsize=7,
                  color=colors[p.key])
  # Ops of one row size have one ceiling: one line for them all.
  lines: dict[tuple, list[str]] = {}
  for key, line in (ceilings or {}).items():
    if line and key in colors:
      lines.setdefault(tuple(line), []).append(key)
  for line, of in lines.items():
    (handle,) = ax.plot([n for n, _ in line], [us for _, us in line], "--", marker=".",
                        color=colors[of[0]] if len(of) == 1 else "0.35", alpha=0.8,
                        label=f"per-SM copy ceiling: {', '.join(of)}")
    handles["ceilings"].append(handle)
  if targets:
    drawn = [key for key in keys if key in TARGETS]
    labelled: set[tuple[int, float]] = set()
    for i, key in enumerate(drawn):
      shift = 0.12 * (i - (len(drawn) - 1) / 2)  # the targets at one budget side by side
      for n, us in sorted(TARGETS[key].items()):
        (handle,) = ax.plot([n + shift], [us], "v", markersize=10, markerfacecolor="none",
                            markeredgecolor=colors[key], markeredgewidth=1.8, linestyle="none",
                            label=f"target (at most): {key}")
        if n == min(TARGETS[key]):
          handles["targets"].append(handle)
        if (n, us) not in labelled:
          labelled.add((n, us))
          ax.annotate(f"<={us:.0f}", (n, us), textcoords="offset points", xytext=(-12, -16),
                      fontsize=7, color="0.2")
  ax.set_yscale("log")
  ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
  ax.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda v, _: f"{v:.0f}"))
  ax.tick_params(axis="y", which="minor", labelsize=7)
  ticks = sorted(set(budgets) | {n for key in keys if targets for n in TARGETS.get(key, {})})
  if len(ticks) <= 16:
    ax.set_xticks(ticks)
  ax.set_xlabel("SMs (EpGroup.num_sms)")
  ax.set_ylabel("us per call (log scale)")
  ax.grid(True, which="both", alpha=0.3)
  legend = handles["ops"] + handles["ceilings"] + handles["targets"]
  if legend:
    ax.legend(handles=legend, fontsize=8)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _machine(machine: Mapping | None) -> str:
  machine = machine or {}
  return f"{machine.get('device_count')}x {machine.get('device_kind')}"


def title_of(data: Mapping) -> str:
  """Machine(s), commit, date(s) and settings of a medians summary or a bench run."""
  if "files" in data:
    machines = ", ".join(sorted({_machine(json.loads(m)) for m in data.get("machines", [])}))
    dates = [d for d in data.get("dates", []) if d]
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "?"
    runs = len(data["files"])
    how = f"median, min and max of {runs} runs" if runs > 1 else "one run"
    tokens, hidden = data.get("tokens_per_rank"), data.get("hidden")
    num_ranks = data.get("num_ranks")
  else:
    meta = data.get("meta", {})
    machines, when, how = _machine(data.get("machine")), data.get("date"), "one run"
    tokens, hidden, num_ranks = meta.get("tokens_per_rank"), meta.get("hidden"), meta.get(
        "num_ranks")
  return (f"jax_ep HT ops against their SM budget, EP{num_ranks}, {tokens} tokens per rank, "
          f"hidden {hidden or DEFAULT_HIDDEN}\n{machines}, commit {medians.commit_label(data)}, "
          f"{when} ({how})")


def points_of(data: Mapping) -> list[Point]:
  """Points of a medians summary (its ``sm_sweep``) or of one bench run (its
  ``meta.sm_sweep``). Raises ValueError when it has no SM sweep."""
  if "files" in data:
    if not data.get("sm_sweep"):
      raise ValueError("the medians hold no sm_sweep (runs of --mode ht --sm_sweep N,...)")
    return points_of_summary(data)
  if not data.get("meta", {}).get("sm_sweep"):
    raise ValueError("the run holds no meta.sm_sweep (python -m jax_ep.bench --mode ht "
                     "--sm_sweep N,...)")
  return points_of_run(data)


def plot_file(path: str, out: str, ceilings_path: str | None = None,
              targets: bool = False) -> list[Point]:
  """The chart of the medians or bench JSON at ``path`` (with the ceilings of the
  sm_bandwidth.cu JSON at ``ceilings_path``) written to ``out``; returns its
  points. Raises ValueError where there is nothing to draw."""
  with open(path) as f:
    data = json.load(f)
  points = points_of(data)
  settings = data if "files" in data else data.get("meta", {})
  hidden = int(settings.get("hidden") or DEFAULT_HIDDEN)
  tokens = settings.get("tokens_per_rank")
  ceilings = None
  if ceilings_path:
    with open(ceilings_path) as f:
      ceiling_data = json.load(f)
    if not copy_times(ceiling_data):
      raise ValueError(f"{ceilings_path} holds no correct {' or '.join(CEILING_DESIGNS)} time")
    ceilings = ceilings_of(ceiling_data, list(dict.fromkeys(p.key for p in points)), hidden,
                           int(tokens) if tokens else None, [p.num_sms for p in points])
  draw(points, title_of(data), out, ceilings, targets)
  return points


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("file", help="a medians JSON (benchmarks.medians --out) or one "
                      "bench JSON, of --mode ht --sm_sweep")
  parser.add_argument("--ceilings", help="an sm_bandwidth.cu JSON: draw the per-SM copy "
                      "ceilings")
  parser.add_argument("--out", required=True, help="the PNG to write")
  parser.add_argument("--targets", action="store_true", help="draw the targets at few SMs")
  args = parser.parse_args(argv)
  try:
    points = plot_file(args.file, args.out, args.ceilings, args.targets)
  except ValueError as e:
    print(f"benchmarks.plot_sm_sweep: {e}", file=sys.stderr)
    return 2
  print(f"benchmarks.plot_sm_sweep: {args.out} ({len(points)} points)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
