"""EP groups on multi-axis meshes: ranks and groups as jax.lax.axis_index sees them."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import groups

MESHES = {(2, 4): ("data", "expert"), (4, 2): ("data", "expert"),
          (2, 2, 2): ("data", "context", "expert")}


def _cases():
  for shape, names in MESHES.items():
    for size in range(1, len(names) + 1):
      for axes in itertools.combinations(names, size):
        yield shape, names, axes


@pytest.mark.parametrize("shape,names,axes", list(_cases()))
def test_rank_and_group_match_axis_index(shape, names, axes):
  mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
  others = tuple(a for a in names if a not in axes)

  def per_device(x):
    del x
    rank = jax.lax.axis_index(axes)
    index = jax.lax.axis_index(others) if others else jnp.int32(0)
    return jnp.stack([rank, index]).astype(jnp.int32)[None]

  spec = P(names)
  ids = jax.device_put(jnp.zeros((mesh.devices.size,), jnp.int32), NamedSharding(mesh, spec))
  got = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))(ids)
  got = np.asarray(got)
  order = [d.id for d in mesh.devices.flat]  # row-major: the flat order of the outputs
  for position, device_id in enumerate(order):
    group = groups.group_of(mesh, axes, device_id)
    assert (group.rank, group.index) == tuple(np.asarray(got[position])), (device_id, group)
    assert group.size == int(np.prod([mesh.shape[a] for a in axes]))
    assert group.num_groups * group.size == mesh.devices.size
    assert group.devices[group.rank] == device_id
    # Every member of the group agrees on the group.
    for member in group.devices:
      other = groups.group_of(mesh, axes, member)
      assert other.index == group.index and other.devices == group.devices


def test_axes_must_exist_be_distinct_and_in_mesh_order():
  mesh = jax.make_mesh((2, 2, 2), ("data", "context", "expert"))
  with pytest.raises(jax_ep.EpConfigError, match="not among the mesh axes"):
    groups.check_axes(mesh, ("expert", "pipe"))
  with pytest.raises(jax_ep.EpConfigError, match="repeats"):
    groups.check_axes(mesh, ("expert", "expert"))
  with pytest.raises(jax_ep.EpConfigError, match=r"mesh order, \('context', 'expert'\)"):
    groups.check_axes(mesh, ("expert", "context"))
  groups.check_axes(mesh, ("context", "expert"))
