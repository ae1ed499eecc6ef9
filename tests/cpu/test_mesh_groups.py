"""The ops inside multi-axis meshes on the portable backend: 8 CPU devices as
(2, 4), (4, 2) and (2, 2, 2) meshes, EP over each axis and over tuples of axes.

Every coordinate of the non-EP axes is an EP group of its own: each group's
results must equal the host oracle (tests/host_reference.py) run on that group's
inputs alone, bitwise for dispatched rows, counts and the combines (the portable
backend sums in the contract's order), and for the gradients, which are checked
against the same op on a one-axis mesh of the group (the VJPs themselves are
checked against the oracle in test_host_reference.py and test_grad.py).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import groups
import host_reference as hr
from ep_testing import bits, random_routing, random_rows

MESHES = {(2, 4): ("data", "expert"), (4, 2): ("data", "expert"),
          (2, 2, 2): ("data", "context", "expert")}
E_LOCAL, K, T, H = 4, 4, 8, 32


def _cases():
  for shape, names in MESHES.items():
    for size in (1, 2):
      for axes in itertools.combinations(names, size):
        yield shape, names, axes[0] if size == 1 else axes


CASES = list(_cases())


def _mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def _inputs(num_devices: int, num_experts: int, seed: int):
  rng = np.random.default_rng(seed)
  x = random_rows(rng, (num_devices, T, H), jnp.bfloat16)
  idx = np.stack([random_routing(rng, T, K, num_experts, none_fraction=0.2)
                  for _ in range(num_devices)])
  idx[0, 0, 0] = num_experts + 2  # invalid: counted, never used
  w = (rng.integers(1, 8, (num_devices, T, K)) / 8).astype(np.float32)
  return x, idx, w


def _run(fn, mesh, *device_major):
  """jit(shard_map(fn)) over every mesh axis; inputs [N, ...] in the mesh's flat
  device order; returns outputs as [N, ...] numpy, same order."""
  spec = P(mesh.axis_names)
  args = [jax.device_put(np.asarray(a).reshape((-1,) + a.shape[2:]), NamedSharding(mesh, spec))
          for a in device_major]

  def per_shard(*shards):
    return jax.tree.map(lambda o: o[None], fn(*shards))

  out = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))(*args)
  return jax.tree.map(np.asarray, out)


def _groups(mesh, axes):
  """[(flat positions of the group's members in EP-rank order)] for every group."""
  flat = {d.id: i for i, d in enumerate(mesh.devices.flat)}
  seen = {}
  for device in mesh.devices.flat:
    group = groups.group_of(mesh, groups.ep_axes(axes), device.id)
    seen[group.index] = [flat[d] for d in group.devices]
  return [seen[g] for g in sorted(seen)]


def _bitwise(actual, expected, name):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.shape == expected.shape and actual.dtype == expected.dtype, (name, actual.shape,
                                                                           expected.shape)
  np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=name)


@pytest.mark.parametrize("shape,names,axes", CASES,
                         ids=[f"{'x'.join(map(str, s))}-{a}" for s, _, a in CASES])
def test_every_group_matches_its_own_host_oracle(shape, names, axes):
  mesh = _mesh(shape, names)
  num_ranks = groups.group_size(mesh, groups.ep_axes(axes))
  config = jax_ep.EpConfig(num_experts=E_LOCAL * num_ranks, hidden=H, max_tokens_per_rank=T,
                           num_topk=K, group=jax_ep.EpGroup(axis_name=axes))
  jax_ep.initialize(config, mesh)
  x, idx, w = _inputs(mesh.devices.size, config.num_experts, seed=7 * num_ranks + len(names))

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    return (d, jax_ep.combine(d.x, d.handle, config=config), ll,
            jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config),
            jax.lax.axis_index(config.axis_name))

  d, ht_out, ll, ll_out, ep_rank = _run(fn, mesh, x, idx, w)
  for members in _groups(mesh, axes):
    np.testing.assert_array_equal(ep_rank[members], np.arange(num_ranks))
    gx, gidx, gw = x[members], idx[members], w[members]
    want = hr.ht_dispatch(gx, gidx, gw, config)
    for name in ("x", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
                 "num_dropped", "num_invalid"):
      _bitwise(getattr(d, name)[members], getattr(want, name), name)
    _bitwise(d.handle.recv_src[members], want.recv_src, "recv_src")
    _bitwise(ht_out[members], hr.ht_combine(want.x, want), "HT combine")
    ll_want = hr.ll_dispatch(gx, gidx, config)
    _bitwise(ll.count[members], ll_want.count, "LL count")
    _bitwise(ll.handle.recv_src[members], ll_want.recv_src, "LL recv_src")
    valid = np.arange(ll.x.shape[2])[None, None, :] < ll.count[members][..., None]
    _bitwise(ll.x[members][valid], ll_want.x[valid], "LL rows")
    _bitwise(ll_out[members], hr.ll_combine(ll_want.x, gidx, gw, ll_want), "LL combine")


@pytest.mark.parametrize("shape,names,axes", [((2, 4), ("data", "expert"), "expert"),
                                              ((4, 2), ("data", "expert"), "data"),
                                              ((2, 2, 2), ("data", "context", "expert"),
                                               ("context", "expert"))])
