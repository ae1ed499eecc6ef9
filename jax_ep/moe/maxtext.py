"""MaxText's routed MoE (maxtext.layers.moe.RoutedMoE, 0.2.5) on jax_ep.moe.

MaxText's parameters and routing, mapped onto moe_layer's GLOBAL params and a
RouterConfig (tests/cpu/test_maxtext_moe.py runs both layers on one input):

  MaxText                              jax_ep.moe (MoeConfig(activation="swiglu"))
  gate.kernel [H, E]                   router [H, E] float32
  gate.bias [E] (routed_bias)          router_bias [E] float32 (selection_bias)
  wi_0 [E, H, F] (silu), wi_1 [E, H, F] w_in [E, H, 2F] = wi_0 | wi_1 (gate | up)
  wo [E, F, H]                         w_out [E, F, H]

with MaxText's ``mlp_activations=["silu", "linear"]``, ``moe_mlp_dim`` = F =
MoeConfig.ffn_size and dropless settings (``capacity_factor=-1``, the
default). MaxText's ``prefuse_moe_weights`` ``wi`` [E, H, 2F] already is
``w_in``. MaxText's ``routed_bias_update_rate`` is MoeConfig.bias_update_rate
(both rate * sign(mean count - count); MaxText counts this shard's tokens
unless told otherwise, as stats_axes=None does). This module does not import
MaxText: it maps arrays and config values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.moe.routing import RouterConfig

# Blocks that weight with the scored logits (deepseek_scale_weights); the others but
# the unmapped ones take a softmax over the top-k logits.
_DEEPSEEK_BLOCKS = ("deepseek", "deepseek4")
# llama4: raw top-k scores; gemma4: a softmax over all experts and per-expert scales.
_UNMAPPED_BLOCKS = ("llama4", "gemma4", "gemma4_small")
# MaxText's deepseek_routing (bias-corrected, group-limited choice) runs only for these.
_DEEPSEEK_ROUTING_MODELS = ("deepseek3", "deepseek4", "kimi-k2")


def params_from_maxtext(gate_kernel: jax.Array, wi_0: jax.Array, wi_1: jax.Array,
                        wo: jax.Array, gate_bias: jax.Array | None = None) -> dict[str, jax.Array]:
  """jax_ep.moe.moe_layer's global parameters from RoutedMoE's.

  Args:
    gate_kernel: [H, E], RoutedMoE's ``gate.kernel`` (logits = x @ gate_kernel).
    wi_0: [E, H, F], the projection that goes through silu (SwiGLU's gate).
    wi_1: [E, H, F], the linear projection (SwiGLU's up).
    wo: [E, F, H], the down projection.
    gate_bias: [E], RoutedMoE's ``gate.bias`` (``routed_bias=True``) or None;
      with it, use ``router_from_maxtext(..., routed_bias=True)``.
  Returns:
    {"router": float32 [H, E], "w_in": [E, H, 2F] (wi_0 | wi_1 side by side,
    as jax_ep's SwiGLU takes gate | up), "w_out": [E, F, H]}, plus
    "router_bias": float32 [E] with gate_bias. Place them with
    ``jax_ep.moe.param_specs`` before a shard_map.
  Raises:
    ValueError: the shapes do not fit together.
  """
  h, e = gate_kernel.shape
  if wi_0.shape != wi_1.shape or wi_0.shape[:2] != (e, h):
    raise ValueError(f"params_from_maxtext: wi_0 and wi_1 must both be [E={e}, H={h}, F], got "
                     f"{tuple(wi_0.shape)} and {tuple(wi_1.shape)}")
  if tuple(wo.shape) != (e, wi_0.shape[2], h):
    raise ValueError(f"params_from_maxtext: wo must be [E={e}, F={wi_0.shape[2]}, H={h}], got "
                     f"{tuple(wo.shape)}")
  params = {"router": jnp.asarray(gate_kernel, jnp.float32),
            "w_in": jnp.concatenate([jnp.asarray(wi_0), jnp.asarray(wi_1)], axis=-1),
            "w_out": jnp.asarray(wo)}
  if gate_bias is not None:
    if tuple(gate_bias.shape) != (e,):
      raise ValueError(f"params_from_maxtext: gate_bias must be [E={e}], got "
                       f"{tuple(gate_bias.shape)}")
    params["router_bias"] = jnp.asarray(gate_bias, jnp.float32)
  return params


def router_from_maxtext(decoder_block: str, routed_score_func: str | None = None,
                        routed_scaling_factor: float = 1.0, *, model_name: str = "",
                        n_routing_groups: int = -1, topk_routing_group: int = -1,
                        routed_bias: bool = False) -> RouterConfig:
  """The RouterConfig that routes as RoutedMoE.get_topk does, from MaxText's config values.

  Mapped (l = x @ gate.kernel, I = the top-k experts):
    - any block but deepseek/deepseek4/llama4/gemma4 (mixtral, qwen3_moe, llama2,
      ...) with no ``routed_score_func``: w = softmax(l_I) over the k chosen
      logits = RouterConfig("softmax", normalize_weights=True). MaxText ignores
      ``routed_scaling_factor`` and ``norm_topk_prob`` (a no-op) here.
    - deepseek/deepseek4 with "sigmoid": w = sigmoid(l)_I / sum * s =
      RouterConfig("sigmoid", normalize_weights=True, routed_scaling_factor=s).
    - deepseek/deepseek4 with "softmax" (DeepSeek-V2): w = softmax(l)_I * s,
      not renormalised.
    - with a ``model_name`` starting deepseek3, deepseek4 or kimi-k2 (MaxText's
      deepseek_routing), ``routed_bias`` (the choice ranks scores + gate.bias,
      the weights use the scores) and ``n_routing_groups`` /
      ``topk_routing_group`` (choice among the best groups, each ranked by its
      two best biased scores) map onto selection_bias, num_groups, topk_groups.

  Args:
    decoder_block: MaxText's ``decoder_block`` (its string, or the
      DecoderBlockType enum).
    routed_score_func: MaxText's ``routed_score_func``; None or "": none.
    routed_scaling_factor: MaxText's ``routed_scaling_factor``.
    model_name: MaxText's ``model_name`` (it decides whether deepseek_routing runs).
    n_routing_groups, topk_routing_group: MaxText's; -1: no group-limited routing.
    routed_bias: MaxText's ``routed_bias`` (gate.bias; params_from_maxtext's gate_bias).
  Returns:
    RouterConfig; its check(E, K) still runs in MoeConfig.
  Raises:
    ValueError: MaxText routes this config in a way jax_ep.moe's router does not.
  """
  block = str(getattr(decoder_block, "value", decoder_block))
  score = routed_score_func or ""
  deepseek_routing = model_name.startswith(_DEEPSEEK_ROUTING_MODELS)
  where = (f"MaxText decoder_block={block!r}, routed_score_func={score!r}, "
           f"model_name={model_name!r}")
  if block in _UNMAPPED_BLOCKS:
    raise ValueError(f"router_from_maxtext: {where}: {block}'s routing (llama4: raw top-k "
                     f"scores; gemma4: full softmax and per-expert scales) has no RouterConfig")
  grouped = deepseek_routing and n_routing_groups > 1
  if routed_bias and not deepseek_routing:
    # Outside deepseek_routing MaxText weights with the biased logits: no RouterConfig does.
    raise ValueError(f"router_from_maxtext: {where}: routed_bias outside deepseek_routing "
                     f"(model_name deepseek3*, deepseek4*, kimi-k2*) biases the weights too, "
                     f"which jax_ep.moe's selection_bias never does")
  if block not in _DEEPSEEK_BLOCKS:
    if score:
      # get_topk applies its own softmax to the already scored top-k values.
      raise ValueError(f"router_from_maxtext: {where}: outside the deepseek blocks MaxText takes "
                       f"softmax(score(l)_topk), which no RouterConfig computes; leave "
                       f"routed_score_func empty for the default softmax routing")
    if routed_bias or grouped:
      raise ValueError(f"router_from_maxtext: {where}: deepseek_routing's bias and groups go "
                       f"with the deepseek blocks' weights, not the softmax over top-k")
    return RouterConfig(score_function="softmax", normalize_weights=True)
  if score not in ("sigmoid", "softmax"):
    raise ValueError(f"router_from_maxtext: {where}: the deepseek blocks weight with the "
                     f"scored logits themselves; jax_ep.moe's router scores only with "
                     f"'sigmoid' or 'softmax'")
  groups = (n_routing_groups, topk_routing_group) if grouped else (1, 1)
  if grouped and topk_routing_group < 1:
    raise ValueError(f"router_from_maxtext: {where}: n_routing_groups={n_routing_groups} "
                     f"needs topk_routing_group >= 1, got {topk_routing_group}")
  return RouterConfig(score_function=score, num_groups=groups[0], topk_groups=groups[1],
                      normalize_weights=score == "sigmoid",
                      routed_scaling_factor=float(routed_scaling_factor),
                      selection_bias=bool(routed_bias))
