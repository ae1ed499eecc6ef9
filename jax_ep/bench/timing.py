"""In-graph timing: jitted executables of N dependent calls, timed from the host.

Per-call time is the slope between two loop lengths: (T(N) - T(N/5)) / (N - N/5),
with T the median wall time of one execution (after a warm-up). The slope drops
what one execution costs whatever N is (the host's launch and the final sync),
which the old "T(N) / N" spread over the calls. Calls are dependent and unrolled
in one executable (no host round trip between them; see loop_of). Every system
is timed this same way, in the same run.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Timing:
  median_us: float      # per call: slope between the two loop lengths
  min_us: float         # per call, fastest long execution / its calls (upper-bound style)
  max_us: float         # per call, slowest long execution / its calls
  calls_per_loop: int
  repeats: int


def loop_of(op: Callable, num_calls: int) -> Callable:
  """``num_calls`` dependent calls of ``op(*args)`` in one executable; returns a scalar.

  After each call, its whole result and the arguments go through one
  ``optimization_barrier``, and the next call reads the arguments out of it: the
  next call cannot start before this one's result exists, and XLA can neither
  merge, hoist, overlap nor trim calls through the barrier. One element of each
  result is summed at the very end (one small kernel per execution, not per
  call), so no result is dead.
  """

  def looped(*args):
    firsts = []
    for _ in range(num_calls):
      out = op(*args)
      args, out = jax.lax.optimization_barrier((args, out))
      firsts.append(jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32))
    return jnp.sum(jnp.stack(firsts))

  return looped


def _executable(per_shard_op: Callable, mesh: jax.sharding.Mesh, num_calls: int) -> Callable:
  looped = loop_of(per_shard_op, num_calls)
  return jax.jit(jax.shard_map(lambda *a: looped(*a)[None], mesh=mesh, in_specs=P("ep"),
                               out_specs=P("ep")))


def time_per_call(per_shard_op: Callable, mesh: jax.sharding.Mesh, local_args,
                  num_calls: int = 50, repeats: int = 7,
                  after_warmup: Callable[[], None] | None = None) -> Timing:
  """Per-call time (us) of ``per_shard_op`` inside jit(shard_map), per rank.

  ``after_warmup`` runs between the warm-ups and the timed executions (all
  executions of both loop lengths then count in whatever it resets).
  """
  num_calls = max(num_calls, 2)
  short_calls = max(1, num_calls // 5)
  long_fn = _executable(per_shard_op, mesh, num_calls)
  short_fn = _executable(per_shard_op, mesh, short_calls)
  args = [global_array(mesh, a) for a in local_args]
  for fn in (long_fn, short_fn):
    jax.block_until_ready(fn(*args))  # compile + warm up
    jax.block_until_ready(fn(*args))
  if after_warmup is not None:
    after_warmup()
  long_s, short_s = [], []
  for _ in range(repeats):
    for fn, samples in ((long_fn, long_s), (short_fn, short_s)):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      samples.append(time.perf_counter() - start)
  slope_us = (statistics.median(long_s) - statistics.median(short_s)) * 1e6 / (
      num_calls - short_calls)
  return Timing(slope_us, min(long_s) * 1e6 / num_calls, max(long_s) * 1e6 / num_calls,
                num_calls, repeats)


def time_single_shot(per_shard_op: Callable, mesh: jax.sharding.Mesh, local_args,
                     num_calls: int = 5) -> Timing:
  """Like time_per_call, but every executable runs exactly once.

  For ``jax.lax.ragged_all_to_all`` across processes (XLA's NCCL send/recv
  fallback, jax 0.11.2): the second execution of the same executable hung on
  2x H200 (2026-11-30, tools/ragged_probe.py), also in plain JAX without
  jax_ep. A two-call executable runs first (NCCL set-up), then one execution
  each of num_calls (> 2) and of 1 call, three distinct programs; the slope
  is their difference over num_calls - 1. One sample each: no median.
  """
  warm_fn = _executable(per_shard_op, mesh, 2)
  long_fn = _executable(per_shard_op, mesh, max(num_calls, 3))
  short_fn = _executable(per_shard_op, mesh, 1)
  num_calls = max(num_calls, 3)
  args = [global_array(mesh, a) for a in local_args]
  compiled = [fn.lower(*args).compile() for fn in (warm_fn, long_fn, short_fn)]
  jax.block_until_ready(compiled[0](*args))
  samples = []
  for fn in compiled[1:]:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  slope_us = (samples[0] - samples[1]) * 1e6 / (num_calls - 1)
  return Timing(slope_us, samples[0] * 1e6 / num_calls, samples[0] * 1e6 / num_calls,
                num_calls, 1)


def global_array(mesh: jax.sharding.Mesh, local: np.ndarray) -> jax.Array:
  """The EP-sharded global array whose part on this process is ``local``."""
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("ep")), local, (local.shape[0] * jax.process_count(),) + local.shape[1:])


def gather_max(value: float) -> float:
  """Max of a per-process float over all processes (host-side, for reporting)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return float(np.max(multihost_utils.process_allgather(np.float64(value))))
