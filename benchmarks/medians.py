"""python -m benchmarks.medians FILE.json [FILE.json ...] [--out SUMMARY.json]

The median over several bench runs (the JSONs of python -m jax_ep.bench) of
each (op, system) row's time: the published numbers and the targets are
medians of >= 5 runs, each run itself a median slope (timing.py). Prints one
line per row (median, min, max, runs) and, with --out, writes them with the
runs' files, commits, dates and machines. Runs of different commits, modes or
settings are refused: their medians would mix different code or problems.

Only times enter a median: a row that failed in a run, or whose time there was
below noise (``below_noise``, or a time that is not positive, as files written
before that rule hold), is left out of that run's times and counted.

Runs of ``--mode ht --sm_sweep N,...`` carry the jax_ep ops' times at each SM
budget (``meta.sm_sweep``, jax_ep/bench/ht.py's _point): the summary's
``sm_sweep`` holds their medians by the same rules, one entry per budget (the
runs must have swept the same budgets), printed after the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Mapping, Sequence

# Run settings that must agree between the runs of one median.
_SAME = ("mode", "ragged")
_SAME_META = ("tokens_per_rank", "hidden", "num_experts", "topk", "num_ranks", "num_calls",
              "repeats", "seed")


def commit_label(run: dict) -> str:
  """The run's commit as '<short>' or '<short> dirty'."""
  commit = run.get("commit", {})
  return f"{commit.get('short')}{' dirty' if commit.get('dirty') else ''}"


def _stats(us: Sequence[float]) -> dict:
  """median_us, min_us, max_us of ``us`` (None each when there is no time)."""
  return dict(median_us=statistics.median(us) if us else None,
              min_us=min(us) if us else None, max_us=max(us) if us else None)


def point_times(point: Mapping) -> dict[str, tuple[float | None, str]]:
  """{key: (us, "") or (None, "failed" | "below noise")} of one ``meta.sm_sweep``
  point, keys "<op> <system>" as jax_ep/bench/ht.py's _point writes them.

  The rules of the rows: a key with an error, or without a time and not said to be
  below noise, failed; one said to be below noise, or whose time is not positive,
  is below noise. Points of files written before _point's form hold the times
  beside ``num_sms`` (None where there was none: counted as failed)."""
  if isinstance(point.get("us"), Mapping):
    times = point["us"]
    errors = point.get("errors") or {}
    noise = set(point.get("below_noise") or ())
  else:
    times = {k: v for k, v in point.items() if k not in ("tokens", "num_sms")}
    errors, noise = {}, set()
  out: dict[str, tuple[float | None, str]] = {}
  for key, us in times.items():
    if key in errors or (us is None and key not in noise):
      out[key] = (None, "failed")
    elif us is None or not float(us) > 0:
      out[key] = (None, "below noise")
    else:
      out[key] = (float(us), "")
  return out


def summarize_sm_sweep(runs: Sequence[dict], names: Sequence[str]) -> list[dict] | None:
  """[{num_sms, ops: [{key, median_us, min_us, max_us, runs, us, failed_runs,
  below_noise_runs}]}] over the runs' ``meta.sm_sweep`` (point_times' rules: a
  key that failed or was below noise in a run is left out of that run's times and
  counted), in the runs' order of budgets and keys; None when no run has one.
  Raises ValueError when the runs did not sweep the same list of num_sms."""
  sweeps = [run.get("meta", {}).get("sm_sweep") or [] for run in runs]
  if not any(sweeps):
    return None
  budgets = [[point.get("num_sms") for point in sweep] for sweep in sweeps]
  for name, these in zip(names, budgets):
    if these != budgets[0]:
      raise ValueError(f"{name} swept num_sms {these or 'none'}, {names[0]} "
                       f"{budgets[0] or 'none'}: the SM sweep's medians need runs of one "
                       "list of num_sms")
  out = []
  for i, num_sms in enumerate(budgets[0]):
    order: list[str] = []
    times: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    below_noise: dict[str, int] = {}
    for sweep in sweeps:
      for key, (us, missing) in point_times(sweep[i]).items():
        if key not in times:
          order.append(key)
          times[key], failed[key], below_noise[key] = [], 0, 0
        if missing == "failed":
          failed[key] += 1
        elif missing:
          below_noise[key] += 1
        else:
          times[key].append(us)
    out.append(dict(num_sms=num_sms, ops=[
        dict(key=key, runs=len(times[key]), failed_runs=failed[key],
             below_noise_runs=below_noise[key], us=times[key], **_stats(times[key]))
        for key in order]))
  return out


