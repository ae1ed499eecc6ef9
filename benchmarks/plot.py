"""python -m benchmarks.plot FILE.json [FILE.json ...] --out PNG

A horizontal bar chart of each op's time, one bar per (op, system), each drawn
over its reference from the same runs:

  * at EP1 (one rank, every row local), the op's HBM floor: the "XLA (HBM
    floor)" row that moves its bytes (floors.FLOOR_OF), or the one-kernel floor
    for calls that move none;
  * at EP > 1, the bare all_to_all of the same payload (bare.py, "bare
    all_to_all BF16 / FP8" rows), for the ops that move rows.

The label of each bar gives its time and its ratio to the reference. A row
without a time says why (failed, below noise) instead of a bar. FILE.json: the
JSONs of python -m jax_ep.bench --mode ll or ht (which prints this command after
writing one); given several files of one mode, commit and settings, the times are
their medians (medians.summarize, which refuses a mix).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Iterable, Mapping, Sequence

from benchmarks import medians
from jax_ep.bench import floors

BARE_SYSTEM = "jax.lax.all_to_all"
BARE_OP = "bare all_to_all"
# The ops that move rows, by the payload of their bare exchange (ll.py, ht.py:
# the rows compared with the bare all_to_all in the bench's table).
BARE_PAYLOAD = {"LL dispatch FP8": "FP8", "LL dispatch BF16": "BF16", "LL combine BF16": "BF16",
                "LL combine BF16, pre-summed": "BF16", "HT dispatch BF16": "BF16",
                "HT dispatch FP8": "FP8", "HT combine BF16": "BF16"}


@dataclasses.dataclass(frozen=True)
class Bar:
  """One (op, system) of the chart.

  Attributes:
    op, system: as in the bench's rows.
    us: its time per call (> 0), or None.
    missing: why there is no time ("failed", "below noise"), else "".
  """

  op: str
  system: str
  us: float | None
  missing: str = ""


def bars_of_rows(rows: Iterable[Mapping]) -> list[Bar]:
  """Bars of one bench run's rows (Row.to_json() dicts: op, system, us, failed,
  below_noise)."""
  out = []
  for row in rows:
    us = row.get("us")
    ok = us is not None and us > 0 and not row.get("failed")
    missing = "" if ok else "failed" if row.get("failed") else "below noise"
    out.append(Bar(row["op"], row["system"], float(us) if ok else None, missing))
  return out


def bars_of_summary(summary: Mapping) -> list[Bar]:
  """Bars of a medians.summarize() result: each row's median over the runs."""
  out = []
  for row in summary["rows"]:
    us = row.get("median_us")
    missing = ("" if us is not None else
               "below noise" if row.get("below_noise_runs") and not row.get("failed_runs")
               else "failed")
    out.append(Bar(row["op"], row["system"], us, missing))
  return out


def is_reference(bar: Bar) -> bool:
  """Floors and bare exchanges are what the ops are read against, not ops."""
  return bar.system == floors.SYSTEM or bar.op.startswith(BARE_OP)


def reference(op: str, bars: Sequence[Bar], num_ranks: int) -> tuple[str, float | None] | None:
  """(label, time or None) of ``op``'s reference (module docstring); None where it
  has none (at EP > 1, ops that move no rows)."""
  if num_ranks == 1:
    name = floors.FLOOR_OF.get(op)
    found = [b for b in bars if b.system == floors.SYSTEM and b.op == name]
    label = f"floor: {name}"
  else:
    payload = BARE_PAYLOAD.get(op)
    name = payload and f"{BARE_OP} {payload}"
    found = [b for b in bars if name and b.op.startswith(name + " ")]
    label = f"bare all_to_all {payload}"
  if not name:
    return None
  return label, found[0].us if found else None


def _fmt(us: float) -> str:
  return f"{us:.1f} us" if us >= 1 else f"{us:.2f} us"


