"""python -m benchmarks.compare --base A.json [...] --head B.json [...] [--tolerance 0.03]

Two commits' bench medians side by side: each side is several runs of one
commit (benchmarks.medians rules), the two sides of one mode and settings.
Prints one line per (op, system) row: the base's and the head's median, the
ratio head / base, and SLOWER where the head's median is more than
``tolerance`` over the base's. Exit status 1 when a row is SLOWER or lost its
time, 2 when the runs cannot be compared.

It is how a change that should not move the kernels is checked ("the EP1 medians
stay within 3% of the previous commit's"): both commits built and run in one
device call, alternately (tools/gpu_check.sh one-gpu ep1compare), so machine and
clocks are the same for both.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from benchmarks import medians



def compare(base: dict, head: dict, tolerance: float) -> dict:
  """{rows: [{op, system, base_us, head_us, ratio, slower}], base, head, tolerance}
  from two medians.summarize() results. Raises ValueError when their modes or
  settings differ."""
  differs = [k for k in ("mode", "num_ranks", "tokens_per_rank", "hidden")
             if base.get(k) != head.get(k)]
  if differs:
    raise ValueError(f"the two sides differ in {', '.join(differs)}: nothing to compare")
  head_rows = {(r["op"], r["system"]): r for r in head["rows"]}
  rows = []
  for row in base["rows"]:
    key = (row["op"], row["system"])
    other = head_rows.pop(key, None)
    base_us = row["median_us"]
    head_us = other["median_us"] if other else None
    ratio = head_us / base_us if base_us and head_us else None
    lost = base_us is not None and head_us is None
    rows.append(dict(op=key[0], system=key[1], base_us=base_us, head_us=head_us, ratio=ratio,
                     slower=bool(ratio is not None and ratio > 1.0 + tolerance),
                     lost=lost))
  for key, other in head_rows.items():     # rows only the head has
    rows.append(dict(op=key[0], system=key[1], base_us=None, head_us=other["median_us"],
                     ratio=None, slower=False, lost=False))
  return dict(tolerance=tolerance, base=dict(commit=base["commit"], files=base["files"]),
              head=dict(commit=head["commit"], files=head["files"]), rows=rows)


def _us(value: float | None) -> str:
  return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def format_comparison(result: dict) -> str:
  base, head = result["base"], result["head"]
  lines = [f"base {base['commit'].get('short')} ({len(base['files'])} runs) vs head "
           f"{head['commit'].get('short')} ({len(head['files'])} runs), medians in us, "
           f"SLOWER: more than {result['tolerance']:.0%} over the base"]
  for row in result["rows"]:
    ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "  -  "
    flag = "SLOWER" if row["slower"] else "NO TIME IN HEAD" if row["lost"] else ""
    lines.append(f"  {row['op']:<44} {row['system']:<28} {_us(row['base_us'])} "
                 f"{_us(row['head_us'])}  {ratio}  {flag}")
  return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--base", nargs="+", required=True, help="the base commit's bench JSONs")
  parser.add_argument("--head", nargs="+", required=True, help="the head commit's bench JSONs")
  parser.add_argument("--tolerance", type=float, default=0.03,
                      help="a head median more than this fraction over the base's is SLOWER")
  parser.add_argument("--out", help="write the comparison JSON here")
  args = parser.parse_args(argv)
  try:
    result = compare(medians.load(args.base), medians.load(args.head), args.tolerance)
  except ValueError as e:
    print(f"benchmarks.compare: {e}", file=sys.stderr)
    return 2
  print(format_comparison(result))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)
  return 1 if any(r["slower"] or r["lost"] for r in result["rows"]) else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
