"""The backend interface: what the ops (ht_ops.py, ll_ops.py, ll_split_ops.py) call,
inside shard_map over the EP axes.

A backend is a function of its arguments: it keeps no process state (the
runtime owns it and passes what a call needs: the config, the live ranks, the
handles). Shapes: R ranks per EP group, T_local tokens of this rank, K
top-k, E experts, E_local = E / R, H hidden, C = HT rows, T_ll = the LL
token cap. ``live``: masking.live_ranks (() = every rank live); the LL
handles record the one their dispatch used.
"""

from __future__ import annotations

from typing import Protocol

import jax

from jax_ep.config import EpConfig
from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle, Layout,
                          LowLatencyDispatchResult, LowLatencyHandle, LowLatencySent)


class Backend(Protocol):
  """jax_ep's ops on one backend ("xla": portable collectives; "cuda": kernels)."""

  name: str

  def layout(self, topk_idx: jax.Array, config: EpConfig) -> Layout:
    """Counts of one rank's routing (topk_idx int32[T_local, K])."""

  # High throughput.
  def ht_dispatch(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                  topk_weights: jax.Array, config: EpConfig, capacity: int) -> DispatchResult:
    """Each token to every rank holding one of its experts; payloads: (x,) or
    (x_fp8, scales); topk_idx int32[T_local, K], topk_weights f32[T_local, K]."""

  def ht_dispatch_cached(self, payload: jax.Array, handle: DispatchHandle) -> jax.Array:
    """[T_local, H] rows placed where the handle's dispatch placed its tokens -> [C, H]."""

  def ht_combine(self, rows: jax.Array, handle: DispatchHandle) -> jax.Array:
    """[C, W] rows back to their sources, summed in fp32 in rank order -> [T_local, W]."""

  # High throughput, expert-major (jax_ep/expert_major.py).
  def ht_dispatch_expert_major(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, num_rows: int,
                               alignment: int) -> DispatchResult:
    """Every (token, local expert) pair into its expert's group -> M = num_rows rows."""

  def ht_dispatch_cached_expert_major(self, payload: jax.Array,
                                      handle: ExpertMajorHandle) -> jax.Array:
    """[T_local, H] rows placed at every pair row of the handle -> [M, H]."""

  def ht_combine_expert_major(self, rows: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    """[M, W] pair rows -> [T_local, W]: per rank an fp32 sum over the token's
    pairs in ascending local expert, those partials summed in rank order."""

  def ht_slot_values(self, values: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    """float32[M] per-pair values -> float32[C, K]: the value of the pair row of
    each valid (row, k) of the token-major staging rows (handle.slot_row), 0
    elsewhere; local, no exchange (the dispatch's weight gradient)."""

  # Low latency.
  def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig, use_fp8: bool,
                  live: tuple[bool, ...]) -> LowLatencyDispatchResult:
    """Every (token, expert) pair into the expert's [R*T_ll] row block."""

  def ll_dispatch_weighted(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                           config: EpConfig,
                           live: tuple[bool, ...]) -> tuple[jax.Array, jax.Array]:
    """(rows [E_local, R*T_ll, H], row_weights f32[E_local, R*T_ll]): an LL dispatch
    whose every row (t, e) also carries the sum of topk_weights[t, k] over the k
    choosing e (0 past count)."""

  def ll_combine(self, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                 handle: LowLatencyHandle) -> jax.Array:
    """[E_local, R*T_ll, H] expert rows -> [T_local, H] = sum_k w * row, fp32."""

  def ll_dispatch_with_weights(self, x: jax.Array, topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, use_fp8: bool,
                               live: tuple[bool, ...]) -> LowLatencyDispatchResult:
    """ll_dispatch whose result (``weights``) and handle (``row_weights``) carry
    each row's pair weight, for a combine that applies them on the expert side."""

  def ll_combine_presummed(self, rows: jax.Array, topk_idx: jax.Array,
                           handle: LowLatencyHandle) -> jax.Array:
    """[E_local, R*T_ll, H] rows of a dispatch with weights -> [T_local, H]: each
    rank sends one row per token, its rows' w * row summed in fp32 in ascending
    local expert and rounded to the rows' dtype; the source adds those in fp32
    in rank order."""

  def ll_rows_to_pairs(self, values: jax.Array, topk_idx: jax.Array,
                       handle: LowLatencyHandle) -> jax.Array:
    """values f32[E_local, R*T_ll] -> f32[T_local, K]: the value of the row of
    (t, e_k) for each valid k, 0 for -1 entries."""

  # Low latency, split in two for overlap.
  def ll_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig,
                       use_fp8: bool, live: tuple[bool, ...],
                       topk_weights: jax.Array | None = None) -> LowLatencySent: ...

  def ll_dispatch_recv(self, sent: LowLatencySent, config: EpConfig, use_fp8: bool,
                       num_tokens: int, live: tuple[bool, ...]) -> LowLatencyDispatchResult: ...

  def ll_combine_send(self, rows: jax.Array, handle: LowLatencyHandle) -> LowLatencySent: ...

  def ll_combine_presummed_send(self, rows: jax.Array,
                                handle: LowLatencyHandle) -> LowLatencySent: ...

  def ll_combine_presummed_recv(self, sent: LowLatencySent, topk_idx: jax.Array,
                                handle: LowLatencyHandle) -> jax.Array: ...

  def ll_combine_recv(self, sent: LowLatencySent, topk_idx: jax.Array, topk_weights: jax.Array,
                      handle: LowLatencyHandle) -> jax.Array: ...
