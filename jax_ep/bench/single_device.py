"""Timing of ops that run on one device without a mesh (grouped GEMMs, whole
layers at EP1): the in-graph slope of jax_ep/bench/timing.py, on one device.

Every system is timed the same way: ``loop_of(fn, n)`` jitted for n = N and
N/5, both compiled and run twice, ``warmup_executions`` more of the long one,
(or fewer, once they have run WARMUP_SECONDS: a system whose call takes a
large fraction of a second is warm after a few), then ``repeats`` executions of
each length, alternately; the time per call is the slope. A system that
raises (out of memory included) gives its error instead, so one failure loses
no other row.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax

from jax_ep.bench import timing

# Warm-up executions stop after this much wall time, even short of
# warmup_calls: their purpose (clocks up, caches and allocator warm) is met
# within it, and ragged_dot's dense path at DeepSeek shapes takes about a
# second a call.
WARMUP_SECONDS = 3.0


@dataclasses.dataclass(frozen=True)
class Measured:
  """One system's time per call, or why there is none.

  Attributes:
    us: median per-call microseconds (the slope), None when it failed or was
      not positive.
    noise_us: the slope's noise (timing.slope_noise_us).
    error: the exception's type and text, first 400 characters.
    peak_bytes: what XLA's memory analysis of the one-call executable reports
      it needs on the device (arguments + outputs + temporaries - aliased),
      None when it did not compile.
    probed: each probe's result (measure.Probe.key -> result), taken after the
      timed executions.
  """

  us: float | None
  noise_us: float | None = None
  error: str | None = None
  peak_bytes: int | None = None
  probed: dict[str, dict] = dataclasses.field(default_factory=dict)


def peak_bytes(fn: Callable, args) -> int | None:
  """Device bytes of the one-call executable, from XLA's memory analysis."""
  try:
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if stats is None:
    return None
  return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
             + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def memory_shortfall(peak: int | None) -> str | None:
  """Why an executable of ``peak`` bytes cannot run on device 0, or None.

  XLA's GPU allocator does not always fail fast on a request beyond what it
  has: it retries, waiting for frees that never come (seen: ragged_dot's
  forward+backward at DeepSeek shapes on one H100 waited for minutes). So the
  caller checks what the memory analysis asks for against what is left first.
  """
  stats = jax.devices()[0].memory_stats() if peak is not None else None
  if not stats or "bytes_limit" not in stats:
    return None
  free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  if peak <= free:
    return None
  return (f"RESOURCE_EXHAUSTED (not run): XLA's memory analysis asks for "
          f"{peak / 2**30:.1f} GiB; the device's allocator has {free / 2**30:.1f} GiB free")


def measure(fn: Callable, args, num_calls: int = 5, repeats: int = 5,
            warmup_calls: int = 20, check_memory: bool = False,
            probes: Sequence = ()) -> Measured:
  """Times ``fn(*args)`` (device arrays) per call; never raises.

  check_memory: first compare the one-call executable's memory analysis with
  the device's free memory (memory_shortfall), and report a shortfall as the
  error without running.
  probes: jax_ep.bench.measure.Probe-likes (benchmarks/probe.py's timeline),
  each given the long executable after the timing; their results in ``probed``.
  """
  peak = peak_bytes(fn, args)
  shortfall = memory_shortfall(peak) if check_memory else None
  if shortfall is not None:
    return Measured(None, error=shortfall, peak_bytes=peak)
  try:
    num_calls = max(num_calls, 2)
    lengths = (num_calls, timing.short_calls_of(num_calls))
    fns = {n: jax.jit(timing.loop_of(fn, n)) for n in lengths}
    for compiled in fns.values():
      jax.block_until_ready(compiled(*args))
      jax.block_until_ready(compiled(*args))
    warmup_start = time.perf_counter()
    for _ in range(timing.warmup_executions(num_calls, warmup_calls)):
      jax.block_until_ready(fns[num_calls](*args))
      if time.perf_counter() - warmup_start > WARMUP_SECONDS:
        break
    for probe in probes:
      probe.after_warmup()
    result = timing.time_loops(lambda n: jax.block_until_ready(fns[n](*args)), num_calls,
                               repeats)
    probed = {}
    for probe in probes:
      looked = probe.after_timing(lambda: jax.block_until_ready(fns[num_calls](*args)),
                                  num_calls)
      if looked is not None:
        probed[probe.key] = looked
  except Exception as e:  # pylint: disable=broad-except
    return Measured(None, error=f"{type(e).__name__}: {e}"[:400], peak_bytes=peak)
  us = result.median_us if result.median_us > 0 else None
  return Measured(us, noise_us=result.noise_us, peak_bytes=peak, probed=probed)
