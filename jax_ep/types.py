"""Results and handles of jax_ep's ops: registered pytrees of per-shard device arrays.

Shapes use R (ranks on the EP axis), T (``max_tokens_per_rank``), T_ll (the
low-latency ops' cap, ``EpConfig.ll_max_tokens``), T_local (the caller's token
count, <= T or T_ll), K (top-k), E_local (experts per rank), H (hidden)
C (HT row capacity, ``R * T`` unless ``capacity=`` lowers it) and M (the
expert-major dispatch's pair rows, jax_ep.expert_major). A token's *source id*
is ``src_rank * T_local + src_token``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, TypeAlias, Union

import jax

from jax_ep.config import EpConfig

# An FP8 dispatch's rows (jax_ep.fp8.quantize): float8_e4m3fn [T_local, H] and
# their per-128-channel scales [T_local, H/128], float32 or float8_e8m0fnu.
Fp8Rows: TypeAlias = tuple[jax.Array, jax.Array]

# What an HT dispatch takes as x: bfloat16/float16/float32 rows [T_local, H], or
# an FP8 (rows, scales) pair.
DispatchInput: TypeAlias = Union[jax.Array, Fp8Rows]

# What get_dispatch_layout returns: (tokens_per_rank int32[R], tokens_per_expert
# int32[E], is_token_in_rank bool[T_local, R]).
DispatchLayoutCounts: TypeAlias = tuple[jax.Array, jax.Array, jax.Array]


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


@_pytree(data=("token_major", "pair_src", "rows_by_expert", "slot_row", "topk_idx",
               "num_tokens"),
         meta=("alignment", "config"))
@dataclasses.dataclass(frozen=True)
class ExpertMajorHandle:
  """Layout of one expert-major HT dispatch (jax_ep.expert_major), for combine
  and the backward passes.

  Attributes:
    token_major: the DispatchHandle of the token-major staging rows underneath
      (capacity R * T: nothing is dropped there).
    pair_src: int32[M]: token-major row of each pair row, -1 on padding.
    rows_by_expert: int32[R*T, K]: pair rows of each token-major row in
      ascending local expert, then -1 (the combine's summation order).
    slot_row: int32[R*T, K]: pair row of each valid (row, k), -1 elsewhere.
    topk_idx: int32[T_local, K]: this rank's routing as the dispatch took it
      (after its checks), so that the combine's backward can run the same
      expert-major dispatch again and land its rows where the forward did.
    num_tokens: int32[]: pair rows.
    alignment: A, the dispatch's expert_alignment (static).
    config: the EpConfig of the dispatch (static).
  """

  token_major: DispatchHandle
  pair_src: jax.Array
  rows_by_expert: jax.Array
  slot_row: jax.Array
  topk_idx: jax.Array
  num_tokens: jax.Array
  alignment: int
  config: EpConfig


@_pytree(data=("x", "scales", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
               "num_dropped", "num_invalid", "handle", "group_sizes"))
@dataclasses.dataclass(frozen=True)
class DispatchResult:
  """What an HT dispatch delivers to this rank, in one of two layouts.

  ``layout="token_major"`` (the default): rows ``0 .. num_tokens-1`` hold the
  received tokens ordered by (source rank, source token index), each token once;
  padding rows are zero with idx -1 and weight 0.

  ``layout="expert_major"``: one row per (token, local expert) pair, grouped by
  local expert e = 0 .. E_local-1 (group e starts at ``sum(group_sizes[:e])``),
  rows of a group in (source rank, source token) order; rows holding no pair
  (each group's alignment padding, and the rows past the last group) are zero
  with idx -1 and weight 0. ``jax.lax.ragged_dot(x, w, group_sizes)`` takes
  them as they are.

  Attributes:
    x: [C, H] (token-major) or [M, H] (expert-major), the dtype of the
      dispatched rows (bf16/f16/f32, or float8_e4m3fn for an FP8 dispatch).
    scales: [C or M, H/128] float32 (or float8_e8m0fnu) for an FP8 dispatch,
      else None.
    topk_idx: token-major int32[C, K]: the token's experts as local indices on
      this rank, -1 where the choice lives on another rank. Expert-major
      int32[M]: each pair's local expert, -1 on padding.
    topk_weights: its shape depends on the layout. Token-major float32[C, K]:
      each received row's K weights, 0 where topk_idx is -1 (weight each local
      expert's output by its k entry before the combine). Expert-major
      float32[M]: each pair's weight (a token choosing an expert twice is one
      pair with the sum of both weights), 0 on padding (``y *
      d.topk_weights[:, None]`` before the combine). Neither is the dispatch's
      topk_weights input, float[T_local, K].
    num_tokens: int32[]: valid rows (expert-major: pair rows).
    tokens_per_expert: int32[E_local]: rows choosing each local expert
      (expert-major: pairs kept per local expert, before alignment).
    num_dropped: int32[]: token-major: tokens sent to this rank that did not
      fit the capacity; expert-major: pairs that did not fit M.
    num_invalid: int32[]: this rank's top-k entries outside [-1, E) (treated as -1).
    handle: the DispatchHandle (token-major) or ExpertMajorHandle combine needs.
    group_sizes: expert-major int32[E_local]: rows of each group,
      tokens_per_expert rounded up to expert_alignment (clipped at M);
      token-major: None.
  """

  x: jax.Array
  scales: Optional[jax.Array]
  topk_idx: jax.Array
  topk_weights: jax.Array
  num_tokens: jax.Array
  tokens_per_expert: jax.Array
  num_dropped: jax.Array
  num_invalid: jax.Array
  handle: DispatchHandle | ExpertMajorHandle
  group_sizes: Optional[jax.Array] = None


@_pytree(data=("recv_src", "count", "row_weights"), meta=("config", "num_tokens", "live"))
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
    row_weights: float32[E_local, R*T_ll] when the dispatch was given
      topk_weights: each row's pair weight (0 past count); then the combine
      applies them on the expert side and sends one row back per (token,
      rank). None otherwise.
  """

  recv_src: jax.Array
  count: jax.Array
  config: EpConfig
  num_tokens: int
  live: tuple[bool, ...] = ()
  row_weights: Optional[jax.Array] = None


@_pytree(data=("x", "scales", "count", "num_invalid", "handle", "weights"))
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
    weights: float32[E_local, R*T_ll] with topk_weights given to the
      dispatch: row (t, e)'s weight, the sum in k order of the token's weights
      naming e; 0 past count (also in handle.row_weights). None otherwise.
  """

  x: jax.Array
  scales: Optional[jax.Array]
  count: jax.Array
  num_invalid: jax.Array
  handle: LowLatencyHandle
  weights: Optional[jax.Array] = None


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
