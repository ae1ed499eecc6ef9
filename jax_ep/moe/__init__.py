"""jax_ep.moe: a whole MoE layer on jax_ep's exchange, and its expert GEMMs.

- grouped_matmul: rows grouped by expert times each expert's weights, with a
  VJP, on the fastest grouped-GEMM kernels measured on Hopper GPUs (JAX's
  Pallas Mosaic GPU kernels) and on ``jax.lax.ragged_dot`` elsewhere.
"""

from jax_ep.moe.gmm_impls import PallasTiles
from jax_ep.moe.grouped_matmul import GroupedMatmulConfig, grouped_matmul
from jax_ep.moe.grouped_matmul import plan_for as grouped_matmul_plan

__all__ = ["GroupedMatmulConfig", "PallasTiles", "grouped_matmul", "grouped_matmul_plan"]
