"""The oracle: an obviously-correct all_gather implementation of jax_ep's contract.

Every rank gathers every rank's tokens and routing and computes what it should
receive (or return) with dense jax.numpy. It shares no code with the backends
(not even the FP8 formula, which is restated here), it is differentiable with
plain JAX autodiff, and it is only meant for tests: it moves R times the data.

Call inside ``jax.shard_map`` over ``config.axis_name`` like the real ops; no
``initialize`` needed. Row orders are the contract's: (source rank, source
token index).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ep.config import EpConfig


def _clean(topk_idx: jax.Array, config: EpConfig) -> jax.Array:
  valid = (topk_idx >= -1) & (topk_idx < config.num_experts)
  return jnp.where(valid, topk_idx, -1).astype(jnp.int32)


def _gather(x: jax.Array, config: EpConfig) -> jax.Array:
  return jax.lax.all_gather(x, config.axis_name)


def _place_payload(place, rows: jax.Array) -> jax.Array:
  """Padding rows are zero *bytes*: float8_e8m0fnu has no zero value, so its
  rows are placed as raw uint8 (the others stay differentiable)."""
  if rows.dtype != jnp.float8_e8m0fnu:
    return place(rows, 0)
  raw = place(jax.lax.bitcast_convert_type(rows, jnp.uint8), 0)
  return jax.lax.bitcast_convert_type(raw, rows.dtype)


def _num_ranks(config: EpConfig) -> int:
  return jax.lax.axis_size(config.axis_name)


def _chooses(idx: jax.Array, experts: jax.Array) -> jax.Array:
  """bool[..., len(experts)]: the token's top-k contains the expert."""
  return jnp.any(idx[..., :, None] == experts, axis=-2)


def get_dispatch_layout(topk_idx: jax.Array, *, config: EpConfig):
  """(tokens_per_rank int32[R], tokens_per_expert int32[E], is_token_in_rank bool[T, R])."""
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  idx = _clean(topk_idx, config)
  per_expert = _chooses(idx, jnp.arange(config.num_experts))              # [T, E]
  in_rank = jnp.any(per_expert.reshape(idx.shape[0], num_ranks, experts_per_rank), axis=2)
  return (jnp.sum(in_rank, axis=0, dtype=jnp.int32), jnp.sum(per_expert, axis=0, dtype=jnp.int32),
          in_rank)


