"""python -m jax_ep.bench.medians FILE.json [FILE.json ...] [--out SUMMARY.json]

The median over several bench runs (the JSONs of python -m jax_ep.bench) of
each (op, system) row's time: the published numbers and the targets are
medians of >= 5 runs, each run itself a median slope (timing.py). Prints one
line per row (median, min, max, runs) and, with --out, writes them with the
runs' files, commits, dates and machines. Runs of different commits, modes or
settings are refused: their medians would mix different code or problems.

Only times enter a median: a row that failed in a run, or whose time there was
below noise (``below_noise``, or a time that is not positive, as files written
before that rule hold), is left out of that run's times and counted.
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


def commit_label(run: dict) -> str:
  """The run's commit as '<short>' or '<short> dirty'."""
  commit = run.get("commit", {})
  return f"{commit.get('short')}{' dirty' if commit.get('dirty') else ''}"


def summarize(runs: Sequence[dict], names: Sequence[str]) -> dict:
  """{rows: [{op, system, median_us, min_us, max_us, runs, us, ...}], files, commit,
  num_ranks, ...}.

  ``runs``: the loaded JSONs, ``names`` their file names. A row that failed in
  a run is left out of that run's times (``failed_runs`` counts them), and so is
  one below noise there (``below_noise_runs``: no time, or one that is not
  positive); a positive time whose slope did not stand out of its noise stays in
  (``unstable_runs`` counts them: leaving them out would pick the runs).
  Raises ValueError when the runs are not of one commit, mode and settings."""
  if not runs:
    raise ValueError("no runs")
  first = runs[0]
  for name, run in zip(names, runs):
    differs = [k for k in _SAME if run.get(k) != first.get(k)]
    differs += [k for k in _SAME_META if run.get("meta", {}).get(k) != first.get("meta", {}).get(k)]
    if commit_label(run) != commit_label(first):
      differs.append("commit")
    if differs:
      raise ValueError(f"{name} differs from {names[0]} in {', '.join(differs)}: one median "
                       "needs runs of one commit, mode and settings")
  order: list[tuple[str, str]] = []
  times: dict[tuple[str, str], list[float]] = {}
  failed: dict[tuple[str, str], int] = {}
  below_noise: dict[tuple[str, str], int] = {}
  unstable: dict[tuple[str, str], int] = {}
  for run in runs:
    for row in run.get("rows", []):
      key = (row["op"], row["system"])
      if key not in times:
        order.append(key)
        times[key], failed[key], below_noise[key], unstable[key] = [], 0, 0, 0
      us = row.get("us")
      if row.get("failed") or (us is None and not row.get("below_noise")):
        failed[key] += 1
      elif us is None or not float(us) > 0:
        below_noise[key] += 1
      else:
        times[key].append(float(us))
        unstable[key] += row.get("stable_slope") is False
  rows = []
  for key in order:
    us = times[key]
    rows.append(dict(op=key[0], system=key[1], runs=len(us), failed_runs=failed[key],
                     below_noise_runs=below_noise[key], unstable_runs=unstable[key], us=us,
                     median_us=statistics.median(us) if us else None,
                     min_us=min(us) if us else None, max_us=max(us) if us else None))
  return dict(mode=first.get("mode"), commit=first.get("commit"),
              num_ranks=first.get("meta", {}).get("num_ranks"),
              dates=sorted({run.get("date") for run in runs}),
              machines=sorted({json.dumps(run.get("machine"), sort_keys=True) for run in runs}),
              files=list(names), rows=rows)


def format_summary(summary: dict) -> str:
  lines = [f"medians of {len(summary['files'])} runs, mode {summary['mode']}, commit "
           f"{summary['commit'].get('short')} ({', '.join(summary['dates'])}):"]
  for row in summary["rows"]:
    if row["median_us"] is None:
      what = ("FAILED in every run" if not row.get("below_noise_runs") else
              "below noise in every run" if not row["failed_runs"] else
              f"no time: {row['failed_runs']} failed, {row['below_noise_runs']} below noise")
      lines.append(f"  {row['op']:<44} {row['system']:<28} {what}")
      continue
    notes = "".join(f", {count} {what}" for count, what in (
        (row["failed_runs"], "failed"), (row.get("below_noise_runs", 0), "below noise"),
        (row.get("unstable_runs", 0), "with an unstable slope")) if count)
    lines.append(f"  {row['op']:<44} {row['system']:<28} {row['median_us']:9.1f} us  "
                 f"(min {row['min_us']:.1f}, max {row['max_us']:.1f}, {row['runs']} runs{notes})")
  return "\n".join(lines)


def load(paths: Sequence[str]) -> dict:
  """summarize() of the bench JSONs at ``paths`` (named by their file names).
  Raises ValueError as summarize does."""
  runs = []
  for path in paths:
    with open(path) as f:
      runs.append(json.load(f))
  return summarize(runs, [os.path.basename(p) for p in paths])


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="+")
  parser.add_argument("--out", help="write the summary JSON here")
  args = parser.parse_args(argv)
  try:
    summary = load(args.files)
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
