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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import numpy as np

from jax_ep.bench import gpu_timeline, kernel_profile, timing
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


class Runner:
  """Times per-shard ops on one mesh, all the same way, and logs each outcome.

  ``args`` of :meth:`time` are this process's input shards, or a function that
  makes them: whatever it raises (a layout step that cannot compile here, say)
  becomes the system's FAILED outcome too.
  """

  def __init__(self, mesh: jax.sharding.Mesh, num_calls: int, repeats: int, context: str = "",
               warmup_calls: int = timing.WARMUP_CALLS):
    self.mesh = mesh
    self.num_calls = num_calls
    self.repeats = repeats
    self.context = context
    self.warmup_calls = warmup_calls  # timing.time_per_call's warm-up
    self.profiles: dict[str, dict] = {}  # label -> this rank's kernel profile
    self.timelines: dict[str, dict] = {}  # label -> this rank's timeline (JAX_EP_TIMELINE=1)

  def time(self, label: str, op: Callable, args, *, profile: bool = False,
           single_shot: bool = False, num_calls: int | None = None) -> Outcome:
    """Outcome of ``op`` (per shard, inside jit(shard_map)) on ``args``.

    profile: with JAX_EP_PROFILE=1 on the CUDA backend, keep the kernels'
    in-kernel profile of the timed calls. With JAX_EP_TIMELINE=1 every
    system's timeline is kept too (gpu_timeline.py), after its timing.
    single_shot: every executable runs once (timing.time_single_shot says when
    that is needed).
    """
    calls = num_calls or self.num_calls
    rank = jax.process_index()

    def timer() -> Timing:
      local_args = args() if callable(args) else args
      if single_shot:
        return timing.time_single_shot(op, self.mesh, local_args, calls)
      keep_profile = profile and kernel_profile.enabled()

      def keep_timeline(run_once: Callable[[], None]) -> None:
        summary = gpu_timeline.record(run_once, calls)
        self.timelines[f"{self.context}{label}"] = summary
        print(f"timeline rank {rank}: {self.context}{label}: "
              f"{gpu_timeline.format_summary(summary)}", flush=True)

      measured = timing.time_per_call(
          op, self.mesh, local_args, calls, self.repeats,
          after_warmup=kernel_profile.reset if keep_profile else None,
          after_timing=keep_timeline if gpu_timeline.enabled() else None,
          warmup_calls=self.warmup_calls)
      if keep_profile:
        self.profiles[f"{self.context}{label}"] = kernel_profile.read()
        print(f"profile rank {rank}: {self.context}{label}: "
              f"{kernel_profile.format_profile(self.profiles[f'{self.context}{label}'])}",
              flush=True)
      return measured

    outcome = run_system(timer)
    if rank == 0:
      print(f"bench: {self.context}{label}: {describe(outcome)}", flush=True)
    return outcome
