"""python -m jax_ep.bench.medians FILE.json [FILE.json ...] [--out SUMMARY.json]

The median over several bench runs (the JSONs of python -m jax_ep.bench) of
each (op, system) row's time: the published numbers and the targets are
medians of >= 5 runs, each run itself a median slope (timing.py). Prints one
line per row (median, min, max, runs) and, with --out, writes them with the
runs' files, commits, dates and machines. Runs of different commits, modes or
settings are refused: their medians would mix different code or problems.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Sequence

# Run settings that must agree between the runs of one median.
_SAME = ("mode", "ragged")
_SAME_META = ("tokens_per_rank", "hidden", "num_experts", "topk", "num_ranks", "num_calls",
              "repeats", "seed")


def _commit(run: dict) -> str:
  commit = run.get("commit", {})
  return f"{commit.get('short')}{' dirty' if commit.get('dirty') else ''}"


def summarize(runs: Sequence[dict], names: Sequence[str]) -> dict:
  """{rows: [{op, system, median_us, min_us, max_us, runs, us}], files, commit, ...}.

  ``runs``: the loaded JSONs, ``names`` their file names. A row that failed in
  a run is left out of that run's times (``failed_runs`` counts them); a time
  whose slope did not stand out of its noise stays in (``unstable_runs`` counts
  them: leaving them out would pick the runs).
  Raises ValueError when the runs are not of one commit, mode and settings."""
  if not runs:
    raise ValueError("no runs")
  first = runs[0]
  for name, run in zip(names, runs):
    differs = [k for k in _SAME if run.get(k) != first.get(k)]
    differs += [k for k in _SAME_META if run.get("meta", {}).get(k) != first.get("meta", {}).get(k)]
    if _commit(run) != _commit(first):
      differs.append("commit")
    if differs:
      raise ValueError(f"{name} differs from {names[0]} in {', '.join(differs)}: one median "
                       "needs runs of one commit, mode and settings")
  order: list[tuple[str, str]] = []
  times: dict[tuple[str, str], list[float]] = {}
  failed: dict[tuple[str, str], int] = {}
  unstable: dict[tuple[str, str], int] = {}
  for run in runs:
    for row in run.get("rows", []):
      key = (row["op"], row["system"])
      if key not in times:
        order.append(key)
        times[key], failed[key], unstable[key] = [], 0, 0
      if row.get("failed") or row.get("us") is None:
        failed[key] += 1
      else:
        times[key].append(float(row["us"]))
        unstable[key] += row.get("stable_slope") is False
  rows = []
  for key in order:
    us = times[key]
    rows.append(dict(op=key[0], system=key[1], runs=len(us), failed_runs=failed[key],
                     unstable_runs=unstable[key], us=us,
                     median_us=statistics.median(us) if us else None,
                     min_us=min(us) if us else None, max_us=max(us) if us else None))
  return dict(mode=first.get("mode"), commit=first.get("commit"),
              dates=sorted({run.get("date") for run in runs}),
              machines=sorted({json.dumps(run.get("machine"), sort_keys=True) for run in runs}),
              files=list(names), rows=rows)


def format_summary(summary: dict) -> str:
  lines = [f"medians of {len(summary['files'])} runs, mode {summary['mode']}, commit "
           f"{summary['commit'].get('short')} ({', '.join(summary['dates'])}):"]
  for row in summary["rows"]:
    if row["median_us"] is None:
      lines.append(f"  {row['op']:<44} {row['system']:<28} FAILED in every run")
      continue
    notes = "".join(f", {count} {what}" for count, what in (
        (row["failed_runs"], "failed"), (row.get("unstable_runs", 0), "with an unstable slope"))
        if count)
    lines.append(f"  {row['op']:<44} {row['system']:<28} {row['median_us']:9.1f} us  "
                 f"(min {row['min_us']:.1f}, max {row['max_us']:.1f}, {row['runs']} runs{notes})")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="+")
  parser.add_argument("--out", help="write the summary JSON here")
  args = parser.parse_args(argv)
  runs = []
  for path in args.files:
    with open(path) as f:
      runs.append(json.load(f))
  try:
    summary = summarize(runs, [os.path.basename(p) for p in args.files])
  except ValueError as e:
    print(f"jax_ep.bench.medians: {e}", file=sys.stderr)
    return 2
  print(format_summary(summary))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
