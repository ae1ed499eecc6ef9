"""In-graph timing: one jitted executable of N calls, timed from the host.

Per-call time = wall time of one execution / N (N calls unrolled in one
executable: no host round trip between calls); executions are repeated after a
warm-up and the median is reported. Each call's input passes through an
optimization_barrier with the call's index, so XLA can neither hoist nor merge
identical exchanges; each call's result feeds one element into an accumulator
so none is dead code. Every system is timed this same way.
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
  median_us: float
  min_us: float
  max_us: float
  calls_per_loop: int
  repeats: int


def loop_of(op: Callable, num_calls: int) -> Callable:
  """fori_loop of ``num_calls`` calls of ``op(*args)``; returns a scalar."""

  def looped(*args):
    def body(i, acc):
      pinned = jax.lax.optimization_barrier((args, i))[0]
      # The barrier makes XLA produce the whole result (it cannot slice or
      # simplify through it); one element then keeps the call live.
      out = jax.lax.optimization_barrier(op(*pinned))
      leaf = jax.tree.leaves(out)[0]
      return acc + leaf.reshape(-1)[0].astype(jnp.float32)
    init = jax.lax.pcast(jnp.float32(0), "ep", to="varying")
    return jax.lax.fori_loop(0, num_calls, body, init, unroll=True)

  return looped


def time_per_call(per_shard_op: Callable, mesh: jax.sharding.Mesh, local_args,
                  num_calls: int = 100, repeats: int = 7,
                  after_warmup: Callable[[], None] | None = None) -> Timing:
  """Median per-call time (us) of ``per_shard_op`` inside jit(shard_map), per rank.

  ``after_warmup`` runs between the warm-up and the timed executions.
  """
  looped = loop_of(per_shard_op, num_calls)
  fn = jax.jit(jax.shard_map(lambda *a: looped(*a)[None], mesh=mesh, in_specs=P("ep"),
                             out_specs=P("ep")))
  sharding = NamedSharding(mesh, P("ep"))
  args = [jax.make_array_from_process_local_data(
      sharding, a, (a.shape[0] * jax.device_count(),) + a.shape[1:]) for a in local_args]
  jax.block_until_ready(fn(*args))  # compile + warm up
  jax.block_until_ready(fn(*args))
  if after_warmup is not None:
    after_warmup()
  samples = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - start) * 1e6 / num_calls)
  return Timing(statistics.median(samples), min(samples), max(samples), num_calls, repeats)


def gather_max(value: float) -> float:
  """Max of a per-process float over all processes (host-side, for reporting)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return float(np.max(multihost_utils.process_allgather(np.float64(value))))
