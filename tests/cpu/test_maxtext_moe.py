"""jax_ep.moe.moe_layer with jax_ep.moe.maxtext's mapping against MaxText 0.2.5's own
routed MoE layer (maxtext.layers.moe.RoutedMoE, from requirements-dev.txt), both in
float32 on CPU with the same random weights: the same experts chosen, and y within
twice the first-order float32 error bound of tests/gpu/moe_oracle.py (each layer
is within it of the exact result).

MaxText runs on its own mesh of all 8 CPU devices (batch and positions split, no
expert parallelism: XLA:CPU has no ragged_all_to_all); jax_ep on a 4-device "ep" mesh.
"""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))

import moe_oracle  # noqa: E402
from ep_testing import make_mesh  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402
from jax_ep.moe.maxtext import params_from_maxtext, router_from_maxtext  # noqa: E402

# Not skipped when missing: MaxText is pinned in requirements-dev.txt.
from flax import nnx  # noqa: E402
from flax.linen import partitioning as nn_partitioning  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.layers import moe as maxtext_moe  # noqa: E402
from maxtext.layers.initializers import nd_dense_init  # noqa: E402
from maxtext.utils import maxtext_utils  # noqa: E402

BATCH, SEQ, EMB, MLP, EXPERTS, TOPK = 2, 8, 128, 32, 8, 2
RANKS = 4
DEEPSEEK = dict(decoder_block="deepseek", routed_score_func="sigmoid", routed_scaling_factor=2.5)

# name -> MaxText config overrides (the routing ones go to router_from_maxtext too).
CASES = {
    "mixtral_sparse": dict(decoder_block="mixtral", sparse_matmul=True),
    "mixtral_dense": dict(decoder_block="mixtral", sparse_matmul=False),
    "deepseek_sigmoid": dict(DEEPSEEK, sparse_matmul=True),
    "deepseek_softmax_v2": dict(DEEPSEEK, routed_score_func="softmax", sparse_matmul=True),
    # MaxText's deepseek_routing: bias-corrected choice among the 2 best of 4 groups.
    "deepseek3_bias_groups": dict(DEEPSEEK, sparse_matmul=True, model_name="deepseek3-test",
                                  override_model_config=True, routed_bias=True,
                                  n_routing_groups=4, topk_routing_group=2),
}
ROUTER_KEYS = ("decoder_block", "routed_score_func", "routed_scaling_factor", "model_name",
               "n_routing_groups", "topk_routing_group", "routed_bias")


def maxtext_config(batch: int, seq: int, **overrides):
  """A pyconfig for one float32 RoutedMoE with SwiGLU experts, dropless, no EP/TP."""
  base_yml = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
  settings = dict(
      run_name="jax_ep_maxtext_test", base_output_directory="/tmp/jax_ep_maxtext_test",
      enable_checkpointing=False, log_config=False, skip_jax_distributed_system=True,
      hardware="cpu", num_experts=EXPERTS, num_experts_per_tok=TOPK, base_emb_dim=EMB,
      base_mlp_dim=MLP, base_moe_mlp_dim=MLP, mlp_activations=["silu", "linear"],
      dtype="float32", weight_dtype="float32", matmul_precision="highest",
      float32_gate_logits=True, megablox=False, use_tokamax_gmm=False, use_gmm_v2=False,
      capacity_factor=-1.0, load_balance_loss_weight=0.0, max_target_length=seq,
      # MaxText's mesh spans every CPU device: the batch rows over "fsdp", the positions
      # over "context" (the activations must split evenly), the global batch the input's.
      per_device_batch_size=batch / jax.device_count(), ici_fsdp_parallelism=batch,
      ici_context_parallelism=jax.device_count() // batch, ici_expert_parallelism=1,
      ici_tensor_parallelism=1, dcn_data_parallelism=-1)
  settings.update(overrides)
  return pyconfig.initialize([sys.argv[0], base_yml], **settings)


def build_maxtext_moe(cfg):
  """(RoutedMoE, its mesh), built as MaxText's mixtral model builds its MoE."""
  mesh = Mesh(maxtext_utils.create_device_mesh(cfg), cfg.mesh_axes)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
    layer = maxtext_moe.RoutedMoE(
        config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        mesh=mesh, kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
        kernel_axes=("embed", None), intermediate_dim=cfg.moe_mlp_dim, dtype=jnp.float32,
        weight_dtype=jnp.float32, rngs=nnx.Rngs(params=0))
  return layer, mesh


def load_maxtext_weights(layer, weights: dict) -> None:
  """Overwrites the layer's parameters in place with weights' (MaxText's layout)."""
  targets = dict(gate_kernel=layer.gate.kernel, wi_0=layer.wi_0, wi_1=layer.wi_1, wo=layer.wo)
  if "gate_bias" in weights:
    targets["gate_bias"] = layer.gate.bias
  assert sorted(targets) == sorted(weights)
  for name, var in targets.items():
    value = jnp.asarray(weights[name], jnp.float32)
    assert var[...].shape == value.shape, (name, var[...].shape, value.shape)
    var[...] = value


