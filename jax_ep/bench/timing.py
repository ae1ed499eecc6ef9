"""In-graph timing: one jitted executable of N calls, timed from the host.

Per-call time = wall time of one execution / N, for N dependent calls unrolled
in one executable (no host round trip between calls; see loop_of); executions
are repeated after a warm-up and the median is reported. Every system is timed
this same way, in the same run.
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
  """``num_calls`` dependent calls of ``op(*args)`` in one executable; returns a scalar.

  Each call's whole result is materialised (an optimization_barrier: XLA can
  neither slice nor simplify through it) and one element of it becomes an
  input dependency of the next call's arguments (another barrier, no extra
  kernel), so calls run one after another and none can be hoisted, merged,
  overlapped with the next or dropped.
  """

  def looped(*args):
    def body(_, carry):
      args, acc = carry
      out = jax.lax.optimization_barrier(op(*args))
      first = jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)
      return jax.lax.optimization_barrier((args, acc + first))
    init = jax.lax.pcast(jnp.float32(0), "ep", to="varying")
    return jax.lax.fori_loop(0, num_calls, body, (args, init), unroll=True)[1]

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
  args = [global_array(mesh, a) for a in local_args]
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


def global_array(mesh: jax.sharding.Mesh, local: np.ndarray) -> jax.Array:
  """The EP-sharded global array whose shard on this process is ``local``."""
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("ep")), local, (local.shape[0] * jax.device_count(),) + local.shape[1:])


def gather_max(value: float) -> float:
  """Max of a per-process float over all processes (host-side, for reporting)."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return float(np.max(multihost_utils.process_allgather(np.float64(value))))
