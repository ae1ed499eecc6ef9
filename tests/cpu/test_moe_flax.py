"""jax_ep.moe.flax.MoeLayer on 4 CPU devices: its parameters carry their shardings
(experts over the EP axis), its output and gradients are moe_layer's on the same
arrays bit for bit, and the router bias moves only by update_router_bias."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_testing import make_mesh
from jax_ep import moe
from jax_ep.moe.flax import MoeLayer, RouterBias

RANKS, TOKENS = 4, 8


@pytest.fixture(name="layer")
def _layer():
  ep = jax_ep.EpConfig(num_experts=8, hidden=128, max_tokens_per_rank=TOKENS, num_topk=2)
  config = moe.MoeConfig(ep=ep, ffn_size=32, shared_ffn_size=16, router=moe.RouterConfig(
      score_function="sigmoid", num_groups=2, topk_groups=1, selection_bias=True))
  mesh = make_mesh(RANKS)
  jax_ep.initialize(ep, mesh)
  return MoeLayer(config, mesh, rngs=nnx.Rngs(0)), mesh


def _tokens(mesh):
  x = np.random.default_rng(1).standard_normal((RANKS * TOKENS, 128)).astype(np.float32)
  return jax.device_put(x, NamedSharding(mesh, P("ep")))


def test_parameters_carry_their_shardings(layer):
  module, mesh = layer
  specs = nnx.get_partition_spec(nnx.state(module))
  assert specs["w_in"] == P("ep", None, None)
  assert specs["router"] == P(None, None)
  assert module.w_in[...].sharding == NamedSharding(mesh, P("ep", None, None))
  assert isinstance(module.router_bias, RouterBias)
  assert "router_bias" not in nnx.state(module, nnx.Param)


def test_output_and_gradients_are_moe_layers(layer):
  module, mesh = layer
  x = _tokens(mesh)
  config = module.config
  specs = moe.param_specs(config)

  def functional_loss(params, tokens):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    def run(p, t):
      return moe.moe_layer(p, t, config=config).y
    return jnp.sum(jnp.sin(run(params, tokens)))

  with jax.set_mesh(mesh):
    out = module(x)
    want = jax.jit(functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                                     out_specs=P("ep"))(
        lambda p, t: moe.moe_layer(p, t, config=config).y))(module.parameters(), x)
    np.testing.assert_array_equal(np.asarray(out.y), np.asarray(want))
    assert out.load_balancing_loss.shape == (RANKS,) and out.bias_update.shape == (RANKS, 8)
    grads = nnx.grad(lambda m, t: jnp.sum(jnp.sin(m(t).y)))(module, x)
    want_grads = jax.jit(jax.grad(functional_loss))(module.parameters(), x)
  got = nnx.state(grads, nnx.Param)
  assert set(got.keys()) == set(want_grads) - {"router_bias"}
  for name in got.keys():
    np.testing.assert_array_equal(np.asarray(got[name][...]), np.asarray(want_grads[name]),
                                  err_msg=name)


def test_router_bias_moves_by_the_bias_update(layer):
  module, mesh = layer
  before = np.asarray(module.router_bias[...])
  with jax.set_mesh(mesh):
    out = module(_tokens(mesh))
  module.update_router_bias(out)
  np.testing.assert_allclose(np.asarray(module.router_bias[...]),
                             before + np.asarray(out.bias_update).mean(axis=0), rtol=0, atol=0)
  assert np.any(np.asarray(out.bias_update))
