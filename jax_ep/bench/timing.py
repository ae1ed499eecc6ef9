"""In-graph timing: jitted executables of N dependent calls, timed from the host.

Per-call time is the slope between two loop lengths,

    slope = (median T(N) - median T(N/5)) / (N - N/5),

with T(n) the wall time of one execution of the n-call executable (after a
warm-up), each loop length executed ``repeats`` times, alternately. The slope
drops what one execution costs whatever n is (the host's launch and the final
sync), which a plain T(N) / N would spread over the calls. Calls are dependent
and unrolled in one executable (no host round trip between them; see loop_of).
Before the timed executions the long executable runs until WARMUP_CALLS calls
have run: a GPU left idle while the next system compiles drops its clocks, and
the few milliseconds of timed executions would otherwise run while they climb
back (the shortest calls spread most). A count of calls, not a time, so that
every rank runs the same executions (the calls of one rank wait for its
peers'). Every system is timed this same way, in the same run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

Clock = Callable[[], float]  # seconds, monotonic (time.perf_counter)

WARMUP_CALLS = 5000  # calls of warm-up executions before each system's timing


@dataclasses.dataclass(frozen=True)
class Timing:
  """One system's per-call time on this process.

  Attributes:
    median_us: per call, the slope between the two loop lengths (module docstring).
    min_us: per call, the fastest long execution divided by its calls (includes
      the per-execution cost the slope removes).
    max_us: per call, the slowest long execution divided by its calls.
    calls_per_loop: N, calls in the long executable.
    short_calls: calls in the short executable (N // 5, at least 1).
    repeats: executions of each loop length.
    noise_us: per call, the slope's noise: the interquartile ranges of the long
      and the short executions' wall times, added, over N - N/5 (slope_noise_us);
      NaN where each length ran once (time_single_shot).
  """

  median_us: float
  min_us: float
  max_us: float
  calls_per_loop: int
  short_calls: int
  repeats: int
  noise_us: float = math.nan

  @property
  def stable(self) -> bool | None:
    """Whether the slope stands out of its noise (see slope_is_stable)."""
    return slope_is_stable(self.median_us, self.noise_us)


def short_calls_of(num_calls: int) -> int:
  """Calls of the short executable: N // 5, at least 1."""
  return max(1, num_calls // 5)


def slope_us(long_s: Sequence[float], short_s: Sequence[float], long_calls: int,
             short_calls: int) -> float:
  """(median(long_s) - median(short_s)) / (long_calls - short_calls), in microseconds.

  ``long_s`` / ``short_s``: wall seconds of each execution of the long / short
  executable. The median keeps one slow execution (a host hiccup) out of the
  result.
  """
  if long_calls <= short_calls:
    raise ValueError(f"the long loop ({long_calls} calls) must be longer than the short one "
                     f"({short_calls})")
  if not long_s or not short_s:
    raise ValueError("no samples")
  return (statistics.median(long_s) - statistics.median(short_s)) * 1e6 / (
      long_calls - short_calls)


def slope_noise_us(long_s: Sequence[float], short_s: Sequence[float], long_calls: int,
                   short_calls: int) -> float:
  """(IQR(long_s) + IQR(short_s)) / (long_calls - short_calls), in microseconds.

  How far the host's noise moves the slope: each median sits within its
  samples' interquartile range, so a slope below this is not measured (a
  negative slope, as once seen for a 4 us op at N = 50 and 7 executions,
  2026-12-01, docs/history.md). NaN with fewer than two samples of a length."""
  if len(long_s) < 2 or len(short_s) < 2:
    return math.nan

  def iqr(samples: Sequence[float]) -> float:
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q3 - q1

  return (iqr(long_s) + iqr(short_s)) * 1e6 / (long_calls - short_calls)


def slope_is_stable(slope_us: float | None, noise_us: float | None) -> bool | None:
  """A slope stands out of its noise when it is positive and larger than it;
  None when there is no noise estimate (one execution per length) or no slope."""
  if slope_us is None or noise_us is None or not math.isfinite(noise_us):
    return None
  return slope_us > 0 and noise_us < slope_us


def time_loops(run: Callable[[int], None], num_calls: int, repeats: int,
               clock: Clock = time.perf_counter) -> Timing:
  """Times ``run(n)`` (one execution of the n-call executable, until its result
  exists) for n = num_calls and short_calls_of(num_calls), ``repeats`` times
  each, alternately, and returns the slope. The caller warms both up first."""
  short_calls = short_calls_of(num_calls)
  samples: dict[int, list[float]] = {num_calls: [], short_calls: []}
  for _ in range(repeats):
    for n in (num_calls, short_calls):
      start = clock()
      run(n)
      samples[n].append(clock() - start)
  long_s = samples[num_calls]
  return Timing(slope_us(long_s, samples[short_calls], num_calls, short_calls),
                min(long_s) * 1e6 / num_calls, max(long_s) * 1e6 / num_calls, num_calls,
                short_calls, repeats,
                slope_noise_us(long_s, samples[short_calls], num_calls, short_calls))


def warmup_executions(num_calls: int, warmup_calls: int = WARMUP_CALLS) -> int:
  """Executions of the num_calls-call loop that run at least warmup_calls calls."""
  return max(1, -(-warmup_calls // max(num_calls, 1)))


def loop_of(op: Callable, num_calls: int) -> Callable:
  """``num_calls`` dependent calls of ``op(*args)`` in one executable; returns a scalar.

  After each call, its whole result and the arguments go through one
  ``optimization_barrier``, and the next call reads the arguments out of it: the
  next call cannot start before this one's result exists, and XLA can neither
  merge, hoist, overlap nor trim calls through the barrier. One element of
  EVERY leaf of each result (as it leaves the barrier) is summed at the very
  end (one small kernel per execution, not per call). XLA removes a barrier
  output that nothing reads, and with it the work that produced it, so a leaf
  left out of the sum would not be computed at all.
  """

  def looped(*args):
    picked = []
    for _ in range(num_calls):
      out = op(*args)
      args, out = jax.lax.optimization_barrier((args, out))
      for leaf in jax.tree.leaves(out):
        picked.append(jnp.sum(jnp.asarray(leaf).reshape(-1)[:1].astype(jnp.float32)))
    return jnp.sum(jnp.stack(picked)) if picked else jnp.float32(0)

  return looped


def executable(per_shard_op: Callable, mesh: jax.sharding.Mesh, num_calls: int) -> Callable:
  """The jitted executable that is timed: loop_of(per_shard_op) in shard_map over ``ep``."""
  looped = loop_of(per_shard_op, num_calls)
  return jax.jit(jax.shard_map(lambda *a: looped(*a)[None], mesh=mesh, in_specs=P("ep"),
                               out_specs=P("ep")))


def time_per_call(per_shard_op: Callable, mesh: jax.sharding.Mesh, local_args,
                  num_calls: int = 50, repeats: int = 7,
                  after_warmup: Callable[[], None] | None = None,
                  clock: Clock = time.perf_counter,
                  after_timing: Callable[[Callable[[], None]], None] | None = None,
                  warmup_calls: int = WARMUP_CALLS) -> Timing:
  """Per-call time (us) of ``per_shard_op`` inside jit(shard_map), on this process.

  ``local_args``: this process's shards (numpy), EP-sharded along axis 0.
  ``warmup_calls``: calls of executions of the long loop before the timed ones
  (module docstring).
  ``after_warmup`` runs between the warm-ups and the timed executions (all
  executions of both loop lengths then count in whatever it resets).
  ``after_timing`` gets, after the timed executions, a function that runs the
  long executable once more (a probe may profile that execution: measure.Probe).
  """
  num_calls = max(num_calls, 2)
  fns = {n: executable(per_shard_op, mesh, n) for n in (num_calls, short_calls_of(num_calls))}
  args = [global_array(mesh, a) for a in local_args]
  for fn in fns.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
  for _ in range(warmup_executions(num_calls, warmup_calls)):
    jax.block_until_ready(fns[num_calls](*args))
  if after_warmup is not None:
    after_warmup()
  measured = time_loops(lambda n: jax.block_until_ready(fns[n](*args)), num_calls, repeats,
                        clock)
  if after_timing is not None:
    after_timing(lambda: jax.block_until_ready(fns[num_calls](*args)))
  return measured


def time_single_shot(per_shard_op: Callable, mesh: jax.sharding.Mesh, local_args,
                     num_calls: int = 5, clock: Clock = time.perf_counter) -> Timing:
  """Like time_per_call, but every executable runs exactly once.

  For ``jax.lax.ragged_all_to_all`` across processes (XLA's NCCL send/recv
  fallback, jax 0.11.2): the second execution of the same executable hung on
  2x H200 (2026-11-30, tools/ragged_probe.py), also in plain JAX without
  jax_ep. A two-call executable runs first (NCCL set-up), then one execution
  each of num_calls (> 2) and of 1 call, three distinct programs; the slope
  is their difference over num_calls - 1. One sample each: no median.
  """
  num_calls = max(num_calls, 3)
  args = [global_array(mesh, a) for a in local_args]
  compiled = {n: executable(per_shard_op, mesh, n).lower(*args).compile()
              for n in (2, num_calls, 1)}
  jax.block_until_ready(compiled[2](*args))
  seconds = {}
  for n in (num_calls, 1):
    start = clock()
    jax.block_until_ready(compiled[n](*args))
    seconds[n] = clock() - start
  per_call = seconds[num_calls] * 1e6 / num_calls
  return Timing(slope_us([seconds[num_calls]], [seconds[1]], num_calls, 1), per_call, per_call,
                num_calls, 1, 1)


def ranks_here(mesh: jax.sharding.Mesh) -> int:
  """EP ranks of ``mesh`` on this process (its devices there): one per process on
  GPUs, every rank with several CPU devices in one process.

  A process-local array (global_array, local_part) holds its ranks' parts one
  after the other along axis 0, in equal parts: ranks_here * T rows for T per rank.
  """
  here = jax.process_index()
  return sum(1 for d in mesh.devices.flat if d.process_index == here)


def per_rank(local: np.ndarray, fn: Callable[[np.ndarray], np.ndarray],
             num_ranks_here: int) -> np.ndarray:
  """``fn`` applied to each rank's part of the process-local ``local`` (axis 0 cut in
  ``num_ranks_here`` equal parts), the results one after the other along axis 0."""
  return np.concatenate([fn(part) for part in np.split(local, num_ranks_here)])


def global_array(mesh: jax.sharding.Mesh, local: np.ndarray) -> jax.Array:
  """The EP-sharded global array whose part on this process is ``local`` (its ranks'
  parts one after the other along axis 0, see ranks_here)."""
  global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), local, global_shape)


def local_part(array: jax.Array) -> np.ndarray:
  """This process's part of an EP-sharded global array: its addressable shards in
  the order of axis 0, what global_array takes back. (Not the first shard alone:
  with several devices per process that part would be one rank's, too short to
  spread over the process's ranks again.)"""
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  return np.concatenate([np.asarray(s.data) for s in shards])
