"""MoeLayer: jax_ep.moe.moe_layer as a Flax NNX module (``pip install jax_ep[flax]``).

The module owns the layer's parameters as global arrays placed on the mesh: the
expert weights split over the EP axes (``param_specs``), the router replicated,
each ``nnx.Param`` carrying its sharding as metadata (``nnx.get_partition_spec``
reads it). ``router_bias`` (auxiliary-loss-free balancing) is a ``RouterBias``
variable, not a Param: no optimizer updates it; ``update_router_bias`` adds the
layer's bias update. Calling the module runs the layer in a shard_map over the
whole mesh, the tokens split over ``batch_axes`` (default: every mesh axis).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the extra
  raise ImportError("jax_ep.moe.flax needs Flax: pip install 'jax_ep[flax]'") from e

from jax_ep.moe.layer import MoeConfig, MoeOutput, moe_layer
from jax_ep.moe.params import init_params, param_specs


class RouterBias(nnx.Variable):
  """The router's selection bias [E]: steered by the bias update, not by gradients."""


def _names(spec: P, ndim: int) -> tuple:
  return tuple(spec) + (None,) * (ndim - len(spec))


class MoeLayer(nnx.Module):
  """One MoE layer over a mesh.

  Args:
    config: MoeConfig (its EpConfig given to jax_ep.initialize with ``mesh``).
    mesh: the mesh the layer runs on; it holds the EP axes of config.ep.
    rngs: nnx.Rngs for the parameters' initialisation.
    param_dtype: the expert and shared weights' dtype (the router is float32).
    batch_axes: mesh axes the tokens are split over (None: every axis).
  """

  def __init__(self, config: MoeConfig, mesh: jax.sharding.Mesh, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32, batch_axes: Sequence[str] | None = None):
    self.config = config
    self.mesh = mesh
    self.batch_axes = tuple(batch_axes) if batch_axes is not None else tuple(mesh.axis_names)
    specs = param_specs(config)
    for name, value in init_params(config, rngs.params(), param_dtype).items():
      kind = RouterBias if name == "router_bias" else nnx.Param
      # Placed here, not left to Flax: with flax_always_shard_variable off (importing
      # MaxText turns it off) the metadata alone would leave the arrays on one device.
      value = jax.device_put(value, NamedSharding(mesh, P(*_names(specs[name], value.ndim))))
      setattr(self, name, kind(value, out_sharding=_names(specs[name], value.ndim), mesh=mesh))

  def parameters(self) -> dict[str, jax.Array]:
    """The layer's arrays by name, as moe_layer takes them (global)."""
    return {name: getattr(self, name)[...] for name in param_specs(self.config)}

  def __call__(self, x: jax.Array) -> MoeOutput:
    """x: [B, H] tokens, split over batch_axes along B (as a NamedSharding).

    Returns MoeOutput of global arrays: y [B, H] and topk_idx [B, K] split like x;
    the per-shard values stacked over the S shards of the batch: tokens_per_expert
    int32 [S, E_local], dropped int32 [S], load_balancing_loss and router_z_loss
    float32 [S], bias_update float32 [S, E] (mean them for the batch's value).
    """
    specs = param_specs(self.config)
    rows = P(self.batch_axes)

    @functools.partial(jax.shard_map, mesh=self.mesh, in_specs=(specs, rows),
                       out_specs=(rows, rows, rows, rows, rows, rows, rows))
    def per_shard(params, tokens):
      out = moe_layer(params, tokens, config=self.config)
      stack = lambda a: a[None]
      return (out.y, out.topk_idx, stack(out.tokens_per_expert), stack(out.dropped),
              stack(out.load_balancing_loss), stack(out.router_z_loss), stack(out.bias_update))

    # jit: jax_ep's ops are custom_vjps with symbolic zeros, which an eager
    # shard_map cannot run.
    return MoeOutput(*jax.jit(per_shard)(self.parameters(), x))

  def update_router_bias(self, out: MoeOutput) -> None:
    """router_bias += the shards' mean bias update (after a step; see balance.py)."""
    if not self.config.router.selection_bias:
      raise ValueError("update_router_bias: this layer's router has no selection bias")
    self.router_bias[...] = self.router_bias[...] + jnp.mean(out.bias_update, axis=0)