def draw(bars: Sequence[Bar], num_ranks: int, title: str, path: str) -> None:
  """Writes the chart of ``bars`` (a run's or the medians', every row of the bench:
  the reference rows are found among them) to the PNG at ``path``."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  ops = [b for b in bars if not is_reference(b)]
  if not ops:
    raise ValueError("no op rows to plot")
  refs = [reference(b.op, bars, num_ranks) for b in ops]
  known = [v for v in [b.us for b in ops] + [r[1] for r in refs if r] if v]
  lo, hi = (min(known), max(known)) if known else (1.0, 10.0)
  log = hi / lo > 20
  left = lo / 3 if log else 0.0
  systems = list(dict.fromkeys(b.system for b in ops))
  colors = {s: f"C{i % 10}" for i, s in enumerate(systems)}
  ref_name = "HBM floor (XLA, same run)" if num_ranks == 1 else "bare all_to_all (same payload)"

  fig, ax = plt.subplots(figsize=(13, 1.6 + 0.42 * len(ops)))
  ys = list(range(len(ops)))[::-1]  # the bench's order, top to bottom
  labelled = set()
  for y, bar, ref in zip(ys, ops, refs):
    ref_us = ref[1] if ref else None
    if ref_us:
      ax.barh(y, ref_us - left, left=left, height=0.8, color="0.85", edgecolor="0.6",
              label=ref_name if "ref" not in labelled else None)
      labelled.add("ref")
    if bar.us is not None:
      ax.barh(y, bar.us - left, left=left, height=0.45, color=colors[bar.system],
              label=bar.system if bar.system not in labelled else None)
      labelled.add(bar.system)
      text = _fmt(bar.us) + (f"  ({bar.us / ref_us:.2f}x {ref[0]})" if ref_us else
                             f"  ({ref[0]}: no time)" if ref else "")
      end = max(bar.us, ref_us or 0)
    else:
      text = bar.missing + (f"  ({ref[0]}: {_fmt(ref_us)})" if ref_us else "")
      end = max(left, ref_us or 0) if log else (ref_us or 0)
    ax.text(end * (1.08 if log else 1) + (0 if log else 0.01 * hi), y, text, va="center",
            fontsize=8)
  ax.set_yticks(ys)
  ax.set_yticklabels([f"{b.op}  [{b.system}]" for b in ops], fontsize=8)
  if log:
    ax.set_xscale("log")
    ax.set_xlim(left, hi * 400)  # room for the labels right of the longest bar
  else:
    ax.set_xlim(0, hi * 2.2)
  ax.set_xlabel("us per call" + (" (log scale)" if log else ""))
  ax.grid(True, axis="x", alpha=0.3)
  # Outside the axes, right of them: clear of every bar and label, however many rows.
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def title_of(mode: str | None, num_ranks: int, machine: str, commit: str, runs: int) -> str:
  against = "its HBM floor" if num_ranks == 1 else "the bare all_to_all of its payload"
  how = f"median of {runs} runs" if runs > 1 else "one run"
  return (f"jax_ep bench --mode {mode}, EP{num_ranks} on {machine}, commit {commit} ({how}):\n"
          f"each op's time against {against} (grey)")


def plot_files(paths: Sequence[str], path: str) -> dict:
  """The chart of the medians over the bench JSONs at ``paths`` (one mode, commit
  and settings); returns the summary. Raises ValueError as medians.summarize."""
  summary = medians.load(paths)
  machines = sorted({f"{m.get('device_count')}x {m.get('device_kind')}"
                     for m in (json.loads(text) or {} for text in summary["machines"])})
  num_ranks = int(summary.get("num_ranks") or 1)
  draw(bars_of_summary(summary), num_ranks,
       title_of(summary.get("mode"), num_ranks, ", ".join(machines),
                medians.commit_label(summary), len(summary["files"])), path)
  return summary


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="+", help="bench JSONs of one mode, commit and settings")
  parser.add_argument("--out", required=True, help="the PNG to write")
  args = parser.parse_args(argv)
  try:
    summary = plot_files(args.files, args.out)
  except ValueError as e:
    print(f"benchmarks.plot: {e}", file=sys.stderr)
    return 2
  print(f"benchmarks.plot: {args.out} ({len(summary['files'])} runs)")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
