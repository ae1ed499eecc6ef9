"""The results table: one Row per (op, system), FAILED rows included; JSON output.

The rule of the output: a time is a positive number of microseconds. A system
that failed has no time (FAILED and its error); one whose slope was not
positive has none either (below noise, measure.py): the table prints words
there, and the JSON has ``us: null`` with ``failed`` or ``below_noise`` true.
"""

from __future__ import annotations

import dataclasses
import json
import math

from jax_ep.bench import traffic as traffic_lib
from jax_ep.bench.timing import slope_is_stable

TABLE_ERROR_CHARS = 100
# Widths of the table's op and system columns (the layout rows' names fit).
OP_COLUMN = 38
SYSTEM_COLUMN = 30


@dataclasses.dataclass(frozen=True)
class Row:
  """One line of the results table.

  Attributes:
    op: what was timed, e.g. "HT dispatch FP8".
    system: who did it, e.g. "jax_ep (cuda backend)", "all_to_all (portable)".
    us: per-call microseconds, the maximum over ranks, > 0; None when it failed
      or was below noise.
    error: why the system failed (on which rank, the exception's text), else None.
    traffic: bytes per call (jax_ep/bench/traffic.py), None when no rows move.
    bare_us: the bare all_to_all of the same padded payload in the same run.
    portable_us: the portable all_to_all path of the same op in the same run.
    note: a short remark for the reader.
    noise_us: the slope's noise per call (timing.slope_noise_us, the largest
      over ranks); None without an estimate.
    below_noise: it ran, but its slope was not positive (measure.py); a Row
      given such a time keeps None instead and says below_noise.
  """

  op: str
  system: str
  us: float | None
  error: str | None = None
  traffic: traffic_lib.Traffic | None = None
  bare_us: float | None = None
  portable_us: float | None = None
  note: str = ""
  noise_us: float | None = None
  below_noise: bool = False

  def __post_init__(self):
    # The output's rule holds for every Row, however it was made: a time that is
    # not positive is never written as one.
    if self.us is not None and not self.us > 0:
      object.__setattr__(self, "us", None)
      object.__setattr__(self, "below_noise", self.error is None)

  @property
  def failed(self) -> bool:
    return self.error is not None

  @property
  def stable_slope(self) -> bool | None:
    """False when the time does not stand out of its noise (timing.slope_is_stable):
    the row is kept as measured, and the table and the JSON say so."""
    return slope_is_stable(self.us, self.noise_us)

  @property
  def gbps(self) -> float | None:
    """DeepEP's way: every received row's bytes (own rows included) / time."""
    return traffic_lib.gbps(self.traffic and self.traffic.deepep_bytes, self.us)

  @property
  def link_gbps(self) -> float | None:
    """Bytes that crossed the links into one rank / time (mean over ranks)."""
    return traffic_lib.gbps(self.traffic and self.traffic.link_bytes, self.us)

  @property
  def vs_bare(self) -> float | None:
    """This time over the bare all_to_all's (> 1: slower than the bare exchange)."""
    return _ratio(self.us, self.bare_us)

  @property
  def speedup_vs_portable(self) -> float | None:
    """The portable all_to_all path's time over this one (> 1: faster than it)."""
    return _ratio(self.portable_us, self.us)

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(gbps=self.gbps, link_gbps=self.link_gbps, vs_bare=self.vs_bare,
               speedup_vs_portable=self.speedup_vs_portable, failed=self.failed,
               stable_slope=self.stable_slope)
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
  if num is None or den is None or not den > 0 or not math.isfinite(num):
    return None
  return num / den


def _cell(value: float | None, width: int, digits: int) -> str:
  return f"{value:{width}.{digits}f}" if value is not None else " " * width


def format_table(rows: list[Row], title: str) -> str:
  lines = [title,
           f"{'op':<{OP_COLUMN}}{'system':<{SYSTEM_COLUMN}}{'us/call':>10}{'GB/s':>9}"
           f"{'link GB/s':>11}"
           f"{'/ bare':>8}{'x portable':>11}"]
  for r in rows:
    head = f"{r.op:<{OP_COLUMN}}{r.system:<{SYSTEM_COLUMN}}"
    if r.failed:
      first = r.error.splitlines()[0] if r.error else ""
      lines.append(f"{head}{'FAILED':>10}  {first[:TABLE_ERROR_CHARS]}")
      continue
    if r.us is None:  # below noise (or no time at all): words, never a number
      noise = f" (noise {r.noise_us:.1f} us)" if r.noise_us is not None else ""
      lines.append(f"{head}{'below noise':>11}{noise}")
      continue
    lines.append(f"{head}{_cell(r.us, 10, 1)}{_cell(r.gbps, 9, 1)}{_cell(r.link_gbps, 11, 1)}"
                 f"{_cell(r.vs_bare, 8, 2)}{_cell(r.speedup_vs_portable, 11, 2)}"
                 + (f"  unstable slope (noise {r.noise_us:.1f} us)"
                    if r.stable_slope is False else ""))
  return "\n".join(lines)


def any_failed(rows: list[Row]) -> bool:
  return any(r.failed for r in rows)


def write_json(path: str, payload: dict) -> None:
  def encode(o):
    if isinstance(o, Row):
      return o.to_json()
    if dataclasses.is_dataclass(o):
      return dataclasses.asdict(o)
    return str(o)

  with open(path, "w") as f:
    json.dump(payload, f, indent=2, default=encode)
    f.write("\n")


def row_of(op: str, system: str, outcome, traffic: traffic_lib.Traffic | None = None,
           bare=None, portable=None, note: str = "") -> Row:
  """A Row from a measure.Outcome; ``bare`` / ``portable``: the Outcomes it is compared
  with (their times, where they did not fail)."""
  return Row(op=op, system=system, us=outcome.us, error=outcome.error, traffic=traffic,
             bare_us=bare.us if bare is not None else None,
             portable_us=portable.us if portable is not None else None, note=note,
             noise_us=getattr(outcome, "noise_us", None),
             below_noise=getattr(outcome, "below_noise", False))