def _row_op(row: Mapping, name: str) -> str:
  """The row's op: ``op``, or ``name`` in files written before 2026-12-01 (the
  2026-11-30 JSONs in docs/results). Raises ValueError when it has neither."""
  op = row.get("op", row.get("name"))
  if op is None:
    raise ValueError(f"{name}: a row without an op or name: {sorted(row)}")
  return op


def summarize(runs: Sequence[dict], names: Sequence[str]) -> dict:
  """{rows: [{op, system, median_us, min_us, max_us, runs, us, ...}], files, commit,
  num_ranks, tokens_per_rank, hidden, ..., and sm_sweep (summarize_sm_sweep) when
  the runs carry one}.

  ``runs``: the loaded JSONs, ``names`` their file names. A row that failed in
  a run is left out of that run's times (``failed_runs`` counts them), and so is
  one below noise there (``below_noise_runs``: no time, or one that is not
  positive); a positive time whose slope did not stand out of its noise stays in
  (``unstable_runs`` counts them: leaving them out would pick the runs).
  Raises ValueError when the runs are not of one commit, mode and settings, or
  did not sweep the same SM budgets."""
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
  for name, run in zip(names, runs):
    for row in run.get("rows", []):
      key = (_row_op(row, name), row["system"])
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
                     **_stats(us)))
  meta = first.get("meta", {})
  summary = dict(mode=first.get("mode"), commit=first.get("commit"),
                 num_ranks=meta.get("num_ranks"), tokens_per_rank=meta.get("tokens_per_rank"),
                 hidden=meta.get("hidden"),
                 dates=sorted({run.get("date") for run in runs}),
                 machines=sorted({json.dumps(run.get("machine"), sort_keys=True)
                                  for run in runs}),
                 files=list(names), rows=rows)
  sm_sweep = summarize_sm_sweep(runs, names)
  if sm_sweep is not None:
    summary["sm_sweep"] = sm_sweep
  return summary


def _times_text(entry: Mapping) -> str:
  """A row's or an SM sweep op's median, min, max and counts, or why it has no time."""
  if entry["median_us"] is None:
    return ("FAILED in every run" if not entry.get("below_noise_runs") else
            "below noise in every run" if not entry["failed_runs"] else
            f"no time: {entry['failed_runs']} failed, {entry['below_noise_runs']} below noise")
  notes = "".join(f", {count} {what}" for count, what in (
      (entry["failed_runs"], "failed"), (entry.get("below_noise_runs", 0), "below noise"),
      (entry.get("unstable_runs", 0), "with an unstable slope")) if count)
  return (f"{entry['median_us']:9.1f} us  (min {entry['min_us']:.1f}, max "
          f"{entry['max_us']:.1f}, {entry['runs']} runs{notes})")


def format_summary(summary: dict) -> str:
  """One line per row, then one per (SM budget, key) of the SM sweep."""
  lines = [f"medians of {len(summary['files'])} runs, mode {summary['mode']}, commit "
           f"{summary['commit'].get('short')} ({', '.join(summary['dates'])}):"]
  for row in summary["rows"]:
    lines.append(f"  {row['op']:<44} {row['system']:<28} {_times_text(row)}")
  for point in summary.get("sm_sweep", []):
    for op in point["ops"]:
      lines.append(f"  SM budget {point['num_sms']:<4} {op['key']:<58} {_times_text(op)}")
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
    print(f"benchmarks.medians: {e}", file=sys.stderr)
    return 2
  print(format_summary(summary))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(summary, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
