"""Runs jax_ep.moe.moe_layer and its gradients per shard, and checks a shard
against the float64 oracle (moe_oracle). Used by the CPU tests (one process,
several CPU devices) and by the GPU suite (one process per rank). No XLA
collective runs: gradients are taken inside the shard_map, each rank's
replicated parameters made varying first, so each rank gets the gradient of
its own tokens' loss for those (and the exchange's backward gives the expert
weights the gradient of every rank's loss)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_oracle
from jax_ep import moe

F32 = jnp.float32

# name -> (router, activation, shared_ffn_size, exchange, fp8)
LAYERS = {
    "softmax_swiglu_ht": (moe.RouterConfig(), "swiglu", 0, "ht", False),
    "deepseek_sigmoid_groups_shared_ht": (
        moe.RouterConfig(score_function="sigmoid", num_groups=4, topk_groups=2,
                         selection_bias=True, routed_scaling_factor=2.5), "swiglu", 64, "ht",
        False),
    "softmax_gelu_unnormalized_ht": (moe.RouterConfig(normalize_weights=False), "gelu", 0, "ht",
                                     False),
    "softmax_swiglu_fp8_ht": (moe.RouterConfig(), "swiglu", 0, "ht", True),
    "softmax_swiglu_ll": (moe.RouterConfig(), "swiglu", 0, "ll", False),
}
ROUTINGS = ("uniform", "all_to_one_expert", "all_to_rank_0")


# Seeds tried per problem for one whose routing float32 decides clearly.
SEED_ATTEMPTS = 64


def make_problem(config: moe.MoeConfig, num_ranks: int, tokens_per_rank: int, routing: str,
                 dtype, seed: int = 0):
  """Global (params, x, dy) as numpy: params float32 (router_bias included), x and dy
  rounded to dtype. ``routing``: uniform (random router), all_to_one_expert (every
  token's logits favour expert 3), all_to_rank_0 (every token's K experts live on
  rank 0: the other ranks receive nothing).

  The first of seed, seed + 1, ... whose routing float32 logits decide without a
  near-tie (moe_oracle.selection_margin >= 1): with a near-tie the layer may choose
  another expert than the float64 oracle, both right to float32's precision."""
  for attempt in range(SEED_ATTEMPTS):
    problem = _random_problem(config, num_ranks, tokens_per_rank, routing, dtype, seed + attempt)
    if moe_oracle.selection_margin(problem[0], problem[1], config) >= 1.0:
      return problem
  raise AssertionError(f"no seed in [{seed}, {seed + SEED_ATTEMPTS}) gives a {routing} routing "
                       "without a near-tie")


def _random_problem(config, num_ranks, tokens_per_rank, routing, dtype, seed):
  rng = np.random.default_rng(seed)
  shapes = moe.global_shapes(config)
  params = {name: (rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
                   ).astype(np.float32) for name, shape in shapes.items()}
  num_tokens = num_ranks * tokens_per_rank
  x = rng.standard_normal((num_tokens, config.ep.hidden)).astype(np.float32)
  if routing != "uniform":
    x[:, 0] = 2.0 + rng.random(num_tokens)       # a positive feature the router reads
    favoured = [3] if routing == "all_to_one_expert" else list(range(config.ep.num_topk))
    for rank_in_order, e in enumerate(favoured):
      params["router"][0, e] = 8.0 - 0.8 * rank_in_order
  if "router_bias" in params:
    params["router_bias"] = (0.01 * rng.standard_normal(config.ep.num_experts)).astype(np.float32)
  x = np.asarray(jnp.asarray(x, dtype).astype(F32))
  dy = np.asarray(jnp.asarray(rng.standard_normal(x.shape), dtype).astype(F32))
  return params, x, dy


def run_layer(config: moe.MoeConfig, mesh, params: dict, x: np.ndarray, dy: np.ndarray, dtype):
  """Per shard: y, topk_idx, the gradients of sum(y * dy) w.r.t. params and x.

  Returns numpy: y [T, H], idx [T, K], grad_x [T, H], and grads of params: expert
  weights [E, ...] (their true gradients), replicated ones stacked per rank [R, ...]
  (each rank's tokens' share); all of them with one process, this process's ranks'
  parts with several (one rank: T_local rows, E_local experts, [1, ...]).
  """
  axis = config.ep.axis_names
  specs = moe.param_specs(config)
  replicated = [k for k, s in specs.items() if s == P()]
  out_specs_params = {k: (P(axis) if k in replicated else specs[k]) for k in specs}

  def per_shard(params, x, dy):
    params = {k: (jax.lax.pcast(v, axis, to="varying") if k in replicated else v)
              for k, v in params.items()}
    params = {k: (v if k in ("router", "router_bias") else v.astype(dtype))
              for k, v in params.items()}

    def loss(p, xx):
      out = moe.moe_layer(p, xx, config=config)
      return jnp.sum(out.y.astype(F32) * dy), out

    (_, out), (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        params, x.astype(dtype))
    g_params = {k: (v.astype(F32)[None] if k in replicated else v.astype(F32))
                for k, v in g_params.items()}
    return out.y.astype(F32), out.topk_idx, g_x.astype(F32), g_params

  fn = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(specs, P(axis), P(axis)),
                             out_specs=(P(axis), P(axis), P(axis), out_specs_params)))
  def put(value, spec):   # the same global value on every process
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])

  placed_params = {k: put(v, specs[k]) for k, v in params.items()}
  return jax.tree.map(_this_process, fn(placed_params, put(x, P(axis)), put(dy, P(axis))))


