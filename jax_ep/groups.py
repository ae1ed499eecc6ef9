"""EP groups on a mesh: which devices exchange tokens with which.

The EP axes (``EpGroup.axis_name``: one mesh axis or a tuple of them, in mesh
order) span one EP group for every coordinate of the other axes. Inside a
group, a device's EP rank is its linearised index over the EP axes, the first
axis major: what ``jax.lax.axis_index(axes)`` returns inside ``shard_map``.

Pure functions of the mesh; the runtime (jax_ep/runtime.py) keeps the result.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np

from jax_ep.errors import EpConfigError


def ep_axes(axis_name: str | tuple[str, ...]) -> tuple[str, ...]:
  """The EP axes as a tuple."""
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axes(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> None:
  """Raises EpConfigError unless `axes` are distinct axes of `mesh`, in mesh order."""
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise EpConfigError(f"EpGroup.axis_name {axes if len(axes) > 1 else axes[0]!r}: "
                        f"{missing} not among the mesh axes {mesh.axis_names}")
  if len(set(axes)) != len(axes):
    raise EpConfigError(f"EpGroup.axis_name {axes!r} repeats an axis")
  positions = [mesh.axis_names.index(a) for a in axes]
  if positions != sorted(positions):
    in_order = tuple(a for a in mesh.axis_names if a in axes)
    raise EpConfigError(
        f"EpGroup.axis_name {axes!r} must list its axes in mesh order, {in_order!r}: the EP "
        "rank is the index linearised over them, first axis major")


def group_size(mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> int:
  """R: devices per EP group."""
  return int(np.prod([mesh.shape[a] for a in axes]))


@dataclasses.dataclass(frozen=True)
class EpGroup:
  """One EP group of a mesh, seen from one of its devices.

  Attributes:
    axes: the EP axes, in mesh order.
    size: R, devices in the group.
    index: which group: the device's linearised coordinate over the other axes
      (0 when the EP axes are the whole mesh).
    num_groups: how many groups the mesh has.
    rank: the device's EP rank in the group.
    processes: process index of EP rank r's device, r = 0 .. R-1.
    devices: device id of EP rank r's device.
  """

  axes: tuple[str, ...]
  size: int
  index: int
  num_groups: int
  rank: int
  processes: tuple[int, ...]
  devices: tuple[int, ...]


def group_of(mesh: jax.sharding.Mesh, axes: tuple[str, ...], device_id: int) -> EpGroup:
  """The EP group of the device with id `device_id` (raises if it is not in the mesh)."""
  check_axes(mesh, axes)
  names = mesh.axis_names
  ep_dims = [names.index(a) for a in axes]
  other_dims = [d for d in range(len(names)) if d not in ep_dims]
  devices = mesh.devices
  where = np.argwhere(np.vectorize(lambda d: d.id)(devices) == device_id)
  if len(where) != 1:
    raise EpConfigError(f"device {device_id} is not in the mesh (or appears twice)")
  coords = tuple(int(c) for c in where[0])
  members = []
  for ep_coords in itertools.product(*(range(devices.shape[d]) for d in ep_dims)):
    full = list(coords)
    for d, c in zip(ep_dims, ep_coords):
      full[d] = c
    members.append(devices[tuple(full)])
  rank = int(np.ravel_multi_index([coords[d] for d in ep_dims],
                                  [devices.shape[d] for d in ep_dims]))
  index = (int(np.ravel_multi_index([coords[d] for d in other_dims],
                                    [devices.shape[d] for d in other_dims]))
           if other_dims else 0)
  num_groups = int(np.prod([devices.shape[d] for d in other_dims])) if other_dims else 1
  return EpGroup(axes=tuple(axes), size=len(members), index=index, num_groups=num_groups,
                 rank=rank, processes=tuple(int(d.process_index) for d in members),
                 devices=tuple(int(d.id) for d in members))
