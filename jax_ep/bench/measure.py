"""Times one system on every rank and agrees on the outcome: its time or its error.

A system that raises (cannot compile, cannot run here, fails on a rank) is not
dropped: its outcome carries the error text, and the table shows it as a
FAILED row. Every rank takes part in the same gathers whatever happened
locally, so a failure on one rank reaches rank 0's table. (A rank that stops
inside a collective of the timed program cannot be helped here; the
kernels' bounded waits turn such stalls into errors.)

A time that is not positive is not a time: the long and the short loops took
the same wall time within the host's noise (timing.slope_noise_us). Such an
outcome has no time and says ``below_noise``; nothing prints it as a number.

What looks inside a timing (the kernels' in-kernel profile, the profiler's
timeline) is not part of the bench: a Runner takes Probes, which the
repository's benchmarks/probe.py passes in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Protocol, Sequence

import jax
import numpy as np

from jax_ep.bench import timing
from jax_ep.bench.timing import Timing

ERROR_BYTES = 2048  # error text kept per rank (UTF-8, truncated)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One system's result over all ranks.

  Attributes:
    us: per-call time, the maximum over ranks, > 0; None if any rank failed or
      the time was not positive (below_noise).
    error: "rank N: <exception>" of the first failing rank, else None.
    timing: this rank's Timing (None where it failed).
    noise_us: the slope's noise (Timing.noise_us), the largest over ranks; None
      if any rank failed or had no estimate.
    below_noise: every rank ran, but the time (the slope, max over ranks) was
      not positive: the op's cost is below what the harness resolves here.
  """

  us: float | None
  error: str | None
  timing: Timing | None = None
  noise_us: float | None = None
  below_noise: bool = False

  @property
  def stable(self) -> bool | None:
    """Whether the time stands out of its noise (timing.slope_is_stable)."""
    return timing.slope_is_stable(self.us, self.noise_us)