def run_maxtext(cfg, weights: dict, x: np.ndarray):
  """MaxText's (y [B, S, H], chosen experts int [B, S, K]) for x [B, S, H]."""
  layer, mesh = build_maxtext_moe(cfg)
  load_maxtext_weights(layer, weights)
  with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
    xx = jnp.asarray(x, jnp.float32)
    y, _, _ = layer(xx)
    _, idx = layer.get_topk(*layer.gate(xx))
  return np.asarray(y), np.asarray(idx)


def run_jax_ep(config: moe.MoeConfig, params: dict, x: np.ndarray):
  """moe_layer's (y [T, H], topk_idx [T, K]) for the tokens x [T, H] over RANKS ranks."""
  mesh = make_mesh(RANKS)
  jax_ep.initialize(config.ep, mesh)
  specs = moe.param_specs(config)
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                     out_specs=(P("ep"), P("ep")))
  def layer(p, xs):
    out = moe.moe_layer(p, xs, config=config)
    return out.y, out.topk_idx

  y, idx = layer(placed, jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("ep"))))
  return np.asarray(y), np.asarray(idx)


def random_weights(seed: int, with_bias: bool) -> dict:
  """MaxText-layout float32 weights, N(0, 1/fan_in) (logits of unit size)."""
  rng = np.random.default_rng(seed)
  def normal(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
  weights = dict(gate_kernel=normal(EMB, EXPERTS), wi_0=normal(EXPERTS, EMB, MLP),
                 wi_1=normal(EXPERTS, EMB, MLP), wo=normal(EXPERTS, MLP, EMB))
  if with_bias:
    # Of the sigmoid scores' spread, so that the bias changes some choices.
    weights["gate_bias"] = (0.1 * rng.standard_normal(EXPERTS)).astype(np.float32)
  return weights


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_layer_matches_maxtext_routed_moe(case):
  overrides = CASES[case]
  weights = random_weights(0, overrides.get("routed_bias", False))
  x = np.random.default_rng(1).standard_normal((BATCH, SEQ, EMB)).astype(np.float32)
  tokens = BATCH * SEQ

  y_maxtext, idx_maxtext = run_maxtext(maxtext_config(BATCH, SEQ, **overrides), weights, x)

  router = router_from_maxtext(**{k: v for k, v in overrides.items() if k in ROUTER_KEYS})
  ep = jax_ep.EpConfig(num_experts=EXPERTS, hidden=EMB, max_tokens_per_rank=tokens // RANKS,
                       num_topk=TOPK, group=jax_ep.EpGroup(axis_name="ep"))
  config = moe.MoeConfig(ep=ep, ffn_size=MLP, activation="swiglu", router=router)
  params = params_from_maxtext(**weights)
  x2 = x.reshape(tokens, EMB)
  y_ep, idx_ep = run_jax_ep(config, params, x2)

  # The float64 routing of the mapped router, and the size of the terms rounded.
  _, y_abs, idx64, _ = moe_oracle.reference(params, x2, config, slice(None))
  idx64 = np.asarray(idx64)
  np.testing.assert_array_equal(np.sort(idx_maxtext.reshape(tokens, TOPK), axis=1),
                                np.sort(idx64, axis=1), err_msg="MaxText's choice")
  np.testing.assert_array_equal(np.sort(idx_ep, axis=1), np.sort(idx64, axis=1),
                                err_msg="jax_ep's choice")
  if router.selection_bias or router.num_groups > 1:
    # The bias and the groups must each change some choice, or their mapping goes untested.
    for plain in (dataclasses.replace(router, selection_bias=False),
                  dataclasses.replace(router, num_groups=1, topk_groups=1)):
      other = moe_oracle.reference(params, x2, dataclasses.replace(config, router=plain),
                                   slice(None))[2]
      assert np.any(np.sort(np.asarray(other), axis=1) != np.sort(idx64, axis=1)), plain

  # Each layer is within c * y_abs of the exact y (moe_oracle's first-order analysis
  # of float32 compute), so they are within 2 c * y_abs of each other.
  constant = moe_oracle.error_constant(config, jnp.float32)
  moe_oracle.check_close(f"{case}: jax_ep vs MaxText", y_ep,
                         y_maxtext.reshape(tokens, EMB).astype(np.float64), 2 * constant, y_abs)


def test_router_from_maxtext_refuses_routings_it_does_not_map():
  assert router_from_maxtext("mixtral") == moe.RouterConfig("softmax", normalize_weights=True)
  assert router_from_maxtext("qwen3_moe", None, 2.5).routed_scaling_factor == 1.0
  with pytest.raises(ValueError, match="softmax"):
    router_from_maxtext("mixtral", "softmax")            # MaxText: softmax(softmax(l)_topk)
  with pytest.raises(ValueError, match="llama4"):
    router_from_maxtext("llama4", "sigmoid")
  with pytest.raises(ValueError, match="scored logits"):
    router_from_maxtext("deepseek", "")                  # raw logits as weights
  with pytest.raises(ValueError, match="routed_bias"):
    router_from_maxtext("deepseek", "sigmoid", 2.5, routed_bias=True)  # model_name not deepseek3
  # Without deepseek_routing MaxText ignores the groups, as the mapping does.
  assert router_from_maxtext("deepseek", "sigmoid", n_routing_groups=4,
                             topk_routing_group=2).num_groups == 1
