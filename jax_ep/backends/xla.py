"""The portable backend: jax.lax collectives plus the local steps of local_ops.

Runs wherever XLA runs (CPU in CI, GPU/TPU without jax_ep's CUDA kernels) and
gives the same results as the CUDA kernels. Every exchange is one
capacity-padded ``jax.lax.all_to_all`` over the EP axis:

  HT dispatch   sender rows -> [R, T_local, ...] by source token -> all_to_all
                -> receiver compacts into (source rank, source token) order
  HT combine    receiver rows -> [R, T_local, ...] by source token -> all_to_all
                -> sender sums the copies of each token in fp32
  LL dispatch   sender rows -> [R, E_local, T_local, ...] by (expert, token)
                -> all_to_all -> receiver compacts per expert
  LL combine    receiver rows -> [R, E_local, T_local, ...] -> all_to_all
                -> sender sums w * row over its top-k in fp32
  LL combine,   receiver sums w * row per source token (weights from the
  pre-summed    dispatch) -> [R, T_local, ...] -> all_to_all -> sender sums
                the ranks' rows in fp32

All functions run inside shard_map over ``config.axis_name``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ep import expert_major
from jax_ep import fp8 as fp8_lib
from jax_ep import local_ops
from jax_ep._vma import match_vma
from jax_ep.config import EpConfig
from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle, Layout,
                          LowLatencyDispatchResult, LowLatencyHandle, LowLatencySent)

I32 = jnp.int32
F32 = jnp.float32


def _exchange(x: jax.Array, axis_name: str) -> jax.Array:
  """[R, ...] block r goes to rank r; result block s came from rank s."""
  return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _kept_slots(handle: DispatchHandle) -> jax.Array:
  """int32[T_local, R]: r * T_local + t where token t is kept on rank r, else -1
  (the token's slot in the [R, T_local, ...] exchange buffer)."""
  num_tokens, num_ranks = handle.send_row.shape
  slots = (jnp.arange(num_ranks, dtype=I32)[None] * num_tokens
           + jnp.arange(num_tokens, dtype=I32)[:, None])
  return jnp.where(handle.send_row >= 0, slots, -1)


def _live_experts(clean: jax.Array, config: EpConfig, live: tuple[bool, ...]) -> jax.Array:
  """Top-k ``clean`` (already in [-1, E)) with experts of masked ranks set to -1
  (live: masking.live_ranks, () = every rank live)."""
  if not live or all(live):
    return clean
  num_ranks = _num_ranks(config)
  owner_live = jnp.asarray(live)[jnp.maximum(clean, 0) // config.experts_per_rank(num_ranks)]
  return jnp.where(owner_live, clean, -1)


def _num_ranks(config: EpConfig) -> int:
  return jax.lax.axis_size(config.axis_name)


def _pick(values: jax.Array, index: jax.Array) -> jax.Array:
  """values[index] where index >= 0, else 0; values float32[N] (N = 0 when T_local = 0,
  where every index is -1 and XLA cannot gather from an empty array)."""
  if values.shape[0] == 0:
    return match_vma(jnp.zeros(index.shape, values.dtype), values, index)[0]
  return jnp.where(index >= 0, values[jnp.maximum(index, 0)], 0.0)


class XlaBackend:
  """Stateless portable implementation of the backend interface (backends/base.py)."""

  name = "xla"

  # ---------------------------------------------------------------- layout
  def layout(self, topk_idx: jax.Array, config: EpConfig) -> Layout:
    """With ``config.debug_checks`` every rank fails (at run time) when any rank
    has an index outside [-1, E)."""
    clean, num_invalid, first_invalid, tokens_per_rank, tokens_per_expert, is_token_in_rank = (
        local_ops.layout(topk_idx, num_experts=config.num_experts, num_ranks=_num_ranks(config)))
    if config.debug_checks:
      axis = config.axis_name
      clean = local_ops.check_invalid(clean, jax.lax.all_gather(num_invalid, axis),
                                      jax.lax.all_gather(first_invalid, axis),
                                      num_experts=config.num_experts)
    return Layout(clean, num_invalid, tokens_per_rank, tokens_per_expert, is_token_in_rank)

  # ---------------------------------------------------------------- HT
  def ht_dispatch(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                  topk_weights: jax.Array, config: EpConfig, capacity: int) -> DispatchResult:
    axis = config.axis_name
    num_ranks = _num_ranks(config)
    num_tokens = topk_idx.shape[0]
    clean, num_invalid, tokens_per_rank, _, _ = self.layout(topk_idx, config)
    # Row offset of this rank's tokens on each receiver: tokens of lower ranks first.
    counts = jax.lax.all_gather(tokens_per_rank, axis)  # [src, dst]
    before_me = jnp.arange(num_ranks) < jax.lax.axis_index(axis)
    row_offset = jnp.sum(jnp.where(before_me[:, None], counts, 0), axis=0, dtype=I32)
    send_idx, send_w, send_slot, send_row = local_ops.ht_route(
        clean, topk_weights, row_offset, num_experts=config.num_experts, capacity=capacity)
    recv_idx = _exchange(send_idx, axis)
    recv_w = _exchange(send_w, axis)
    recv_src, out_idx, out_w, tokens_per_expert, num_kept, num_dropped = local_ops.ht_compact(
        recv_idx, recv_w, experts_per_rank=config.experts_per_rank(num_ranks), capacity=capacity)
    outs = []
    for payload in payloads:
      packed = local_ops.scatter_rows(payload, send_slot, num_ranks * num_tokens)
      received = _exchange(packed.reshape((num_ranks, num_tokens) + payload.shape[1:]), axis)
      outs.append(local_ops.gather_rows(
          received.reshape((num_ranks * num_tokens,) + payload.shape[1:]), recv_src))
    handle = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=num_kept,
                            config=config)
    return DispatchResult(x=outs[0], scales=outs[1] if len(outs) > 1 else None, topk_idx=out_idx,
                          topk_weights=out_w, num_tokens=num_kept,
                          tokens_per_expert=tokens_per_expert, num_dropped=num_dropped,
                          num_invalid=num_invalid, handle=handle)

  def ht_dispatch_cached(self, payload: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Moves [T_local, ...] rows along a previous dispatch's layout -> [C, ...]."""
    axis = handle.config.axis_name
    num_tokens, num_ranks = handle.send_row.shape
    packed = local_ops.scatter_rows(payload, _kept_slots(handle), num_ranks * num_tokens)
    received = _exchange(packed.reshape((num_ranks, num_tokens) + payload.shape[1:]), axis)
    return local_ops.gather_rows(
        received.reshape((num_ranks * num_tokens,) + payload.shape[1:]), handle.recv_src)

  def ht_combine(self, rows: jax.Array, handle: DispatchHandle) -> jax.Array:
    """[C, ...] received rows back to their sources, summed in fp32 -> [T_local, ...]."""
    axis = handle.config.axis_name
    num_tokens, num_ranks = handle.send_row.shape
    packed = local_ops.scatter_rows(rows, handle.recv_src[:, None], num_ranks * num_tokens)
    returned = _exchange(packed.reshape((num_ranks, num_tokens) + rows.shape[1:]), axis)
    index = _kept_slots(handle)
    return local_ops.gather_reduce(
        returned.reshape((num_ranks * num_tokens,) + rows.shape[1:]), index,
        jnp.ones(index.shape, F32))

  # ---------------------------------------------------------------- HT, expert-major
  # The token-major exchange (capacity R * T, so nothing is dropped before the
  # pairs are placed), then local steps on the receiver (jax_ep/expert_major.py).
  def ht_dispatch_expert_major(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, num_rows: int,
                               alignment: int) -> DispatchResult:
    num_ranks = _num_ranks(config)
    token_major = self.ht_dispatch(payloads, topk_idx, topk_weights, config,
                                   config.capacity(num_ranks))
    return expert_major.from_token_major(token_major, topk_idx,
                                         experts_per_rank=config.experts_per_rank(num_ranks),
                                         alignment=alignment, num_rows=num_rows)

  def ht_dispatch_cached_expert_major(self, payload: jax.Array,
                                      handle: ExpertMajorHandle) -> jax.Array:
    token_rows = self.ht_dispatch_cached(payload, handle.token_major)
    return expert_major.to_pairs(token_rows, handle.pair_src)

  def ht_combine_expert_major(self, rows: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    partials = expert_major.per_rank_partials(rows, handle.rows_by_expert)
    return self.ht_combine(partials, handle.token_major).astype(rows.dtype)

  def ht_slot_values(self, values: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    """float32[M] per-pair values -> float32[R*T, K] (expert_major.slot_values)."""
    return expert_major.slot_values(values, handle.slot_row)

  # ---------------------------------------------------------------- LL
  def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig, use_fp8: bool,
                  live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    axis = config.axis_name
    num_ranks = _num_ranks(config)
    experts_per_rank = config.experts_per_rank(num_ranks)
    num_tokens = topk_idx.shape[0]
    rows_per_expert = num_ranks * config.ll_max_tokens
    clean, num_invalid, _, _, _ = self.layout(topk_idx, config)
    clean = _live_experts(clean, config, live)
    send_slot, send_mask = local_ops.ll_route(clean, num_experts=config.num_experts)
    recv_mask = _exchange(send_mask.reshape(num_ranks, experts_per_rank * num_tokens), axis)
    if live and not all(live):  # nothing is received from a masked source
      recv_mask = recv_mask & jnp.asarray(live)[:, None]
    recv_src, count, gather_index = local_ops.ll_compact(
        recv_mask.reshape(num_ranks, experts_per_rank, num_tokens),
        rows_per_expert=rows_per_expert)
    payloads = fp8_lib.quantize(x) if use_fp8 else (x,)
    outs = []
    for payload in payloads:
      row_shape = payload.shape[1:]
      packed = local_ops.scatter_rows(payload, send_slot, config.num_experts * num_tokens)
      received = _exchange(packed.reshape((num_ranks, experts_per_rank * num_tokens) + row_shape),
                           axis)
      gathered = local_ops.gather_rows(
          received.reshape((-1,) + row_shape), gather_index.reshape(-1))
      outs.append(gathered.reshape((experts_per_rank, rows_per_expert) + row_shape))
    handle = LowLatencyHandle(recv_src=recv_src, count=count, config=config,
                              num_tokens=num_tokens, live=live)
    return LowLatencyDispatchResult(x=outs[0], scales=outs[1] if use_fp8 else None, count=count,
                                    num_invalid=num_invalid, handle=handle)

  # Split LL ops: the portable exchange is one all_to_all, so the dispatch
  # happens in its send half and the combine in its recv half.
  def ll_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig,
                       use_fp8: bool, live: tuple[bool, ...] = (),
                       topk_weights: jax.Array | None = None) -> LowLatencySent:
    if topk_weights is not None:
      return LowLatencySent(path="portable", payload=XlaBackend.ll_dispatch_with_weights(
          self, x, topk_idx, topk_weights, config, use_fp8, live))
    return LowLatencySent(path="portable",
                          payload=XlaBackend.ll_dispatch(self, x, topk_idx, config, use_fp8, live))

  def ll_dispatch_recv(self, sent: LowLatencySent, config: EpConfig, use_fp8: bool,
                       num_tokens: int, live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    del config, use_fp8, num_tokens, live
    assert sent.path == "portable", sent.path
    return sent.payload

  def ll_combine_send(self, rows: jax.Array, handle: LowLatencyHandle) -> LowLatencySent:
    del handle
    return LowLatencySent(path="portable", payload=rows)

  def ll_combine_recv(self, sent: LowLatencySent, topk_idx: jax.Array, topk_weights: jax.Array,
                      handle: LowLatencyHandle) -> jax.Array:
    assert sent.path == "portable", sent.path
    return XlaBackend.ll_combine(self, sent.payload, topk_idx, topk_weights, handle)

  def ll_combine(self, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                 handle: LowLatencyHandle) -> jax.Array:
    """[E_local, R*T_ll, H] expert rows -> [T_local, H] = sum_k w * row, fp32."""
    config = handle.config
    num_tokens = topk_idx.shape[0]
    returned = self._return_rows(rows, handle, num_tokens)  # [E * T_local, H]
    clean = _live_experts(self.layout(topk_idx, config).clean_idx, config, handle.live)
    tokens = jnp.arange(num_tokens, dtype=I32)[:, None]
    index = jnp.where(clean >= 0, clean * num_tokens + tokens, -1)
    weights = jnp.where(clean >= 0, topk_weights, 0.0).astype(F32)
    return local_ops.gather_reduce(returned, index, weights)

  # ---------------------------------------------------------------- LL, weights on the expert side
  def ll_dispatch_with_weights(self, x: jax.Array, topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, use_fp8: bool,
                               live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    result = XlaBackend.ll_dispatch(self, x, topk_idx, config, use_fp8, live)
    row_weights = XlaBackend.ll_pairs_to_rows(self, topk_weights, topk_idx, result.handle)
    return dataclasses.replace(
        result, weights=row_weights,
        handle=dataclasses.replace(result.handle, row_weights=row_weights))

  def ll_combine_presummed(self, rows: jax.Array, topk_idx: jax.Array,
                           handle: LowLatencyHandle) -> jax.Array:
    """Per rank, each source token's rows weighted and summed in ascending local
    expert (fp32, one rounding to the rows' dtype), one [R, T_local, H]
    all_to_all, then the copies summed in fp32 in rank order."""
    config = handle.config
    num_ranks = _num_ranks(config)
    num_tokens = handle.num_tokens
    experts_per_rank, rows_per_expert = rows.shape[:2]
    row_shape = rows.shape[2:]
    slots = num_ranks * num_tokens
    src = handle.recv_src
    expert = jnp.arange(experts_per_rank, dtype=I32)[:, None]
    row_of_slot = jnp.full((experts_per_rank, slots), -1, I32).at[
        expert, jnp.where(src >= 0, src, slots)].set(
            jnp.broadcast_to(jnp.arange(rows_per_expert, dtype=I32), src.shape), mode="drop")
    index = jnp.where(row_of_slot >= 0, expert * rows_per_expert + row_of_slot, -1).T
    weights = jnp.where(index >= 0, handle.row_weights.reshape(-1)[jnp.maximum(index, 0)], 0.0)
    partials = local_ops.gather_reduce(rows.reshape((-1,) + row_shape), index, weights)
    returned = _exchange(partials.reshape((num_ranks, num_tokens) + row_shape), config.axis_name)
    clean = _live_experts(self.layout(topk_idx, config).clean_idx, config, handle.live)
    owner = jnp.where(clean >= 0, clean // experts_per_rank, -1)
    ranks = jnp.arange(num_ranks, dtype=I32)
    has_rows = jnp.any(owner[:, :, None] == ranks, axis=1)              # [T_local, R]
    tokens = jnp.arange(num_tokens, dtype=I32)[:, None]
    from_rank = jnp.where(has_rows, ranks * num_tokens + tokens, -1)
    return local_ops.gather_reduce(returned.reshape((slots,) + row_shape), from_rank,
                                   jnp.ones(from_rank.shape, F32))

  def ll_combine_presummed_send(self, rows: jax.Array,
                                handle: LowLatencyHandle) -> LowLatencySent:
    del handle
    return LowLatencySent(path="portable", payload=rows)

  def ll_combine_presummed_recv(self, sent: LowLatencySent, topk_idx: jax.Array,
                                handle: LowLatencyHandle) -> jax.Array:
    assert sent.path == "portable", sent.path
    return XlaBackend.ll_combine_presummed(self, sent.payload, topk_idx, handle)

  def _exchange_index(self, handle: LowLatencyHandle, num_tokens: int) -> jax.Array:
    """Flat [R, E_local, T_local] exchange position of each received row, -1 past count."""
    experts_per_rank = handle.recv_src.shape[0]
    src = handle.recv_src
    expert = jnp.arange(experts_per_rank, dtype=I32)[:, None]
    flat = ((src // num_tokens) * experts_per_rank + expert) * num_tokens + src % num_tokens
    return jnp.where(src >= 0, flat, -1)

  def _return_rows(self, rows: jax.Array, handle: LowLatencyHandle, num_tokens: int):
    axis = handle.config.axis_name
    experts_per_rank, rows_per_expert = rows.shape[:2]
    row_shape = rows.shape[2:]
    num_ranks = _num_ranks(handle.config)
    index = self._exchange_index(handle, num_tokens).reshape(-1, 1)
    packed = local_ops.scatter_rows(rows.reshape((-1,) + row_shape), index,
                                    num_ranks * experts_per_rank * num_tokens)
    returned = _exchange(packed.reshape((num_ranks, experts_per_rank * num_tokens) + row_shape),
                         axis)
    return returned.reshape((-1,) + row_shape)

  def ll_dispatch_weighted(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                           config: EpConfig,
                           live: tuple[bool, ...] = ()) -> tuple[jax.Array, jax.Array]:
    result = XlaBackend.ll_dispatch(self, x, topk_idx, config, False, live)
    return result.x, self.ll_pairs_to_rows(topk_weights, topk_idx, result.handle)

  # LL backward helpers: small per-(token, expert) values, plain jnp + all_to_all.
  def ll_pairs_to_rows(self, values: jax.Array, topk_idx: jax.Array,
                       handle: LowLatencyHandle) -> jax.Array:
    """values float32[T_local, K] -> float32[E_local, R*T_ll]: per received row (t, e),
    the sum of values[t, k] over the k choosing e; 0 past count."""
    config = handle.config
    axis = config.axis_name
    num_tokens = topk_idx.shape[0]
    num_ranks = _num_ranks(config)
    clean = _live_experts(self.layout(topk_idx, config).clean_idx, config, handle.live)
    tokens = jnp.arange(num_tokens, dtype=I32)[:, None]
    slot = jnp.where(clean >= 0, clean * num_tokens + tokens, config.num_experts * num_tokens)
    per_pair = jnp.zeros((config.num_experts * num_tokens,), F32).at[slot].add(
        values.astype(F32), mode="drop")
    received = _exchange(per_pair.reshape(num_ranks, -1), axis).reshape(-1)
    return _pick(received, self._exchange_index(handle, num_tokens))

  def ll_rows_to_pairs(self, values: jax.Array, topk_idx: jax.Array,
                       handle: LowLatencyHandle) -> jax.Array:
    """values float32[E_local, R*T_ll] -> float32[T_local, K]: value of the row of
    (t, e_k) for each valid k, 0 for -1 entries."""
    config = handle.config
    axis = config.axis_name
    num_tokens = topk_idx.shape[0]
    num_ranks = _num_ranks(config)
    index = self._exchange_index(handle, num_tokens)
    size = config.num_experts * num_tokens
    per_pair = jnp.zeros((size,), F32).at[jnp.where(index >= 0, index, size)].set(
        values.astype(F32), mode="drop")
    returned = _exchange(per_pair.reshape(num_ranks, -1), axis).reshape(-1)
    clean = _live_experts(self.layout(topk_idx, config).clean_idx, config, handle.live)
    tokens = jnp.arange(num_tokens, dtype=I32)[:, None]
    return _pick(returned, jnp.where(clean >= 0, clean * num_tokens + tokens, -1))
