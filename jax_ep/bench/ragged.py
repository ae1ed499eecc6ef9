"""The ragged_all_to_all baseline: MaxText's dropless EP exchange, per shard.

dispatch: each token's copy for each destination rank is sorted by destination,
the send sizes are exchanged (all_gather), and jax.lax.ragged_all_to_all moves
the rows. combine: the reverse ragged_all_to_all, then a sum of each token's
copies in float32. The combine is timed on its own: its inputs (the received
rows and the layout the dispatch produced) are made once, outside the timed
loop, as jax_ep's combine gets its handle from the dispatch.
"""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import jax_ep

DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def needs_single_shot() -> bool:
  """Whether ragged_all_to_all must be timed by single executions.

  XLA's multi-process NCCL send/recv fallback (jax 0.11.2) never returned from a
  second execution of a ragged program on 2x H200; under XLA's dense decomposer
  (DECOMPOSER_FLAG in XLA_FLAGS, which tools/gpu_check.sh sets) repeated
  executions return (tools/ragged_probe.sh, 2026-11-30), so the baseline gets the
  same slope harness as every other system.
  """
  return DECOMPOSER_FLAG not in os.environ.get("XLA_FLAGS", "")


class DispatchLayout(NamedTuple):
  """Per shard, what the dispatch decided (R = ranks, T = local tokens).

  send_sizes, input_offsets: int32[R]: rows this rank sends to each rank, and
    where they start in its sorted operand.
  output_offsets: int32[R]: where this rank's rows start on each receiver.
  recv_sizes: int32[R]: rows this rank receives from each rank.
  order: int32[R*T]: the sort of (destination, token) copies; order % T is the
    source token of each sorted row.
  """

  send_sizes: jax.Array
  input_offsets: jax.Array
  output_offsets: jax.Array
  recv_sizes: jax.Array
  order: jax.Array


class CombineLayout(NamedTuple):
  """Per shard, the reverse exchange's sizes and offsets (all int32[R] but order).

  recv_offsets / recv_sizes: where and how many rows from each source sit in
    this rank's received rows; back_offsets: where they go on that source;
  send_sizes: rows that come back to this rank from each rank; order: int32[R*T].
  """

  recv_offsets: jax.Array
  recv_sizes: jax.Array
  back_offsets: jax.Array
  send_sizes: jax.Array
  order: jax.Array


def dispatch(x: jax.Array, idx: jax.Array, config: jax_ep.EpConfig
             ) -> tuple[jax.Array, DispatchLayout]:
  """x [T, H], idx int32[T, K] (global experts) -> (rows [R*T, H], layout). Per shard."""
  axis = config.axis_name
  num_ranks = jax.lax.axis_size(axis)
  num_tokens = x.shape[0]
  experts_per_rank = config.num_experts // num_ranks
  owner = jnp.where(idx >= 0, idx // experts_per_rank, num_ranks)
  in_rank = jnp.any(owner[:, :, None] == jnp.arange(num_ranks), axis=1)      # [T, R]
  key = jnp.where(in_rank.T, jnp.arange(num_ranks)[:, None] * num_tokens
                  + jnp.arange(num_tokens)[None], num_ranks * num_tokens)  # [R, T]
  order = jnp.argsort(key.reshape(-1)).astype(jnp.int32)
  operand = x[order % num_tokens]                                          # [R*T, H]
  send_sizes = jnp.sum(in_rank, axis=0, dtype=jnp.int32)
  input_offsets = jnp.cumsum(send_sizes) - send_sizes
  counts = jax.lax.all_gather(send_sizes, axis)                            # [src, dst]
  me = jax.lax.axis_index(axis)
  output_offsets = jnp.sum(jnp.where(jnp.arange(num_ranks)[:, None] < me, counts, 0), axis=0,
                           dtype=jnp.int32)
  recv_sizes = counts[:, me]
  output = jnp.zeros((num_ranks * num_tokens, x.shape[1]), x.dtype)
  rows = jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                   recv_sizes, axis_name=axis)
  return rows, DispatchLayout(send_sizes, input_offsets, output_offsets, recv_sizes, order)


def combine_layout(layout: DispatchLayout, axis_name: str) -> CombineLayout:
  """The reverse exchange's layout, from the dispatch's (made once, untimed). Per shard."""
  recv_offsets = jnp.cumsum(layout.recv_sizes) - layout.recv_sizes
  # Rows received from s (at recv_offsets[s]) return to s's input offset for this rank.
  back_offsets = jax.lax.all_to_all(layout.input_offsets, axis_name, 0, 0, tiled=True)
  return CombineLayout(recv_offsets.astype(jnp.int32), layout.recv_sizes,
                       back_offsets.astype(jnp.int32), layout.send_sizes, layout.order)


def combine(y: jax.Array, layout: CombineLayout, axis_name: str) -> jax.Array:
  """y [R*T, H] (rows in the dispatch's received order) -> [T, H] in y's dtype:
  the reverse ragged_all_to_all, then each token's copies summed in float32. Per shard."""
  num_ranks = jax.lax.axis_size(axis_name)
  num_tokens = layout.order.shape[0] // num_ranks
  returned = jax.lax.ragged_all_to_all(
      y, jnp.zeros((num_ranks * num_tokens, y.shape[1]), y.dtype), layout.recv_offsets,
      layout.recv_sizes, layout.back_offsets, layout.send_sizes, axis_name=axis_name)
  out = jnp.zeros((num_tokens, y.shape[1]), jnp.float32).at[layout.order % num_tokens].add(
      returned.astype(jnp.float32))
  return out.astype(y.dtype)


def dispatch_op(config: jax_ep.EpConfig) -> Callable:
  """The per-shard op the bench times for the dispatch: (x, idx) -> (rows, layout)."""
  return lambda x, idx: dispatch(x, idx, config)


def combine_op(axis_name: str) -> Callable:
  """The per-shard op the bench times for the combine, alone:
  (y, *CombineLayout fields) -> [T, H]. Its inputs come from prepare_op."""
  return lambda y, *layout: combine(y, CombineLayout(*layout), axis_name)


def prepare_op(config: jax_ep.EpConfig) -> Callable:
  """Per shard, (x, idx) -> combine_op's inputs: the dispatch's rows and the reverse
  layout (run once, untimed)."""
  def prepare(x, idx):
    rows, layout = dispatch(x, idx, config)
    return (rows,) + tuple(combine_layout(layout, config.axis_name))
  return prepare
