"""EP groups inside multi-axis meshes, on the kernels (run under jax_ep.launch).

The N processes (one device each) form a 2-D mesh ("a", "b"); EP runs over one
axis, so every coordinate of the other axis is an EP group of its own, or over
both (one group). Each group's results are checked against the host oracle of
that group alone: the group's inputs, in EP-rank order, through
tests/host_reference.py. EP over the major axis "a" puts non-consecutive
processes (PEs) in one group: the kernels' rank -> PE table (cuda/transport.cuh)
is what makes that work.

N = 4 runs the (2, 2) mesh; N = 8 the (2, 4) and (4, 2) meshes; other N have
no test here.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import groups
import host_reference as hr
from gpu_testing import BF16, F32, assert_bitwise, global_routing, rng, rows, setup_mesh

MESHES = {4: [(2, 2)], 8: [(2, 4), (4, 2)]}
# Collected at 4 and 8 processes only (conftest.GROUP_MESH_PROCESSES), so no
# empty parameter set is skipped elsewhere.
CASES = [(shape, axes) for shape in MESHES.get(jax.process_count(), [])
         for axes in ("a", "b", ("a", "b"))]
E_PER_RANK, K, T, H = 4, 4, 32, 256


def _mesh(shape) -> jax.sharding.Mesh:
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  return jax.make_mesh(shape, ("a", "b"), devices=devices)


def _run(fn, mesh, *global_args):
  """jit(shard_map(fn)) over the whole mesh: global [N, ...] inputs, one row per
  process in process order (= the mesh's flat order); returns this process's outputs."""
  spec = P(mesh.axis_names)
  sharding = NamedSharding(mesh, spec)
  me = jax.process_index()
  args = [jax.make_array_from_process_local_data(sharding, np.asarray(a)[me][None],
                                                 np.asarray(a).shape) for a in global_args]

  def per_shard(*shards):
    return jax.tree.map(lambda o: o[None], fn(*[s[0] for s in shards]))

  out = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))(*args)
  return jax.tree.map(lambda o: np.asarray(o.addressable_shards[0].data)[0], out)


@pytest.mark.parametrize("shape,axes", CASES, ids=[f"{s[0]}x{s[1]}-{a}" for s, a in CASES])
def test_each_group_matches_its_own_host_oracle(shape, axes):
  mesh = _mesh(shape)
  group = groups.group_of(mesh, groups.ep_axes(axes), jax.local_devices()[0].id)
  r = group.size
  config = setup_mesh(mesh, num_experts=E_PER_RANK * r, hidden=H, max_tokens_per_rank=T,
                      num_topk=K, axis_name=axes)
  n = jax.process_count()
  gen = rng(3000 + 10 * r + len(groups.ep_axes(axes)))
  x = rows(gen, (n, T, H))
  idx = global_routing(gen, (n,), T, K, config.num_experts)
  w = np.asarray(gen.integers(1, 8, (n, T, K)) / 8, F32)  # dyadic: exact sums

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ht_out = jax_ep.combine(d.x, d.handle, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    ll_out = jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config)
    return d, ht_out, ll, ll_out

  d, ht_out, ll, ll_out = _run(fn, mesh, x, idx, w)

  # The host oracle of this process's group alone, its members in EP-rank order.
  members = list(group.processes)
  gx, gidx, gw = x[members], idx[members], w[members]
  want = hr.ht_dispatch(gx, gidx, gw, config)
  me = group.rank
  for name in ("x", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
               "num_dropped"):
    assert_bitwise(getattr(d, name), getattr(want, name)[me], name)
  assert_bitwise(d.handle.recv_src, want.recv_src[me], "recv_src")
  assert_bitwise(ht_out, hr.ht_combine(want.x, want)[me], "HT combine")
  ll_want = hr.ll_dispatch(gx, gidx, config)
  assert_bitwise(ll.count, ll_want.count[me], "LL count")
  assert_bitwise(ll.handle.recv_src, ll_want.recv_src[me], "LL recv_src")
  valid = np.arange(ll.x.shape[1])[None, :] < ll.count[:, None]
  assert_bitwise(ll.x[valid], ll_want.x[me][valid], "LL rows")
  assert_bitwise(ll_out, hr.ll_combine(ll_want.x, gidx, gw, ll_want)[me], "LL combine")
  assert ll_out.dtype == BF16 and ht_out.dtype == BF16
