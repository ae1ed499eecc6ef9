"""jax_ep.moe: a whole MoE layer on jax_ep's exchange, and its expert GEMMs.

- moe_layer(params, x, config=MoeConfig(...)): one MoE layer per shard, inside
  jax.shard_map: router (softmax top-k, or DeepSeek-V3's sigmoid with a
  selection bias and group-limited top-k), the HT expert-major exchange (or
  the LL ops for decoding), SwiGLU or GELU experts on grouped GEMMs, optional
  shared experts, and the balance outputs (jax_ep/moe/layer.py).
- grouped_matmul: rows grouped by expert times each expert's weights, with a
  VJP, on JAX's Pallas Mosaic GPU kernels on Hopper and jax.lax.ragged_dot
  elsewhere (jax_ep/moe/grouped_matmul.py).
- init_params, param_specs, global_shapes: the parameters as global arrays.
- jax_ep.moe.flax.MoeLayer: a Flax NNX module (``pip install jax_ep[flax]``).
"""

from jax_ep.moe.balance import BalanceStats, balance_stats
from jax_ep.moe.gmm_impls import PallasTiles
from jax_ep.moe.grouped_matmul import GroupedMatmulConfig, grouped_matmul
from jax_ep.moe.grouped_matmul import plan_for as grouped_matmul_plan
from jax_ep.moe.layer import MoeConfig, MoeOutput, moe_layer
from jax_ep.moe.params import global_shapes, init_params, param_specs
from jax_ep.moe.routing import RouterConfig, Routing, route, router_logits

__all__ = [
    "BalanceStats", "GroupedMatmulConfig", "MoeConfig", "MoeOutput", "PallasTiles",
    "RouterConfig", "Routing", "balance_stats", "global_shapes", "grouped_matmul",
    "grouped_matmul_plan", "init_params", "moe_layer", "param_specs", "route", "router_logits",
]
