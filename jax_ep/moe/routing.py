"""Routers: which K experts each token uses, and with which weights.

- ``score_function="softmax"`` (Mixtral, Qwen): scores = softmax(logits) over
  the E experts; the top-k scores choose. With ``normalize_weights`` the K
  weights are divided by their sum (Mixtral; Qwen's ``norm_topk_prob``).
- ``score_function="sigmoid"`` (DeepSeek-V3): scores = sigmoid(logits). The
  choice ranks ``scores + selection_bias`` (auxiliary-loss-free balancing:
  the bias steers the choice and never the weights); with ``num_groups`` > 1
  the experts form groups of E / num_groups, each group is ranked by the sum
  of its two best biased scores, and a token chooses only inside its
  ``topk_groups`` best groups. The weights are the unbiased scores of the
  chosen experts, normalised if asked.
- Either way the weights are then multiplied by ``routed_scaling_factor``.

The choice is not differentiated (top-k); the weights are, through the scores.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep.errors import EpConfigError

F32 = jnp.float32
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
  """How tokens choose experts; frozen and hashable.

  Attributes:
    score_function: "softmax" or "sigmoid" (module docstring).
    num_groups: expert groups of group-limited routing (DeepSeek-V3: 8); 1: none.
    topk_groups: groups a token may choose from (DeepSeek-V3: 4).
    normalize_weights: divide each token's K weights by their sum.
    routed_scaling_factor: multiplies the weights (DeepSeek-V3: 2.5).
    selection_bias: the layer's params carry a ``router_bias [E]`` added to
      the scores for the choice only (auxiliary-loss-free balancing; the
      layer returns its update).
  """

  score_function: str = "softmax"
  num_groups: int = 1
  topk_groups: int = 1
  normalize_weights: bool = True
  routed_scaling_factor: float = 1.0
  selection_bias: bool = False

  def __post_init__(self) -> None:
    if self.score_function not in SCORE_FUNCTIONS:
      raise EpConfigError(f"RouterConfig.score_function must be one of {SCORE_FUNCTIONS}, got "
                          f"{self.score_function!r}")
    if not 1 <= self.topk_groups <= self.num_groups:
      raise EpConfigError(f"RouterConfig needs 1 <= topk_groups <= num_groups, got "
                          f"topk_groups={self.topk_groups}, num_groups={self.num_groups}")

  def check(self, num_experts: int, num_topk: int) -> None:
    """Raises EpConfigError where this router cannot choose num_topk of num_experts."""
    if num_experts % self.num_groups:
      raise EpConfigError(f"RouterConfig(num_groups={self.num_groups}) must divide the "
                          f"{num_experts} experts")
    reachable = num_experts // self.num_groups * self.topk_groups
    if num_topk > reachable:
      raise EpConfigError(f"top-{num_topk} cannot be chosen from {self.topk_groups} groups of "
                          f"{num_experts // self.num_groups} experts ({reachable} reachable)")


class Routing(NamedTuple):
  """One shard's routing.

  Attributes:
    topk_idx: int32 [T, K]: the chosen experts (global ids).
    topk_weights: float32 [T, K]: their weights (differentiable).
    probs: float32 [T, E]: each token's distribution over the experts that the
      load-balancing loss uses (softmax scores, or sigmoid scores divided by
      their sum).
  """

  topk_idx: jax.Array
  topk_weights: jax.Array
  probs: jax.Array


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
  """float32 [T, E] logits of the tokens x [T, H] (any float dtype) under the
  router [H, E], in full float32: at DEFAULT precision a GPU runs float32 matmuls
  in TF32, whose ~1e-3 relative error flips near-tied experts (a token's route)."""
  return jnp.matmul(x.astype(F32), router.astype(F32), precision=jax.lax.Precision.HIGHEST)


def route(logits: jax.Array, num_topk: int, config: RouterConfig,
          selection_bias: jax.Array | None = None) -> Routing:
  """Routes T tokens given their router logits float32 [T, E]; selection_bias
  float32 [E] (only with ``config.selection_bias``)."""
  num_tokens, num_experts = logits.shape
  config.check(num_experts, num_topk)
  logits = logits.astype(F32)
  if config.score_function == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
    probs = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  choice = jax.lax.stop_gradient(scores)
  if config.selection_bias:
    if selection_bias is None:
      raise EpConfigError("RouterConfig(selection_bias=True) needs params['router_bias'] [E]")
    choice = choice + jax.lax.stop_gradient(selection_bias.astype(F32))[None, :]
  if config.num_groups > 1:
    grouped = choice.reshape(num_tokens, config.num_groups, -1)
    best = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0]
    _, kept_groups = jax.lax.top_k(jnp.sum(best, axis=-1), config.topk_groups)
    kept = jnp.any(jnp.arange(config.num_groups)[None, :, None] == kept_groups[:, None, :],
                   axis=-1)                                              # [T, groups]
    choice = jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
  _, topk_idx = jax.lax.top_k(choice, num_topk)
  weights = jnp.take_along_axis(scores, topk_idx, axis=-1)
  if config.normalize_weights:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  weights = weights * config.routed_scaling_factor
  return Routing(topk_idx.astype(jnp.int32), weights, probs)
