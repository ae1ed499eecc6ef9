"""jit + shard_map integration: check_vma, invariant inputs, meshes with more axes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
import host_reference
from ep_testing import bits, random_routing, random_rows


def test_two_axis_mesh_exchanges_within_each_ep_group():
  """On a (dp=2, ep=4) mesh each dp slice runs its own EP exchange."""
  mesh = jax.make_mesh((2, 4), ("dp", "ep"))
  config = jax_ep.EpConfig(num_experts=8, hidden=128, max_tokens_per_rank=5, num_topk=2)
  jax_ep.initialize(config, mesh)
  rng = np.random.default_rng(0)
  x = random_rows(rng, (40, 128), jnp.bfloat16)
  idx = random_routing(rng, 40, 2, 8)
  w = rng.random((40, 2), np.float32)
  spec = P(("dp", "ep"))

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec)
  def step(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config)
    out = jax_ep.combine(d.x, d.handle, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    ll_out = jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config)
    ll_ref = jax_ep.reference.low_latency_combine(
        jax_ep.reference.low_latency_dispatch(x, idx, config=config)["x"], idx, w, config=config)
    return d.x, ref["x"], out, ll_out, ll_ref

  placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, idx, w)]
  ours, ref, out, ll_out, ll_ref = (np.asarray(a) for a in step(*placed))
  np.testing.assert_array_equal(bits(ours), bits(ref))
  # Per dp group, the host oracle of that EP group (bitwise: the portable
  # combine's float32 operations; the jnp oracle fuses multiply-adds).
  for group in range(2):
    rows = slice(20 * group, 20 * (group + 1))
    g_x, g_idx, g_w = (a[rows].reshape((4, 5) + a.shape[1:]) for a in (x, idx, w))
    layout = host_reference.ll_dispatch(g_x, g_idx, config)
    want = host_reference.ll_combine(layout.x, g_idx, g_w, layout).reshape(20, 128)
    np.testing.assert_array_equal(bits(ll_out[rows]), bits(want))
  # The jnp oracle: its terms w_k * x[t] share x[t]'s sign (w >= 0), so its
  # FMAs move the float32 sum by far less than a bf16 spacing: <= 1 ulp.
  assert host_reference.ulp_distance(ll_out, ll_ref).max() <= 1
  # combine(dispatch(x).x) = x * (number of ranks the token went to), per dp
  # group: the partial sums x, 2x, ... are exact, so one rounding to bf16; the
  # sum starts from +0.0 (tokens sent nowhere give +0.0, never -0.0).
  copies = np.array([len({e // 2 for e in row if e >= 0}) for row in idx])
  expected = (np.float32(0) + x.astype(np.float32) * copies[:, None]).astype(x.dtype)
  np.testing.assert_array_equal(bits(out), bits(expected))


def test_invariant_inputs_under_check_vma():
  """Inputs replicated over the EP axis (invariant) are accepted with check_vma=True."""
  mesh = jax.make_mesh((4,), ("ep",))
  config = jax_ep.EpConfig(num_experts=8, hidden=16, max_tokens_per_rank=3, num_topk=2)
  jax_ep.initialize(config, mesh)
  rng = np.random.default_rng(1)
  x = random_rows(rng, (12, 16), jnp.float32)
  idx = random_routing(rng, 3, 2, 8)            # replicated: every rank routes alike
  w = np.ones((3, 2), np.float32)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("ep"), P(), P()),
                     out_specs=(P("ep"), P("ep")), check_vma=True)
  def step(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    layout = jax_ep.get_dispatch_layout(idx, config=config)
    return jax_ep.combine(d.x, d.handle, config=config), layout[0][None]

  out, tokens_per_rank = step(jax.device_put(x, NamedSharding(mesh, P("ep"))),
                              jax.device_put(idx, NamedSharding(mesh, P())),
                              jax.device_put(w, NamedSharding(mesh, P())))
  copies = np.array([len({e // 2 for e in row if e >= 0}) for row in idx])
  np.testing.assert_allclose(np.asarray(out), x * np.tile(copies, 4)[:, None], rtol=1e-6)
  assert tokens_per_rank.shape == (4, 4)


def test_jaxpr_outputs_are_varying_over_the_ep_axis():
  mesh = jax.make_mesh((2,), ("ep",))
  config = jax_ep.EpConfig(num_experts=4, hidden=8, max_tokens_per_rank=2, num_topk=1)
  jax_ep.initialize(config, mesh)
  seen = {}

  def body(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    seen["dispatch"] = [jax.typeof(leaf).mat.varying for leaf in jax.tree.leaves(d)]
    return d.x

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  f.trace(jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("ep"))),
          jax.ShapeDtypeStruct((4, 1), jnp.int32, sharding=NamedSharding(mesh, P("ep"))),
          jax.ShapeDtypeStruct((4, 1), jnp.float32, sharding=NamedSharding(mesh, P("ep"))))
  assert seen["dispatch"] and all("ep" in v for v in seen["dispatch"])


def test_inside_scan_over_layers():
  """Handles are pytrees that flow through lax.scan (one MoE exchange per layer)."""
  mesh = jax.make_mesh((4,), ("ep",))
  config = jax_ep.EpConfig(num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)
  jax_ep.initialize(config, mesh)
  rng = np.random.default_rng(2)
  x = random_rows(rng, (16, 16), jnp.float32)
  idx = random_routing(rng, 16, 2, 8, none_fraction=0.0)
  w = np.full((16, 2), 0.5, np.float32)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
  def layers(x, idx, w):
    def layer(h, _):
      d = jax_ep.dispatch(h, idx, w, config=config)
      y = d.x * jnp.sum(d.topk_weights, axis=1, keepdims=True)
      return jax_ep.combine(y, d.handle, config=config), d.num_tokens
    return jax.lax.scan(layer, x, None, length=3)[0]

  out = np.asarray(layers(*[jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, idx, w)]))
  # Each layer: every copy is scaled by the weights of the experts on its rank, then summed:
  # with weights 0.5 each, one layer multiplies a token by 0.5 * K = 1.
  np.testing.assert_allclose(out, x, rtol=1e-5)
