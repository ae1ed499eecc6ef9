"""FP8 (e4m3) quantisation with per-128-channel scales, as jax_ep moves it.

The formula every jax_ep backend uses (and the GPU kernels reproduce):
  amax  = max(|x|) over each group of 128 channels, in float32, at least 1e-4
  scale = amax / 448                 (with ``round_scale``: the next power of two
                                      at or above it, exactly representable as UE8M0)
  q     = float8_e4m3fn(x * (1 / scale))   computed as x * (448 / amax) without rounding
  x    ~= float32(q) * scale
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128
MIN_AMAX = 1e-4


def quantize(x: jax.Array, *, round_scale: bool = False,
             scale_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Quantises rows to FP8.

  Args:
    x: [..., H] floating, H a multiple of 128.
    round_scale: use power-of-two scales (UE8M0-compatible).
    scale_dtype: float32, or float8_e8m0fnu (requires ``round_scale``).
  Returns:
    (float8_e4m3fn[..., H], scales[..., H/128] of scale_dtype).
  """
  hidden = x.shape[-1]
  if hidden % GROUP:
    raise ValueError(f"FP8 quantisation needs the hidden size to be a multiple of {GROUP}, "
                     f"got {hidden}")
  if jnp.dtype(scale_dtype) == jnp.dtype(jnp.float8_e8m0fnu) and not round_scale:
    raise ValueError("float8_e8m0fnu scales need round_scale=True (power-of-two scales)")
  groups = x.astype(jnp.float32).reshape(x.shape[:-1] + (hidden // GROUP, GROUP))
  amax = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), MIN_AMAX)
  if round_scale:
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / FP8_MAX)))
    scale_inv = 1.0 / scale
  else:
    scale = amax / FP8_MAX
    scale_inv = FP8_MAX / amax
  q = (groups * scale_inv[..., None]).astype(FP8_DTYPE).reshape(x.shape)
  return q, scale.astype(scale_dtype)


def dequantize(q: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """float32(q) * scale per 128-channel group, cast to ``dtype``."""
  hidden = q.shape[-1]
  groups = q.astype(jnp.float32).reshape(q.shape[:-1] + (hidden // GROUP, GROUP))
  return (groups * scales.astype(jnp.float32)[..., None]).reshape(q.shape).astype(dtype)
