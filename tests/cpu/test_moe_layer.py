"""jax_ep.moe.moe_layer on 4 CPU devices (the portable backend) against the dense
float64 oracle (tests/gpu/moe_oracle.py): y, the chosen experts and every gradient,
for each layer kind and routing kind; and its trace-time errors."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))

import moe_testing  # noqa: E402
from ep_testing import make_mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402
from jax_ep.errors import EpConfigError  # noqa: E402

RANKS, TOKENS = 4, 8


def _ep_config(**kwargs):
  base = dict(num_experts=8, hidden=128, max_tokens_per_rank=TOKENS, num_topk=2,
              group=jax_ep.EpGroup(axis_name="ep"))
  base.update(kwargs)
  return jax_ep.EpConfig(**base)


@pytest.mark.parametrize("routing", moe_testing.ROUTINGS)
@pytest.mark.parametrize("name", sorted(moe_testing.LAYERS))
def test_layer_matches_dense_float64(name, routing):
  ep = _ep_config()
  config = moe_testing.layer_config(name, ep)
  mesh = make_mesh(RANKS)
  jax_ep.initialize(ep, mesh)
  params, x, dy = moe_testing.make_problem(config, RANKS, TOKENS, routing, jnp.float32)
  got = moe_testing.run_layer(config, mesh, params, x, dy, jnp.float32)
  y, idx, g_x, g_params = got
  replicated = {k: v.sum(axis=0) if v.shape[0] == RANKS and k not in moe.params.EXPERT_PARAMS
                else v for k, v in g_params.items()}
  for rank in range(RANKS):
    tokens = slice(rank * TOKENS, (rank + 1) * TOKENS)
    e_local = ep.num_experts // RANKS
    experts = slice(rank * e_local, (rank + 1) * e_local)
    shard = {k: (v[experts] if k in moe.params.EXPERT_PARAMS else v)
             for k, v in replicated.items()}
    moe_testing.check_shard(config, params, x, dy, (y[tokens], idx[tokens], g_x[tokens], shard),
                            tokens, rank, RANKS, jnp.float32, replicated_summed=True)
  if routing == "all_to_rank_0":
    assert np.all(idx < ep.num_experts // RANKS)


def test_balance_outputs_match_their_definitions():
  ep = _ep_config()
  config = moe.MoeConfig(ep=ep, ffn_size=16, router=moe.RouterConfig(
      score_function="sigmoid", selection_bias=True), stats_axes=("ep",), bias_update_rate=0.1)
  mesh = make_mesh(RANKS)
  jax_ep.initialize(ep, mesh)
  params, x, _ = moe_testing.make_problem(config, RANKS, TOKENS, "uniform", jnp.float32)
  specs = moe.param_specs(config)

  def per_shard(p, xx):
    out = moe.moe_layer(p, xx, config=config)
    return (out.tokens_per_expert, out.load_balancing_loss[None], out.router_z_loss[None],
            out.bias_update[None], out.dropped[None])

  fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(specs, P("ep")),
                             out_specs=(P("ep"),) * 5))
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  tpe, lb, z, bias_update, dropped = fn(placed, jax.device_put(x, NamedSharding(mesh, P("ep"))))
  logits = x.astype(np.float64) @ params["router"]
  scores = 1 / (1 + np.exp(-logits))
  choice = scores + params["router_bias"]
  idx = np.argsort(-choice, axis=1, kind="stable")[:, :ep.num_topk]
  counts = np.bincount(idx.reshape(-1), minlength=ep.num_experts)
  np.testing.assert_array_equal(np.asarray(tpe), counts)        # per expert, EP-group sums
  probs = scores / scores.sum(axis=1, keepdims=True)
  expected_lb = ep.num_experts * np.sum(counts / (len(x) * ep.num_topk) * probs.mean(axis=0))
  np.testing.assert_allclose(np.asarray(lb), expected_lb, rtol=1e-5)   # every rank: batch-wide
  lse = np.log(np.exp(logits).sum(axis=1))
  np.testing.assert_allclose(np.asarray(z), np.mean(lse**2), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(bias_update)[0],
                                0.1 * np.sign(counts.mean() - counts).astype(np.float32))
  assert not np.any(np.asarray(dropped))


def _trace(config, params, x, num_ranks=RANKS):
  mesh = make_mesh(num_ranks)
  specs = {k: moe.param_specs(config).get(k, P()) for k in params}
  placed = lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                sharding=NamedSharding(mesh, spec))
  params = {k: placed(v, specs[k]) for k, v in params.items()}
  x = placed(x, P("ep"))
  fn = jax.shard_map(lambda p, xx: moe.moe_layer(p, xx, config=config).y, mesh=mesh,
                     in_specs=(specs, P("ep")), out_specs=P("ep"))
  return jax.eval_shape(fn, params, x)


def test_bad_inputs_are_refused_at_trace_time():
  ep = _ep_config()
  config = moe.MoeConfig(ep=ep, ffn_size=16)
  jax_ep.initialize(ep, make_mesh(RANKS))
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in moe.global_shapes(config).items()}
  x = jax.ShapeDtypeStruct((RANKS * TOKENS, 128), jnp.bfloat16)
  _trace(config, params, x)       # the good case traces
  with pytest.raises(EpConfigError, match=r"params\['w_in'\] must be"):
    _trace(config, dict(params, w_in=jax.ShapeDtypeStruct((8, 128, 16), jnp.float32)), x)
  with pytest.raises(EpConfigError, match=r"x must be \[T, H=128\]"):
    _trace(config, params, jax.ShapeDtypeStruct((RANKS * TOKENS, 64), jnp.bfloat16))
  with pytest.raises(EpConfigError, match="x must be floating"):
    _trace(config, params, jax.ShapeDtypeStruct((RANKS * TOKENS, 128), jnp.int32))
  with pytest.raises(EpConfigError, match="lack"):
    _trace(config, {k: v for k, v in params.items() if k != "w_out"}, x)
  with pytest.raises(EpConfigError, match="more than the HT limit"):
    _trace(config, params, jax.ShapeDtypeStruct((RANKS * TOKENS * 2, 128), jnp.bfloat16))
  six_experts = moe.MoeConfig(ep=_ep_config(num_experts=6), ffn_size=16)
  with pytest.raises(EpConfigError, match="divisible by the EP group size"):
    six_experts.param_shapes(RANKS)     # what moe_layer checks first
  with pytest.raises(EpConfigError, match="cannot exceed num_experts"):
    _ep_config(num_topk=9)
  with pytest.raises(EpConfigError, match="multiple of 128"):
    moe.MoeConfig(ep=_ep_config(hidden=64), ffn_size=16, fp8=True)
  with pytest.raises(EpConfigError, match="cannot be chosen"):
    moe.MoeConfig(ep=_ep_config(num_topk=4), ffn_size=16,
                  router=moe.RouterConfig(num_groups=4, topk_groups=1))
  with pytest.raises(EpConfigError, match="shard_map"):
    moe.moe_layer({}, jnp.zeros((4, 128)), config=config)


def test_layer_on_a_data_by_expert_mesh_matches_dense_float64():
  """Tokens split over data x expert, experts over expert alone (an EP group per data
  coordinate); gradients of the global loss, the expert weights' summed over data."""
  ep = jax_ep.EpConfig(num_experts=8, hidden=128, max_tokens_per_rank=TOKENS, num_topk=2,
                       group=jax_ep.EpGroup(axis_name="expert"))
  config = moe.MoeConfig(ep=ep, ffn_size=32, shared_ffn_size=16)
  mesh = jax.make_mesh((2, 2), ("data", "expert"), devices=jax.devices()[:4])
  jax_ep.initialize(ep, mesh)
  params, x, dy = moe_testing.make_problem(config, 4, TOKENS, "uniform", jnp.float32)
  specs = moe.param_specs(config)
  rows = P(("data", "expert"))

  def loss(p, xx):
    y = jax.shard_map(lambda pp, t: moe.moe_layer(pp, t, config=config).y, mesh=mesh,
                      in_specs=(specs, rows), out_specs=rows)(p, xx)
    return jnp.sum(y * dy), y

  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  (_, y), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      placed, jax.device_put(x, NamedSharding(mesh, rows)))
  import moe_oracle  # pylint: disable=import-outside-toplevel
  y64, y_abs, _, (g64, gx64) = moe_oracle.reference(params, x, config, slice(None), dy)
  constant = moe_oracle.error_constant(config, jnp.float32)
  moe_oracle.check_close("y", y, y64, constant, y_abs)
  moe_oracle.check_close("grad x", g_x, gx64, constant * moe_oracle.STAGES, np.max(np.abs(gx64)))
  for name, grad in g_params.items():
    moe_oracle.check_close(f"grad {name}", grad, g64[name], constant * moe_oracle.STAGES,
                           np.max(np.abs(g64[name])))


