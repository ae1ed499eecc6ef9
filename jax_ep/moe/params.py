"""The layer's parameters as global arrays, and how they are split over a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_ep.moe.layer import MoeConfig, Params

EXPERT_PARAMS = ("w_in", "w_out")  # split over the EP axes along their first (expert) axis


def global_shapes(config: MoeConfig) -> dict[str, tuple[int, ...]]:
  """Each parameter's global shape (all E experts)."""
  shapes = config.param_shapes(1)
  return {name: ((config.ep.num_experts,) + shape[1:] if name in EXPERT_PARAMS else shape)
          for name, shape in shapes.items()}


def param_specs(config: MoeConfig) -> dict[str, P]:
  """PartitionSpecs: the expert weights over the EP axes, the rest replicated
  (shard_map's in_specs, and the NamedShardings the arrays must carry)."""
  axes = config.ep.axis_names
  ep_axes = axes[0] if len(axes) == 1 else axes
  return {name: (P(ep_axes) if name in EXPERT_PARAMS else P()) for name in global_shapes(config)}


def init_params(config: MoeConfig, key: jax.Array, dtype=jnp.float32) -> Params:
  """Global parameters: matrices N(0, 1/fan_in), router_bias 0.

  Returns dict name -> array of ``global_shapes(config)`` in ``dtype`` (the
  router stays float32); place them with ``param_specs`` before a shard_map.
  """
  shapes = global_shapes(config)
  keys = dict(zip(sorted(shapes), jax.random.split(key, len(shapes))))
  params = {}
  for name, shape in shapes.items():
    if name == "router_bias":
      params[name] = jnp.zeros(shape, jnp.float32)
      continue
    fan_in = shape[-2]
    value = jax.random.normal(keys[name], shape, jnp.float32) / np.sqrt(fan_in)
    params[name] = value.astype(jnp.float32 if name == "router" else dtype)
  return params
