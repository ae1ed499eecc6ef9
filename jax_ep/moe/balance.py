"""The router's auxiliary outputs: load-balancing loss, z-loss, bias update.

All are computed from statistics of the tokens of this shard, summed over
``stats_axes`` (MoeConfig.stats_axes; None: this shard alone, no collective):

  counts[e]   (token, k) choices of expert e
  f[e]        counts[e] / (tokens * K)
  p[e]        mean over tokens of probs[t, e] (routing.Routing.probs)

  load_balancing_loss = E * sum_e f[e] * p[e]          (Switch / GShard; 1 when balanced)
  router_z_loss       = mean over tokens of logsumexp(logits)^2      (ST-MoE)
  bias_update[e]      = rate * sign(mean(counts) - counts[e])        (DeepSeek-V3's
                        auxiliary-loss-free balancing: add it to router_bias)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


class BalanceStats(NamedTuple):
  """float32 [] losses and float32 [E] counts / bias update."""

  counts: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  bias_update: jax.Array


def balance_stats(logits: jax.Array, probs: jax.Array, topk_idx: jax.Array, *, rate: float,
                  stats_axes: tuple[str, ...] | None) -> BalanceStats:
  """logits, probs float32 [T, E]; topk_idx int32 [T, K]."""
  num_tokens, num_experts = probs.shape
  num_topk = topk_idx.shape[1]
  counts = jnp.zeros(num_experts, F32).at[topk_idx.reshape(-1)].add(1.0, mode="drop")
  prob_sums = jnp.sum(probs, axis=0)
  lse = jax.nn.logsumexp(logits.astype(F32), axis=-1)
  z_sum = jnp.sum(lse * lse)
  tokens = jnp.asarray(num_tokens, F32)
  if stats_axes:
    counts, prob_sums, z_sum, tokens = jax.lax.psum((counts, prob_sums, z_sum, tokens),
                                                    stats_axes)
  tokens = jnp.maximum(tokens, 1.0)
  fraction = jax.lax.stop_gradient(counts) / (tokens * num_topk)
  load_balancing_loss = num_experts * jnp.sum(fraction * prob_sums / tokens)
  bias_update = rate * jnp.sign(jnp.mean(counts) - counts)
  return BalanceStats(counts, load_balancing_loss, z_sum / tokens,
                      jax.lax.stop_gradient(bias_update))
