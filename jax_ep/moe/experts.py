"""Expert MLPs: on grouped rows (the routed experts), on per-expert blocks (the
LL path), and on every token (shared experts).

  swiglu: w_in [.., H, 2F] holds gate | up side by side (one GEMM);
          out = (silu(x @ gate) * (x @ up)) @ w_out, w_out [.., F, H]
  gelu:   w_in [.., H, F]; out = gelu(x @ w_in) @ w_out

GEMMs take the rows' dtype (weights are cast to it) and accumulate in float32;
the activation runs in float32 and is rounded to the rows' dtype once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.moe.grouped_matmul import GroupedMatmulConfig, grouped_matmul

F32 = jnp.float32
ACTIVATIONS = ("swiglu", "gelu")


def in_width(activation: str, ffn_size: int) -> int:
  """Columns of w_in: 2F for swiglu (gate | up), F for gelu."""
  return 2 * ffn_size if activation == "swiglu" else ffn_size


def activate(hidden: jax.Array, activation: str, dtype,
             row_weights: jax.Array | None = None) -> jax.Array:
  """[..., 2F] (swiglu) or [..., F] (gelu) -> [..., F] of dtype; with row_weights
  [...] (float32), each row times its weight, in float32 before the one rounding."""
  hidden = hidden.astype(F32)
  if activation == "swiglu":
    gate, up = jnp.split(hidden, 2, axis=-1)
    activated = jax.nn.silu(gate) * up
  else:
    activated = jax.nn.gelu(hidden)
  if row_weights is not None:
    activated = activated * row_weights.astype(F32)[..., None]
  return activated.astype(dtype)


def grouped_mlp(rows: jax.Array, group_sizes: jax.Array, w_in: jax.Array, w_out: jax.Array,
                activation: str, gmm: GroupedMatmulConfig,
                row_weights: jax.Array | None = None) -> jax.Array:
  """rows [M, H] grouped by local expert -> [M, H] of rows' dtype (0 outside the groups).
  w_in [E_local, H, 2F or F], w_out [E_local, F, H].

  row_weights: float32 [M] or None: each row's output scaled by its weight (the
  routing weight of its pair; 0 on padding rows). The down GEMM is linear, so
  the scaling is applied to the activation's [M, F] in its fused float32 pass
  instead of to the output's [M, H] in a pass of its own."""
  dtype = rows.dtype
  hidden = grouped_matmul(rows, w_in.astype(dtype), group_sizes, config=gmm)
  return grouped_matmul(activate(hidden, activation, dtype, row_weights), w_out.astype(dtype),
                        group_sizes, config=gmm)


def batched_mlp(blocks: jax.Array, w_in: jax.Array, w_out: jax.Array, activation: str
                ) -> jax.Array:
  """blocks [E_local, S, H], one block per local expert -> [E_local, S, H] (one
  batched GEMM per weight)."""
  dtype = blocks.dtype
  hidden = jnp.einsum("esh,ehf->esf", blocks, w_in.astype(dtype), preferred_element_type=F32)
  return jnp.einsum("esf,efh->esh", activate(hidden, activation, dtype), w_out.astype(dtype),
                    preferred_element_type=F32).astype(dtype)


def dense_mlp(x: jax.Array, w_in: jax.Array, w_out: jax.Array, activation: str) -> jax.Array:
  """x [T, H] through one MLP (the shared experts, fused) -> [T, H] of x's dtype."""
  dtype = x.dtype
  hidden = jnp.matmul(x, w_in.astype(dtype), preferred_element_type=F32)
  return jnp.matmul(activate(hidden, activation, dtype), w_out.astype(dtype),
                    preferred_element_type=F32).astype(dtype)
