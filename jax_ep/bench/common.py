"""Inputs of the benchmarks: routing and rows like DeepEP's tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def deepep_routing(rng: np.random.Generator, num_tokens: int, num_experts: int,
                   num_topk: int) -> np.ndarray:
  """int32[T, K]: top-k of |N(0,1)|+1 scores per token: distinct experts, uniform load
  (DeepEP's tests)."""
  scores = np.abs(rng.standard_normal((num_tokens, num_experts))) + 1
  return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def random_rows(rng: np.random.Generator, shape, dtype=jnp.bfloat16) -> np.ndarray:
  """N(0,1) rows of ``shape`` in ``dtype`` (numpy; bf16 through ml_dtypes)."""
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))
