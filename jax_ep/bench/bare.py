"""The bare all_to_all: the padded exchange with no routing, packing or epilogue.

Each rank sends T rows to every rank, an [R, T, row] buffer, the capacity-padded
buffer of an HT dispatch with capacity R*T (the portable path's exchange
without its packing), in bf16, or in FP8 as the e4m3 rows plus their float32
scales (two all_to_alls, like the portable FP8 path). Every system's time is
shown over this one's, from the same run.
"""

from __future__ import annotations

import jax
import numpy as np

import jax_ep
from jax_ep.bench import timing


def inputs(x: np.ndarray, num_ranks: int, fp8: bool, ranks_here: int = 1) -> list[np.ndarray]:
  """This process's [R*T, H] buffer per rank (each rank's T rows once per
  destination), bf16 or FP8 (rows float8_e4m3fn, scales float32 [.., H/128]).
  ``x``: bf16 [ranks_here * T, H], the process's ranks' rows one after the other."""
  tiled = timing.per_rank(x, lambda part: np.tile(part, (num_ranks, 1)), ranks_here)
  if not fp8:
    return [tiled]
  return [np.asarray(a) for a in jax.jit(jax_ep.fp8.quantize)(tiled)]


def exchange(*payloads: jax.Array, axis_name: str = "ep", num_ranks: int) -> tuple:
  """Per shard: every [R*T, ...] payload through one tiled all_to_all as [R, T, ...]."""
  return tuple(jax.lax.all_to_all(p.reshape((num_ranks, -1) + p.shape[1:]), axis_name, 0, 0,
                                  tiled=True) for p in payloads)
