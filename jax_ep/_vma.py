"""Varying-manual-axes bookkeeping for ffi_call inside shard_map(check_vma=True).

An ffi_call's results are invariant unless declared otherwise, and its inputs
must agree on which manual axes they vary over. These helpers make every
custom call in jax_ep take inputs of one varying set and return results varying
over the same set.
"""

from __future__ import annotations

from typing import Sequence

import jax


def vma_of(x: jax.Array) -> frozenset:
  """Manual mesh axes ``x`` varies over (empty outside shard_map)."""
  return frozenset(jax.typeof(x).mat.varying)


def match_vma(*arrays: jax.Array, extra_axes: Sequence[str] = ()) -> list[jax.Array]:
  """pcast each array to vary over the union of all arrays' axes plus extra_axes."""
  target = frozenset(extra_axes).union(*(vma_of(a) for a in arrays))
  matched = []
  for a in arrays:
    missing = tuple(sorted(target - vma_of(a)))
    matched.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return matched


def vary_like(x: jax.Array, like: jax.Array) -> jax.Array:
  """pcast ``x`` to vary over ``like``'s manual axes too (a kernel such as a
  Pallas call may return a result that varies over none of them)."""
  missing = tuple(sorted(vma_of(like) - vma_of(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def result_type(shape: Sequence[int], dtype, like: jax.Array):
  """An unsharded per-shard result type varying over the same manual axes as ``like``."""
  aval = jax.typeof(like)
  unsharded = jax.sharding.NamedSharding(aval.sharding.mesh,
                                         jax.sharding.PartitionSpec(*([None] * len(shape))))
  return aval.update(shape=tuple(shape), dtype=dtype, sharding=unsharded)