def test_gradients_per_group_equal_the_one_axis_mesh_of_the_group(shape, names, axes):
  """jax.grad through HT and LL dispatch -> expert -> combine, w.r.t. x and
  topk_weights: each group's gradients equal those of the same computation on a
  one-axis mesh holding that group alone."""
  mesh = _mesh(shape, names)
  num_ranks = groups.group_size(mesh, groups.ep_axes(axes))
  kwargs = dict(num_experts=E_LOCAL * num_ranks, hidden=H, max_tokens_per_rank=T, num_topk=K)
  config = jax_ep.EpConfig(**kwargs, group=jax_ep.EpGroup(axis_name=axes))
  x, idx, w = _inputs(mesh.devices.size, config.num_experts, seed=99)
  cot = random_rows(np.random.default_rng(5), (mesh.devices.size, T, H), jnp.float32)

  def grads(config):
    def fn(x, idx, w, cot):
      def loss(x, w):
        d = jax_ep.dispatch(x, idx, w, config=config)
        y = (d.x.astype(jnp.float32) * jnp.sum(d.topk_weights, 1, keepdims=True)).astype(
            jnp.bfloat16)
        ll = jax_ep.low_latency_dispatch(x, idx, config=config)
        out = (jax_ep.combine(y, d.handle, config=config).astype(jnp.float32)
               + jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config).astype(
                   jnp.float32))
        return jnp.sum(out * cot)
      return jax.grad(loss, argnums=(0, 1))(x, w)
    return fn

  jax_ep.initialize(config, mesh)
  got = _run(grads(config), mesh, x, idx, w, cot)
  for members in _groups(mesh, axes):
    one_axis = jax.make_mesh((num_ranks,), ("ep",),
                             devices=[mesh.devices.flat[i] for i in members])
    alone = jax_ep.EpConfig(**kwargs, group=jax_ep.EpGroup(axis_name="ep"))
    jax_ep.initialize(alone, one_axis)
    want = _run(grads(alone), one_axis, x[members], idx[members], w[members], cot[members])
    for a, b, name in zip(got, want, ("grad x", "grad w")):
      _bitwise(a[members], b, name)
    jax_ep.initialize(config, mesh)


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_shard_map_over_the_ep_axis_alone_runs_each_group(axis_type):
  """shard_map(axis_names={"expert"}) on a (2, 4) mesh: the ops run once per
  coordinate of "data" (a nested shard_map), each group equal to the same group
  in a shard_map over the whole mesh; per-group scalars come out one per group."""
  types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
  mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8],
                       axis_types=(types[axis_type],) * 2)
  config = jax_ep.EpConfig(num_experts=16, hidden=H, max_tokens_per_rank=T, num_topk=K,
                           group=jax_ep.EpGroup(axis_name="expert"))
  jax_ep.initialize(config, mesh)
  x, idx, w = _inputs(8, config.num_experts, seed=11)

  def ops(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    em = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major", expert_alignment=4)
    return (d.x, d.num_tokens, d.tokens_per_expert, jax_ep.combine(d.x, d.handle, config=config),
            ll.count, jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config),
            em.x, em.group_sizes, jax_ep.combine(em.x, em.handle, config=config))

  # Partial: blocks of the global inputs, in the order the two shard_maps split them:
  # "expert" coordinate e takes block e of 4, then "data" coordinate d takes half d of it.
  order = [e * 2 + d for d in range(2) for e in range(4)]  # partial block of device (d, e)
  partial_in = [np.concatenate([a[order.index(b)] for b in range(8)]) for a in (x, idx, w)]
  in_spec = P("expert")
  args = [jax.device_put(a, NamedSharding(mesh, P(("expert", "data")))) for a in partial_in]
  partial = jax.jit(jax.shard_map(ops, mesh=mesh, in_specs=in_spec, out_specs=in_spec,
                                  axis_names={"expert"}))(*args)
  partial = [np.asarray(p) for p in partial]
  assert partial[1].shape == (8,)  # num_tokens: one per group (and expert shard)
  full = _run(ops, mesh, x, idx, w)
  for name, got, want in zip(("x", "num_tokens", "tokens_per_expert", "HT combine", "LL count",
                               "LL combine", "expert-major x", "group_sizes",
                               "expert-major combine"), partial, full):
    per_block = got.reshape((8, -1) + got.shape[1:])  # partial block b, in global order
    for device in range(8):
      _bitwise(per_block[order[device]].reshape(np.shape(want[device])), want[device], name)


def test_split_ops_need_every_axis_manual():
  mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8])
  config = jax_ep.EpConfig(num_experts=16, hidden=H, max_tokens_per_rank=T, num_topk=K,
                           group=jax_ep.EpGroup(axis_name="expert"))
  jax_ep.initialize(config, mesh)
  x, idx, _ = _inputs(8, config.num_experts, seed=3)
  args = [jax.device_put(a.reshape((-1,) + a.shape[2:]), NamedSharding(mesh, P(("expert",
                                                                                 "data"))))
          for a in (x, idx)]
  send = lambda x, i: jax_ep.low_latency_dispatch_send(x, i, config=config).live  # noqa: E731
  with pytest.raises(jax_ep.EpConfigError, match="need a shard_map over every mesh axis"):
    jax.jit(jax.shard_map(send, mesh=mesh, in_specs=P("expert"), out_specs=P(),
                          axis_names={"expert"})).trace(*args)