def _this_process(array: jax.Array) -> np.ndarray:
  """The whole array with one process; else this process's shards along axis 0."""
  if array.is_fully_addressable:
    return np.asarray(array)
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  return np.concatenate([np.asarray(s.data) for s in shards])


def check_shard(config, params, x, dy, got, tokens: slice, rank: int, num_ranks: int, dtype,
                replicated_summed: bool) -> None:
  """Checks one rank's part of run_layer's results (got: that rank's y, idx, grad_x
  for x[tokens]; its expert-weight gradients; its replicated-parameter gradients, or
  their sum over ranks when replicated_summed) against the oracle."""
  y, idx, g_x, g_params = got
  constant = moe_oracle.error_constant(config, dtype)
  # y and the chosen experts are per token: this rank's rows of the every-token oracle,
  # which also gives the expert weights' gradient (of every token's loss); the
  # replicated parameters' is of these tokens' loss (or of all, summed).
  y64_all, y_abs_all, idx64_all, (g_all, gx_all) = _every_token_oracle(params, x, dy, config)
  y64, y_abs = y64_all[tokens], y_abs_all[tokens]
  np.testing.assert_array_equal(idx, np.asarray(idx64_all)[tokens])
  moe_oracle.check_close("y", y, y64, constant, y_abs + np.max(y_abs) * 2.0**-24)
  if replicated_summed:
    g_mine = g_all
  else:
    _, _, _, (g_mine, _) = moe_oracle.reference(params, x, config, tokens, dy[tokens])
  moe_oracle.check_close("grad x", g_x, gx_all[tokens], constant * moe_oracle.STAGES,
                         np.max(np.abs(gx_all)))
  # The router's gradient passes through exp / sigmoid of the logits, whose float32
  # values carry a relative error of about u |logit| (exp's condition number), and a
  # saturated score (1 - s below 2^-24) loses its derivative s (1 - s) outright: per
  # token at most u max(1, |logit|) |x| |dy| |y|.
  max_logit = max(1.0, float(np.max(np.abs(x.astype(np.float64) @ params["router"]))))
  saturated = (2.0**-24 * max_logit * len(x) * np.max(np.abs(x)) * np.max(np.abs(dy))
               * np.max(y_abs))
  e_local = config.ep.num_experts // num_ranks
  experts = slice(rank * e_local, (rank + 1) * e_local)
  for name, grad in g_params.items():
    exact = g_all[name][experts] if name in moe.params.EXPERT_PARAMS else g_mine[name]
    if name == "router_bias":       # no gradient: the bias update replaces it
      assert not np.any(grad), "router_bias got a gradient"
      continue
    moe_oracle.check_close(f"grad {name}", grad, exact, constant * moe_oracle.STAGES,
                           np.max(np.abs(exact)) + saturated)


_ORACLE_CACHE: dict = {}


def _every_token_oracle(params, x, dy, config):
  """moe_oracle.reference over every token, with dy; kept for the last problem
  (keyed by the inputs' bytes), since each rank's check of one run needs the same
  one (the float64 gradients dominate a CPU test's time when recomputed per rank)."""
  digest = hashlib.sha256()
  for name in sorted(params):
    digest.update(name.encode() + np.ascontiguousarray(params[name]).tobytes())
  for array in (x, dy):
    digest.update(np.ascontiguousarray(array).tobytes())
  key = (config, digest.hexdigest())
  if key not in _ORACLE_CACHE:
    _ORACLE_CACHE.clear()
    _ORACLE_CACHE[key] = moe_oracle.reference(params, x, config, slice(None), dy)
  return _ORACLE_CACHE[key]


def layer_config(name: str, ep_config, ffn_size: int = 32) -> moe.MoeConfig:
  router, activation, shared, exchange, fp8 = LAYERS[name]
  return moe.MoeConfig(ep=ep_config, ffn_size=ffn_size, activation=activation, router=router,
                       shared_ffn_size=shared, exchange=exchange, fp8=fp8)
