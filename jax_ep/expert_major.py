"""The expert-major layout, built from a token-major dispatch on the receiving rank.

A token-major dispatch delivers each token once per rank, in (source rank,
source token) order, with its local experts in ``topk_idx [C, K]``. The
expert-major layout holds one row per (token, local expert) *pair* instead,
grouped by local expert e = 0 .. E_local-1; group e starts at
``offset[e] = sum(group_sizes[:e])`` and its rows keep the token-major order.

  full_count[e]   pairs of local expert e received (a token choosing e twice
                  is one pair, with the sum of its weights in k order)
  padded[e]       full_count[e] rounded up to the alignment A
  offset[e]       sum(padded[:e])
  row of (i, e)   offset[e] + (token-major rows before i that choose e)

Pairs whose row is >= M (the static row count) are dropped: the last
experts' last rows when M is below the worst case. Then, with everything a
multiple of A,

  tokens_per_expert[e] = clip(M - offset[e], 0, full_count[e])
  group_sizes[e]       = clip(M - offset[e], 0, padded[e])

so ``sum(group_sizes) <= M`` and ``ragged_dot(x, w, group_sizes)`` only reads
rows that exist. The combine sums in a fixed order, the contract's: per rank,
its pairs of the token in ascending local expert, in fp32 (a per-rank fp32
partial); then those partials in rank order (the token-major combine of fp32
rows). Every function here is local (no collective); they run on any backend.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_ep import local_ops
from jax_ep.types import DispatchResult, ExpertMajorHandle

I32 = jnp.int32
F32 = jnp.float32


def default_rows(num_ranks: int, max_tokens_per_rank: int, num_topk: int,
                 experts_per_rank: int, alignment: int) -> int:
  """M: the worst case R*T*min(K, E_local) plus E_local*(A-1) slack, rounded up to A."""
  worst = num_ranks * max_tokens_per_rank * min(num_topk, experts_per_rank)
  worst += experts_per_rank * (alignment - 1)
  return -(-worst // alignment) * alignment


class PairLayout(NamedTuple):
  """Where each pair of one rank's token-major rows goes (all int32 but weights).

  Attributes:
    pair_src: [M]: token-major row of each pair row, -1 on padding.
    pair_expert: [M]: local expert of each pair row, -1 on padding.
    pair_weight: float32[M]: the pair's weight (the sum, in k order, of the
      token's weights for that expert), 0 on padding.
    slot_row: [C, K]: pair row of (row i, topk_idx[i, k]) for every valid k
      (repeats of an expert share its row), -1 where invalid or dropped.
    rows_by_expert: [C, K]: the pair rows of token-major row i in ascending
      local expert, then -1 (the order the combine sums in).
    tokens_per_expert: [E_local]: pairs kept per local expert.
    group_sizes: [E_local]: rows of each group (tokens_per_expert rounded up to
      A, clipped at M).
    num_pairs: []: pairs kept (rows holding a pair).
    num_dropped: []: pairs received that did not fit M.
  """

  pair_src: jax.Array
  pair_expert: jax.Array
  pair_weight: jax.Array
  slot_row: jax.Array
  rows_by_expert: jax.Array
  tokens_per_expert: jax.Array
  group_sizes: jax.Array
  num_pairs: jax.Array
  num_dropped: jax.Array


def pair_layout(local_idx: jax.Array, local_weights: jax.Array, *, experts_per_rank: int,
                alignment: int, num_rows: int) -> PairLayout:
  """The expert-major placement of a token-major dispatch's rows.

  Args:
    local_idx: int32[C, K]: the token-major result's topk_idx (local experts,
      -1 elsewhere and on padding rows).
    local_weights: float32[C, K]: its topk_weights (0 where local_idx is -1).
    experts_per_rank: E_local.
    alignment: A >= 1.
    num_rows: M, a multiple of A.
  """
  capacity, num_topk = local_idx.shape
  valid = (local_idx >= 0) & (local_idx < experts_per_rank)
  safe_idx = jnp.where(valid, local_idx, 0)
  chooses = jnp.any(valid[:, :, None]
                    & (safe_idx[:, :, None] == jnp.arange(experts_per_rank, dtype=I32)), axis=1)
  chooses_i32 = chooses.astype(I32)                                     # [C, E_local]
  before = jnp.cumsum(chooses_i32, axis=0, dtype=I32) - chooses_i32      # rows before i choosing e
  full_count = jnp.sum(chooses_i32, axis=0, dtype=I32)
  padded = -(-full_count // alignment) * alignment
  offset = jnp.cumsum(padded, dtype=I32) - padded
  room = jnp.maximum(num_rows - offset, 0)
  tokens_per_expert = jnp.minimum(room, full_count)
  group_sizes = jnp.minimum(room, padded)

  row_of_pair = offset[None, :] + before                                 # [C, E_local]
  slot_row = jnp.take_along_axis(row_of_pair, safe_idx, axis=1)
  slot_row = jnp.where(valid & (slot_row < num_rows), slot_row, -1)

  first = local_ops.first_occurrence(jnp.where(valid, local_idx, -1))
  owner = first & (slot_row >= 0)                                        # writes the pair row
  # A pair's weight: its token's weights for that expert summed in k order
  # (0.0 + w0 + w1 ..., the same on every backend).
  same = safe_idx[:, :, None] == safe_idx[:, None, :]                    # [C, K, K']
  summed = jnp.zeros(local_weights.shape, F32)
  for k in range(num_topk):
    summed = summed + jnp.where(same[:, :, k] & valid[:, k:k + 1], local_weights[:, k:k + 1], 0.0)
  target = jnp.where(owner, slot_row, num_rows).reshape(-1)
  rows = jnp.broadcast_to(jnp.arange(capacity, dtype=I32)[:, None], local_idx.shape).reshape(-1)
  pair_src = jnp.full((num_rows,), -1, I32).at[target].set(rows, mode="drop")
  pair_expert = jnp.full((num_rows,), -1, I32).at[target].set(safe_idx.reshape(-1), mode="drop")
  pair_weight = jnp.zeros((num_rows,), F32).at[target].set(summed.reshape(-1), mode="drop")

  order = jnp.argsort(jnp.where(owner, safe_idx, experts_per_rank), axis=1, stable=True)
  rows_by_expert = jnp.take_along_axis(jnp.where(owner, slot_row, -1), order, axis=1)
  num_pairs = jnp.sum(tokens_per_expert, dtype=I32)
  return PairLayout(pair_src=pair_src, pair_expert=pair_expert, pair_weight=pair_weight,
                    slot_row=slot_row, rows_by_expert=rows_by_expert,
                    tokens_per_expert=tokens_per_expert, group_sizes=group_sizes,
                    num_pairs=num_pairs, num_dropped=jnp.sum(full_count, dtype=I32) - num_pairs)


def to_pairs(token_rows: jax.Array, pair_src: jax.Array) -> jax.Array:
  """[C, ...] token-major rows -> [M, ...] pair rows (zero bytes on padding)."""
  return local_ops.gather_rows(token_rows, pair_src)


def per_rank_partials(pair_rows: jax.Array, rows_by_expert: jax.Array) -> jax.Array:
  """[M, W] pair rows -> float32[C, W]: per token-major row, the sum of its pair
  rows in ascending local expert, in fp32 (0 for rows with no pair)."""
  return local_ops.gather_sum(pair_rows.astype(F32), rows_by_expert)


def slot_values(pair_values: jax.Array, slot_row: jax.Array) -> jax.Array:
  """float32[M] per-pair values -> float32[C, K]: the value of the pair of each
  valid (row, k) (repeats of an expert get its value each), 0 elsewhere."""
  if pair_values.shape[0] == 0:
    return jnp.zeros(slot_row.shape, F32)
  return jnp.where(slot_row >= 0, pair_values[jnp.maximum(slot_row, 0)], 0.0)


def from_token_major(result: DispatchResult, topk_idx: jax.Array, *, experts_per_rank: int,
                     alignment: int, num_rows: int) -> DispatchResult:
  """A token-major DispatchResult (capacity R * T) -> the expert-major one;
  ``topk_idx``: int32[T_local, K], the routing the dispatch took (kept in the
  handle)."""
  pairs = pair_layout(result.topk_idx, result.topk_weights, experts_per_rank=experts_per_rank,
                      alignment=alignment, num_rows=num_rows)
  handle = ExpertMajorHandle(token_major=result.handle, pair_src=pairs.pair_src,
                             rows_by_expert=pairs.rows_by_expert, slot_row=pairs.slot_row,
                             topk_idx=topk_idx, num_tokens=pairs.num_pairs, alignment=alignment,
                             config=result.handle.config)
  scales = None if result.scales is None else to_pairs(result.scales, pairs.pair_src)
  return DispatchResult(x=to_pairs(result.x, pairs.pair_src), scales=scales,
                        topk_idx=pairs.pair_expert, topk_weights=pairs.pair_weight,
                        num_tokens=pairs.num_pairs, tokens_per_expert=pairs.tokens_per_expert,
                        num_dropped=pairs.num_dropped, num_invalid=result.num_invalid,
                        handle=handle, group_sizes=pairs.group_sizes)
