"""jax_ep ops inside a shard_map over a subset of the mesh axes.

In ``jax.shard_map(f, mesh, ..., axis_names={"expert"})`` the other axes stay
Auto or Explicit inside ``f``. Every coordinate of those axes is an EP group
of its own, as in a shard_map over the whole mesh: an op called there runs
once per group, through a nested shard_map over the other axes. Its
token-major inputs (and the handles of earlier ops) are split over them on
their first dimension, and its results are stacked over them on their first
dimension: a group's rows, counts and layouts, one after another. A result
that is a scalar per group (``num_tokens``, ``num_dropped``, ``num_invalid``)
comes out as one value per group.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle,
                          LowLatencyDispatchResult, LowLatencyHandle)

# Fields that are a scalar per group: stacked as one value per group outside.
_PER_GROUP_SCALARS = {
    DispatchResult: ("num_tokens", "num_dropped", "num_invalid"),
    DispatchHandle: ("num_tokens",),
    ExpertMajorHandle: ("num_tokens",),
    LowLatencyDispatchResult: ("num_invalid",),
    LowLatencyHandle: (),
}


def other_axes() -> tuple[str, ...]:
  """Axes of the current mesh that are not manual, when some are (inside a
  shard_map over a subset of the axes); else ()."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  if AxisType.Manual not in types.values():
    return ()
  return tuple(name for name in mesh.axis_names if types[name] != AxisType.Manual)


def _map_scalars(tree: Any, fn: Callable) -> Any:
  """Applies fn to the per-group scalar fields of jax_ep's results and handles in tree."""
  if isinstance(tree, (tuple, list)):
    return type(tree)(_map_scalars(t, fn) for t in tree)
  fields = _PER_GROUP_SCALARS.get(type(tree))
  if fields is None:
    return tree
  changes = {name: fn(getattr(tree, name)) for name in fields}
  for nested in ("handle", "token_major"):  # handles inside results and handles
    if hasattr(tree, nested):
      changes[nested] = _map_scalars(getattr(tree, nested), fn)
  return dataclasses.replace(tree, **changes)


def per_group(op: Callable, *args, **kwargs):
  """op(*args, **kwargs) once per EP group of the non-manual axes (see above);
  call it only when other_axes() is not empty."""
  axes = other_axes()
  spec = P(axes if len(axes) > 1 else axes[0])

  def one_group(*group_args):
    group_args = _map_scalars(group_args, lambda v: v.reshape(()))
    return _map_scalars(op(*group_args, **kwargs), lambda v: v[None])

  return jax.shard_map(one_group, in_specs=spec, out_specs=spec, axis_names=set(axes))(*args)