def allgather(value: np.ndarray) -> np.ndarray:
  """[P, ...] stack of every process's ``value`` (numpy, host side)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(value))


def encode_error(text: str | None) -> np.ndarray:
  """uint8[ERROR_BYTES]: the text (UTF-8, cut, zero-padded), for a fixed-shape gather."""
  data = (text or "").encode("utf-8", "replace")[:ERROR_BYTES]
  return np.frombuffer(data.ljust(ERROR_BYTES, b"\0"), dtype=np.uint8).copy()


def decode_error(buf: np.ndarray) -> str:
  return bytes(buf).rstrip(b"\0").decode("utf-8", "replace")


def combine_outcomes(us_per_rank: np.ndarray, errors: list[str | None]) -> tuple[float | None,
                                                                                str | None]:
  """(max us, None) when every rank succeeded, else (None, "rank N: error") of the
  lowest failing rank. ``us_per_rank`` float[P] (NaN where that rank failed)."""
  for rank, error in enumerate(errors):
    if error:
      return None, f"rank {rank}: {error}"
  if not np.all(np.isfinite(us_per_rank)):
    return None, "a rank returned no time"
  return float(np.max(us_per_rank)), None


def run_system(timer: Callable[[], Timing], gather: Callable[[np.ndarray], np.ndarray] = allgather
               ) -> Outcome:
  """Runs ``timer`` here (catching any exception), then gathers every rank's outcome.

  ``gather``: the all-process stack (multihost_utils.process_allgather; a
  parameter so tests can simulate other ranks).
  """
  timing, error = None, None
  try:
    timing = timer()
    if not math.isfinite(timing.median_us):
      error = f"non-finite time {timing.median_us}"
  except Exception as e:  # pylint: disable=broad-except
    error = f"{type(e).__name__}: {e}".strip() or type(e).__name__
  ok = timing is not None and error is None
  local = np.asarray([timing.median_us if ok else np.nan, timing.noise_us if ok else np.nan],
                     dtype=np.float64)
  gathered = gather(local)
  errors = [decode_error(b) or None for b in gather(encode_error(error))]
  us, first_error = combine_outcomes(gathered[:, 0], errors)
  noise = gathered[:, 1]
  noise_us = float(np.max(noise)) if us is not None and np.all(np.isfinite(noise)) else None
  below_noise = us is not None and not us > 0
  return Outcome(us=None if below_noise else us, error=first_error, timing=timing,
                 noise_us=noise_us, below_noise=below_noise)


def describe(outcome: Outcome) -> str:
  """The outcome for a log line: "12.3 us", "FAILED: <first line of the error>" or
  "below noise" (never a number that is not a time)."""
  if outcome.error is not None:
    return f"FAILED: {outcome.error.splitlines()[0][:300]}"
  noise = f" (noise {outcome.noise_us:.1f} us per call)" if outcome.noise_us is not None else ""
  if outcome.below_noise or outcome.us is None:
    return f"below noise{noise}"
  return f"{outcome.us:.1f} us" + (f" (unstable slope{noise})" if outcome.stable is False else "")


class Probe(Protocol):
  """A look inside each timing, taken beside its time (benchmarks/probe.py's
  in-kernel profile and profiler timeline). Runner calls it around the timed
  executions of each system it times (a kernels_only probe: only of the systems
  timed with ``profile=True``, those that run jax_ep's kernels); single-shot
  timings have none.

  Attributes:
    key: the entry of the run's ``meta`` (and JSON) that holds its results,
      {label: this rank's result}.
    title: its name in the bench's output lines.
    kernels_only: whether it looks only at the systems timed with profile=True.
  """

  key: str
  title: str
  kernels_only: bool

  def after_warmup(self) -> None:
    """Runs between the warm-up and the timed executions (all executions of
    both loop lengths then count in whatever it resets)."""

  def after_timing(self, run_once: Callable[[], None], num_calls: int) -> dict | None:
    """This rank's result, after the timed executions; None where it has none
    (no kernels of its kind ran). ``run_once`` runs the long executable, of
    ``num_calls`` calls, once more."""

  def format(self, result: dict) -> str:
    """The result in one line."""


class Runner:
  """Times per-shard ops on one mesh, all the same way, and logs each outcome.

  ``args`` of :meth:`time` are this process's input shards, or a function that
  makes them: whatever it raises (a layout step that cannot compile here, say)
  becomes the system's FAILED outcome too.
  """

  def __init__(self, mesh: jax.sharding.Mesh, num_calls: int, repeats: int, context: str = "",
               warmup_calls: int = timing.WARMUP_CALLS, probes: Sequence[Probe] = ()):
    self.mesh = mesh
    self.num_calls = num_calls
    self.repeats = repeats
    self.context = context
    self.warmup_calls = warmup_calls  # timing.time_per_call's warm-up
    self.probes = tuple(probes)  # in order: each one's after_timing before the next's
    # Probe.key -> label -> this rank's result; a key only once a result came.
    self.probed: dict[str, dict[str, dict]] = {}

  def time(self, label: str, op: Callable, args, *, profile: bool = False,
           single_shot: bool = False, num_calls: int | None = None) -> Outcome:
    """Outcome of ``op`` (per shard, inside jit(shard_map)) on ``args``.

    profile: ``op`` runs jax_ep's kernels: the kernels_only probes look at it too.
    Every probe's result is kept in ``probed`` and printed, after the timing.
    single_shot: every executable runs once (timing.time_single_shot says when
    that is needed).
    """
    calls = num_calls or self.num_calls
    rank = jax.process_index()
    name = f"{self.context}{label}"
    probes = [p for p in self.probes if profile or not p.kernels_only]

    def after_warmup() -> None:
      for probe in probes:
        probe.after_warmup()

    def after_timing(run_once: Callable[[], None]) -> None:
      for probe in probes:
        result = probe.after_timing(run_once, calls)
        if result is not None:
          self.probed.setdefault(probe.key, {})[name] = result
          print(f"{probe.title} rank {rank}: {name}: {probe.format(result)}", flush=True)

    def timer() -> Timing:
      local_args = args() if callable(args) else args
      if single_shot:
        return timing.time_single_shot(op, self.mesh, local_args, calls)
      return timing.time_per_call(
          op, self.mesh, local_args, calls, self.repeats,
          after_warmup=after_warmup if probes else None,
          after_timing=after_timing if probes else None, warmup_calls=self.warmup_calls)

    outcome = run_system(timer)
    if rank == 0:
      print(f"bench: {self.context}{label}: {describe(outcome)}", flush=True)
    return outcome