def _ht_routing(all_idx: jax.Array, rank, config: EpConfig, capacity: int):
  """For receiver ``rank``: which gathered tokens it gets and at which row.

  all_idx: int32[R, T_local, K]. Returns (row int32[R*T_local], kept bool[R*T_local],
  received int32[]) over the tokens in (source rank, source token) order.
  """
  num_ranks = all_idx.shape[0]
  experts_per_rank = config.num_experts // num_ranks
  flat = all_idx.reshape(-1, all_idx.shape[-1])
  goes_here = jnp.any((flat >= 0) & (flat // experts_per_rank == rank), axis=1)
  row = jnp.cumsum(goes_here) - 1
  return row, goes_here & (row < capacity), jnp.sum(goes_here, dtype=jnp.int32)


def _worst_pair_rows(config: EpConfig, alignment: int) -> int:
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  rows = (num_ranks * config.max_tokens_per_rank * min(config.num_topk, experts_per_rank)
          + experts_per_rank * (alignment - 1))
  return -(-rows // alignment) * alignment


def _pair_routing(all_idx: jax.Array, rank, config: EpConfig, alignment: int, num_rows: int):
  """For receiver ``rank``, over the gathered tokens j in (source rank, source
  token) order and its local experts e: (row int32[R*T, E_local], kept
  bool[R*T, E_local], count int32[E_local], padded, start)."""
  num_ranks = all_idx.shape[0]
  experts_per_rank = config.num_experts // num_ranks
  flat = all_idx.reshape(-1, all_idx.shape[-1])
  chooses = _chooses(flat, rank * experts_per_rank + jnp.arange(experts_per_rank))
  count = jnp.sum(chooses, axis=0, dtype=jnp.int32)
  padded = (count + alignment - 1) // alignment * alignment
  start = jnp.cumsum(padded) - padded
  row = start[None, :] + jnp.cumsum(chooses, axis=0) - 1
  return row, chooses & (row < num_rows), count, padded, start


def dispatch(x, topk_idx: jax.Array, topk_weights: jax.Array, *, config: EpConfig,
             capacity: int | None = None, layout: str = "token_major",
             expert_alignment: int = 1) -> dict:
  """The HT dispatch, as a dict of the DispatchResult fields (no handle).

  ``x`` may be an array or an (x_fp8, scales) pair; ``scales`` is None otherwise.
  ``layout="expert_major"``: the pair rows (``capacity``: M), with group_sizes.
  """
  if layout == "expert_major":
    return _dispatch_expert_major(x, topk_idx, topk_weights, config=config,
                                  alignment=expert_alignment, capacity=capacity)
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  capacity = capacity or num_ranks * config.max_tokens_per_rank
  me = jax.lax.axis_index(config.axis_name)
  payloads = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  idx = _clean(topk_idx, config)
  all_idx = _gather(idx, config)                                          # [R, T, K]
  all_w = _gather(topk_weights.astype(jnp.float32), config)
  row, kept, received = _ht_routing(all_idx, me, config, capacity)
  target = jnp.where(kept, row, capacity)

  def place(values, fill):
    flat = values.reshape((-1,) + values.shape[2:])
    out = jnp.full((capacity,) + flat.shape[1:], fill, flat.dtype)
    return out.at[target].set(flat, mode="drop")

  flat_idx = all_idx.reshape(-1, all_idx.shape[-1])
  mine = (flat_idx >= 0) & (flat_idx // experts_per_rank == me)
  local_idx = jnp.where(mine, flat_idx - me * experts_per_rank, -1)
  local_w = jnp.where(mine, all_w.reshape(mine.shape), 0.0)
  out_idx = place(local_idx.reshape(all_idx.shape), -1)
  num_tokens = jnp.minimum(received, capacity)
  outs = [_place_payload(place, _gather(p, config)) for p in payloads]
  return dict(
      x=outs[0], scales=outs[1] if len(outs) > 1 else None, topk_idx=out_idx,
      topk_weights=place(local_w.reshape(all_idx.shape), 0.0), num_tokens=num_tokens,
      tokens_per_expert=jnp.sum(_chooses(out_idx, jnp.arange(experts_per_rank)), axis=0,
                                dtype=jnp.int32),
      num_dropped=received - num_tokens,
      num_invalid=jnp.sum((topk_idx < -1) | (topk_idx >= config.num_experts), dtype=jnp.int32))


def _dispatch_expert_major(x, topk_idx, topk_weights, *, config: EpConfig, alignment: int,
                           capacity: int | None) -> dict:
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  num_rows = capacity or _worst_pair_rows(config, alignment)
  me = jax.lax.axis_index(config.axis_name)
  payloads = tuple(x) if isinstance(x, (tuple, list)) else (x,)
  all_idx = _gather(_clean(topk_idx, config), config)                     # [R, T, K]
  flat_idx = all_idx.reshape(-1, all_idx.shape[-1])
  flat_w = _gather(topk_weights.astype(jnp.float32), config).reshape(flat_idx.shape)
  row, kept, count, padded, start = _pair_routing(all_idx, me, config, alignment, num_rows)
  gathered = [_gather(p, config).reshape((-1,) + p.shape[1:]) for p in payloads]
  outs = [jax.lax.bitcast_convert_type(jnp.zeros((num_rows,) + g.shape[1:], jnp.uint8), g.dtype)
          if g.dtype == jnp.float8_e8m0fnu else jnp.zeros((num_rows,) + g.shape[1:], g.dtype)
          for g in gathered]
  out_idx = jnp.full((num_rows,), -1, jnp.int32)
  out_w = jnp.zeros((num_rows,), jnp.float32)
  for e in range(experts_per_rank):
    target = jnp.where(kept[:, e], row[:, e], num_rows)
    expert = me * experts_per_rank + e
    weight = jnp.zeros(flat_idx.shape[:1], jnp.float32)
    for k in range(flat_idx.shape[1]):
      weight = weight + jnp.where(flat_idx[:, k] == expert, flat_w[:, k], 0.0)
    outs = [_set_rows(o, target, g) for o, g in zip(outs, gathered)]
    out_idx = out_idx.at[target].set(e, mode="drop")
    out_w = out_w.at[target].set(weight, mode="drop")
  room = jnp.maximum(num_rows - start, 0)
  tokens_per_expert = jnp.minimum(room, count)
  kept_pairs = jnp.sum(tokens_per_expert, dtype=jnp.int32)
  return dict(
      x=outs[0], scales=outs[1] if len(outs) > 1 else None, topk_idx=out_idx, topk_weights=out_w,
      num_tokens=kept_pairs, tokens_per_expert=tokens_per_expert,
      group_sizes=jnp.minimum(room, padded), num_dropped=jnp.sum(count) - kept_pairs,
      num_invalid=jnp.sum((topk_idx < -1) | (topk_idx >= config.num_experts), dtype=jnp.int32))


def _set_rows(out: jax.Array, target: jax.Array, rows: jax.Array) -> jax.Array:
  """out[target] = rows (mode drop); float8_e8m0fnu as raw bytes (see _place_payload)."""
  if out.dtype != jnp.float8_e8m0fnu:
    return out.at[target].set(rows, mode="drop")
  as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8)  # noqa: E731
  return jax.lax.bitcast_convert_type(
      as_bytes(out).at[target].set(as_bytes(rows), mode="drop"), out.dtype)


def combine(y: jax.Array, topk_idx: jax.Array, *, config: EpConfig,
            capacity: int | None = None, layout: str = "token_major",
            expert_alignment: int = 1) -> jax.Array:
  """The HT combine for rows ``y`` produced from ``dispatch(x, topk_idx, ...)``
  with the same layout, capacity and alignment: token-major y [C, H], or
  expert-major pair rows y [M, H]."""
  if layout == "expert_major":
    return _combine_expert_major(y, topk_idx, config=config, alignment=expert_alignment,
                                 capacity=capacity)
  num_ranks = _num_ranks(config)
  capacity = capacity or num_ranks * config.max_tokens_per_rank
  me = jax.lax.axis_index(config.axis_name)
  num_tokens = topk_idx.shape[0]
  all_idx = _gather(_clean(topk_idx, config), config)
  all_y = _gather(y, config)                                              # [R, C, H]
  out = jnp.zeros((num_tokens,) + y.shape[1:], jnp.float32)
  for r in range(num_ranks):
    row, kept, _ = _ht_routing(all_idx, r, config, capacity)
    my_rows = jax.lax.dynamic_slice_in_dim(row, me * num_tokens, num_tokens)
    my_kept = jax.lax.dynamic_slice_in_dim(kept, me * num_tokens, num_tokens)
    contribution = all_y[r][jnp.where(my_kept, my_rows, 0)].astype(jnp.float32)
    out = out + jnp.where(my_kept.reshape((-1,) + (1,) * (y.ndim - 1)), contribution, 0.0)
  return out.astype(y.dtype)


def quantize_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Per-128-channel e4m3 cast: scale = max(amax, 1e-4) / 448."""
  groups = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 128, 128))
  amax = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1, keepdims=True), 1e-4)
  q = (groups * (448.0 / amax)).astype(jnp.float8_e4m3fn).reshape(x.shape)
  return q, (amax / 448.0)[..., 0]


def _ll_rows(all_idx: jax.Array, expert) -> tuple[jax.Array, jax.Array, jax.Array]:
  """For one global expert: (row int32[R*T_local], chooses bool[R*T_local], count int32[])."""
  chooses = jnp.any(all_idx.reshape(-1, all_idx.shape[-1]) == expert, axis=1)
  return jnp.cumsum(chooses) - 1, chooses, jnp.sum(chooses, dtype=jnp.int32)


def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, *, config: EpConfig,
                         use_fp8: bool = False, topk_weights: jax.Array | None = None) -> dict:
  """The LL dispatch as a dict: x [E_local, R*T_ll, H], scales or None, count,
  recv_src, and with topk_weights the rows' weights [E_local, R*T_ll] (else None).

  Rows past count are zero here (the contract leaves them unspecified).
  recv_src holds src_rank * T_local + src_token per row, -1 past count. A
  row's weight is the sum, in k order from 0, of the token's weights naming
  that expert.
  """
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  rows = num_ranks * config.ll_max_tokens
  me = jax.lax.axis_index(config.axis_name)
  all_idx = _gather(_clean(topk_idx, config), config)
  payloads = quantize_fp8(x) if use_fp8 else (x,)
  gathered = [_gather(p, config).reshape((-1,) + p.shape[1:]) for p in payloads]
  outs = [[] for _ in payloads]
  counts, sources = [], []
  for e in range(experts_per_rank):
    row, chooses, count = _ll_rows(all_idx, me * experts_per_rank + e)
    target = jnp.where(chooses, row, rows)
    for out, g in zip(outs, gathered):
      out.append(jnp.zeros((rows,) + g.shape[1:], g.dtype).at[target].set(g, mode="drop"))
    sources.append(jnp.full((rows,), -1, jnp.int32).at[target].set(
        jnp.arange(chooses.shape[0], dtype=jnp.int32), mode="drop"))
    counts.append(count)
  stacked = [jnp.stack(o) for o in outs]
  weights = None
  if topk_weights is not None:
    all_w = _gather(topk_weights.astype(jnp.float32), config).reshape(-1, all_idx.shape[-1])
    flat_idx = all_idx.reshape(-1, all_idx.shape[-1])
    weights = []
    for e in range(experts_per_rank):
      row, chooses, _ = _ll_rows(all_idx, me * experts_per_rank + e)
      summed = jnp.zeros(flat_idx.shape[:1], jnp.float32)
      for k in range(flat_idx.shape[1]):
        summed = summed + jnp.where(flat_idx[:, k] == me * experts_per_rank + e, all_w[:, k], 0.0)
      weights.append(jnp.zeros((rows,), jnp.float32).at[jnp.where(chooses, row, rows)].set(
          summed, mode="drop"))
    weights = jnp.stack(weights)
  return dict(x=stacked[0], scales=stacked[1] if use_fp8 else None, count=jnp.stack(counts),
              recv_src=jnp.stack(sources), weights=weights)


def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, *,
                        config: EpConfig, presummed: bool = False) -> jax.Array:
  """out[t] = sum_k w[t, k] * (row of (t, e_k) in y of e_k's rank), fp32, cast to y.dtype.

  ``presummed``: the weights were given to the dispatch: out[t] = fp32 sum in
  rank order of p_r[t] = y.dtype(fp32 sum over t's experts on r, ascending, of
  W * row), W the sum in k order of t's weights naming that expert.
  """
  if presummed:
    return _low_latency_combine_presummed(y, topk_idx, topk_weights, config=config)
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  me = jax.lax.axis_index(config.axis_name)
  num_tokens = topk_idx.shape[0]
  idx = _clean(topk_idx, config)
  all_idx = _gather(idx, config)
  all_y = _gather(y, config)                                              # [R, E_local, R*T_ll, H]
  # row_of[e, t]: row of my token t in global expert e's block.
  row_of = []
  for e in range(config.num_experts):
    row, _, _ = _ll_rows(all_idx, e)
    row_of.append(jax.lax.dynamic_slice_in_dim(row, me * num_tokens, num_tokens))
  row_of = jnp.stack(row_of)                                              # [E, T]
  out = jnp.zeros((num_tokens,) + y.shape[2:], jnp.float32)
  tokens = jnp.arange(num_tokens)
  for k in range(idx.shape[1]):
    e = idx[:, k]
    safe_e = jnp.maximum(e, 0)
    row = row_of[safe_e, tokens]
    picked = all_y[safe_e // experts_per_rank, safe_e % experts_per_rank, row]
    contribution = topk_weights[:, k].astype(jnp.float32)[:, None] * picked.astype(jnp.float32)
    # Rounded to float32 before it is added: the barrier keeps XLA from
    # contracting the product and the sum into a fused multiply-add.
    contribution = jax.lax.optimization_barrier(contribution)
    out = out + jnp.where((e >= 0)[:, None], contribution, 0.0)
  return out.astype(y.dtype)


def _combine_expert_major(y: jax.Array, topk_idx: jax.Array, *, config: EpConfig,
                          alignment: int, capacity: int | None) -> jax.Array:
  """out[t] = sum over ranks r in order of (sum over t's pairs on r in
  ascending local expert of y_r[pair row]), each sum in float32."""
  num_ranks = _num_ranks(config)
  num_rows = capacity or _worst_pair_rows(config, alignment)
  me = jax.lax.axis_index(config.axis_name)
  num_tokens = topk_idx.shape[0]
  all_idx = _gather(_clean(topk_idx, config), config)
  all_y = _gather(y, config)                                              # [R, M, H]
  trailing = (1,) * (y.ndim - 1)
  total = jnp.zeros((num_tokens,) + y.shape[1:], jnp.float32)
  for r in range(num_ranks):
    row, kept, _, _, _ = _pair_routing(all_idx, r, config, alignment, num_rows)
    my_rows = jax.lax.dynamic_slice_in_dim(row, me * num_tokens, num_tokens)
    my_kept = jax.lax.dynamic_slice_in_dim(kept, me * num_tokens, num_tokens)
    partial = jnp.zeros_like(total)
    for e in range(row.shape[1]):
      value = all_y[r][jnp.where(my_kept[:, e], my_rows[:, e], 0)].astype(jnp.float32)
      partial = jnp.where(my_kept[:, e].reshape((-1,) + trailing), partial + value, partial)
    total = total + partial
  return total.astype(y.dtype)


def _low_latency_combine_presummed(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                                   *, config: EpConfig) -> jax.Array:
  num_ranks = _num_ranks(config)
  experts_per_rank = config.num_experts // num_ranks
  me = jax.lax.axis_index(config.axis_name)
  num_tokens = topk_idx.shape[0]
  idx = _clean(topk_idx, config)
  weights = topk_weights.astype(jnp.float32)
  all_idx = _gather(idx, config)
  all_y = _gather(y, config)                                              # [R, E_local, R*T_ll, H]
  total = jnp.zeros((num_tokens,) + y.shape[2:], jnp.float32)
  for r in range(num_ranks):
    partial = jnp.zeros_like(total)
    for e in range(experts_per_rank):
      expert = r * experts_per_rank + e
      row, chooses, _ = _ll_rows(all_idx, expert)
      mine = jax.lax.dynamic_slice_in_dim(chooses, me * num_tokens, num_tokens)
      my_row = jax.lax.dynamic_slice_in_dim(row, me * num_tokens, num_tokens)
      w = jnp.zeros((num_tokens,), jnp.float32)
      for k in range(idx.shape[1]):
        w = w + jnp.where(idx[:, k] == expert, weights[:, k], 0.0)
      value = w[:, None] * all_y[r, e][jnp.maximum(my_row, 0)].astype(jnp.float32)
      # The product is rounded to float32 before it is added: the barrier keeps
      # XLA from contracting the two into a fused multiply-add.
      value = jax.lax.optimization_barrier(value)
      partial = jnp.where(mine[:, None], partial + value, partial)
    total = total + partial.astype(y.dtype).astype(jnp.float32)
  return total.astype(y.dtype)
