"""Results and handles of jax_ep's ops: registered pytrees of per-shard device arrays.

Shapes use R (ranks on the EP axis), T (``max_tokens_per_rank``), T_ll (the
low-latency ops' cap, ``EpConfig.ll_max_tokens``), T_local (the caller's token
count, <= T or T_ll), K (top-k), E_local (experts per rank), H (hidden)
and C (HT row capacity, ``R * T`` unless ``capacity=`` lowers it). A token's
*source id* is ``src_rank * T_local + src_token``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax

from jax_ep.config import EpConfig


def _pytree(*, data: tuple[str, ...], meta: tuple[str, ...] = ()):
  def wrap(cls):
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))

  return wrap


@_pytree(data=("recv_src", "send_row", "num_tokens"), meta=("config",))
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
  """Layout of one HT dispatch, reused by combine and by the backward passes.

  Attributes:
    recv_src: int32[C]: source id of each received row, -1 on padding rows.
    send_row: int32[T_local, R]: row of each local token on each rank, -1 where
      the token was not sent there or was dropped past the capacity.
    num_tokens: int32[]: valid received rows.
    config: the EpConfig of the dispatch (static).
  """

  recv_src: jax.Array
  send_row: jax.Array
  num_tokens: jax.Array
  config: EpConfig


@_pytree(data=("x", "scales", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
               "num_dropped", "num_invalid", "handle"))
@dataclasses.dataclass(frozen=True)
class DispatchResult:
  """What an HT dispatch delivers to this rank.

  Rows ``0 .. num_tokens-1`` hold the received tokens ordered by (source rank,
  source token index); padding rows are zero with idx -1 and weight 0.

  Attributes:
    x: [C, H], the dtype of the dispatched rows (bf16/f16/f32, or
      float8_e4m3fn for an FP8 dispatch).
    scales: [C, H/128] float32 (or float8_e8m0fnu) for an FP8 dispatch, else None.
    topk_idx: int32[C, K]: the token's experts as local indices on this rank,
      -1 where the choice lives on another rank.
    topk_weights: float32[C, K]: 0 where topk_idx is -1.
    num_tokens: int32[]: valid rows.
    tokens_per_expert: int32[E_local]: valid rows choosing each local expert.
    num_dropped: int32[]: tokens sent to this rank that did not fit the capacity.
    num_invalid: int32[]: this rank's top-k entries outside [-1, E) (treated as -1).
    handle: the DispatchHandle combine needs.
  """

  x: jax.Array
  scales: Optional[jax.Array]
  topk_idx: jax.Array
  topk_weights: jax.Array
  num_tokens: jax.Array
  tokens_per_expert: jax.Array
  num_dropped: jax.Array
  num_invalid: jax.Array
  handle: DispatchHandle


@_pytree(data=("recv_src", "count"), meta=("config", "num_tokens", "live"))
@dataclasses.dataclass(frozen=True)
class LowLatencyHandle:
  """Layout of one LL dispatch.

  Attributes:
    recv_src: int32[E_local, R*T_ll]: source id of each row of each local expert,
      -1 at and past ``count``.
    count: int32[E_local]: rows received per local expert (-1 after a fault:
      the call's rows are void).
    config: the EpConfig of the dispatch (static).
    num_tokens: T_local of the dispatch (static; decodes source ids).
    live: which EP ranks were live (not masked) when the dispatch was traced,
      (): all of them (static; the combine leaves the same ranks out).
  """

  recv_src: jax.Array
  count: jax.Array
  config: EpConfig
  num_tokens: int
  live: tuple[bool, ...] = ()


@_pytree(data=("x", "scales", "count", "num_invalid", "handle"))
@dataclasses.dataclass(frozen=True)
class LowLatencyDispatchResult:
  """What an LL dispatch delivers to this rank.

  Attributes:
    x: [E_local, R*T_ll, H]: bfloat16 (the input dtype), or float8_e4m3fn with
      ``use_fp8``. Block e holds one row per (token, local expert e) pair from
      every source rank, ordered by (source rank, source token index); rows at
      and past count[e] are unspecified.
    scales: float32[E_local, R*T_ll, H/128] with ``use_fp8`` (per-128-channel
      amax/448), else None.
    count: int32[E_local]: valid rows per local expert.
    num_invalid: int32[]: this rank's top-k entries outside [-1, E).
    handle: the LowLatencyHandle low_latency_combine needs.
  """

  x: jax.Array
  scales: Optional[jax.Array]
  count: jax.Array
  num_invalid: jax.Array
  handle: LowLatencyHandle


class Layout(NamedTuple):
  """One rank's routing, counted (Backend.layout).

  Attributes:
    clean_idx: int32[T_local, K]: topk_idx with entries outside [-1, E) set to -1.
    num_invalid: int32[]: the entries outside [-1, E).
    tokens_per_rank: int32[R]: tokens going to each rank (once per rank).
    tokens_per_expert: int32[E]: tokens choosing each expert (once per expert).
    is_token_in_rank: bool[T_local, R].
  """

  clean_idx: jax.Array
  num_invalid: jax.Array
  tokens_per_rank: jax.Array
  tokens_per_expert: jax.Array
  is_token_in_rank: jax.Array


@_pytree(data=("payload",), meta=("path",))
@dataclasses.dataclass(frozen=True)
class LowLatencySent:
  """What the send half of a split LL op hands its receive half.

  Attributes:
    path: which path the send took: "kernel" (payload: the device ticket and
      what the send part returned) or "portable" (payload: the exchange's
      finished result); the receive half takes the same path.
    payload: arrays (a pytree) of that path.
  """

  path: str
  payload: Any