def test_router_logits_are_full_float32():
  """The router's matmul asks for precision HIGHEST: at DEFAULT a GPU runs float32
  matmuls in TF32, whose error in the logits flipped a near-tied expert in the
  one-GPU suite at N = 4 (2026-12-07, docs/reliability.md)."""
  ep = _ep_config()
  config = moe.MoeConfig(ep=ep, ffn_size=16)
  mesh = make_mesh(RANKS)
  jax_ep.initialize(ep, mesh)
  specs = moe.param_specs(config)
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, specs[k]))
            for k, s in moe.global_shapes(config).items()}
  x = jax.ShapeDtypeStruct((RANKS * TOKENS, 128), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("ep")))
  fn = jax.shard_map(lambda p, t: moe.moe_layer(p, t, config=config).y, mesh=mesh,
                     in_specs=(specs, P("ep")), out_specs=P("ep"))
  closed = jax.make_jaxpr(fn)(params, x)
  router_dots = [eqn for eqn in _equations(closed.jaxpr) if eqn.primitive.name == "dot_general"
                 and eqn.outvars[0].aval.shape == (TOKENS, ep.num_experts)
                 and eqn.outvars[0].aval.dtype == jnp.float32]
  assert router_dots, "no [T, E] float32 dot_general in the layer's jaxpr"
  for eqn in router_dots:
    assert eqn.params["precision"] in ((jax.lax.Precision.HIGHEST,) * 2,
                                       jax.lax.Precision.HIGHEST), eqn.params["precision"]


def _equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs inside it (shard_map, pjit, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _equations(inner)
