"""The low-latency one-call ops: low_latency_dispatch and low_latency_combine (plain
and pre-summed on the expert side), with their custom_vjps. Shapes and
conventions: jax_ep/ops.py."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import _other_axes
from jax_ep import _validate
from jax_ep import local_ops
from jax_ep._op_support import _Static, _check_handle, _is_zero, _prepare, _primal, _varying
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.types import LowLatencyDispatchResult, LowLatencyHandle


# ====================================================================== LL dispatch
def low_latency_dispatch(x: jax.Array, topk_idx: jax.Array, *, config: EpConfig,
                         use_fp8: bool = False,
                         topk_weights: jax.Array | None = None) -> LowLatencyDispatchResult:
  """Writes every (token, expert) pair straight into the expert's row block.

  Args:
    x: [T_local, H] bfloat16 (float16/float32 accepted by the portable backend).
    topk_idx: int32 [T_local, K] in [-1, E) (int64 with jax_enable_x64, see the
      module docstring). A token choosing the same expert twice sends one row.
    config: the EpConfig given to initialize().
    use_fp8: send float8_e4m3fn rows with per-128-channel scales (jax_ep.fp8).
    topk_weights: optional float [T_local, K] (used as float32). Given here,
      each row's weight travels with it (``weights`` of the result), and
      low_latency_combine(y, topk_idx, None, handle) applies them on the expert
      side: one row per (token, rank) goes back instead of one per (token,
      expert).
  Returns:
    LowLatencyDispatchResult (see jax_ep.types).
  """
  if _other_axes.other_axes():
    if topk_weights is None:
      return _other_axes.per_group(low_latency_dispatch, x, topk_idx, config=config,
                                   use_fp8=use_fp8)
    return _other_axes.per_group(
        lambda x, i, w: low_latency_dispatch(x, i, config=config, use_fp8=use_fp8,
                                             topk_weights=w), x, topk_idx, topk_weights)
  op = "low_latency_dispatch"
  state, _ = _prepare(op, config)
  num_tokens = _validate.tokens(x, config, op, low_latency=True)
  idx = _validate.topk_indices(topk_idx, num_tokens, config, op)
  if use_fp8 and config.hidden % 128:
    raise EpConfigError(f"jax_ep.{op}: use_fp8 needs hidden to be a multiple of 128, "
                        f"got {config.hidden}")
  static = _Static(config=config, backend=state.backend, fp8=bool(use_fp8),
                   live=state.live_ranks())
  if topk_weights is None:
    x, idx = _varying(config, x, idx)
    return _ll_dispatch(static, x, idx)
  weights = _validate.topk_weights(topk_weights, num_tokens, config, op)
  x, idx, weights = _varying(config, x, idx, weights)
  return _ll_dispatch_with_weights(static, x, idx, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch(static: _Static, x, idx) -> LowLatencyDispatchResult:
  return static.backend.ll_dispatch(x, idx, static.config, static.fp8, static.live)


def _ll_dispatch_fwd(static, x, idx):
  x, idx = _primal((x, idx))
  result = _ll_dispatch(static, x, idx)
  return result, (idx, result.handle)


def _distinct_experts(idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """(idx with repeats and invalid entries set to -1, 1.0 where kept)."""
  clean = jnp.where((idx >= 0) & (idx < num_experts), idx, -1)
  first = local_ops.first_occurrence(clean)
  return jnp.where(first, clean, -1), first.astype(jnp.float32)


def _ll_dispatch_bwd(static, residuals, ct: LowLatencyDispatchResult):
  idx, handle = residuals
  if _is_zero(ct.x):
    return None, None
  if static.fp8:
    raise EpError("jax_ep.low_latency_dispatch: gradients through use_fp8=True are not "
                  "supported; dispatch bfloat16 rows where you differentiate")
  distinct_idx, ones = _distinct_experts(idx, static.config.num_experts)
  return static.backend.ll_combine(_masked_rows(ct.x, handle), distinct_idx, ones, handle), None


def _masked_rows(rows: jax.Array, handle: LowLatencyHandle) -> jax.Array:
  """Zeroes rows at and past count (unspecified contents)."""
  valid = jnp.arange(rows.shape[1])[None, :] < handle.count[:, None]
  return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 2)), rows,
                   jnp.zeros((), rows.dtype))


_ll_dispatch.defvjp(_ll_dispatch_fwd, _ll_dispatch_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_dispatch_with_weights(static: _Static, x, idx, weights) -> LowLatencyDispatchResult:
  return static.backend.ll_dispatch_with_weights(x, idx, weights, static.config, static.fp8,
                                                 static.live)


def _ll_dispatch_with_weights_fwd(static, x, idx, weights):
  x, idx, weights = _primal((x, idx, weights))
  result = _ll_dispatch_with_weights(static, x, idx, weights)
  return result, (idx, result.handle)


def _ll_dispatch_with_weights_bwd(static, residuals, ct: LowLatencyDispatchResult):
  # Row (t, e)'s weight is the sum of w[t, k] over the k naming e: each such k
  # gets the row's cotangent, from the result's weights and the handle's copy
  # (the pre-summed combine's gradient arrives there).
  idx, handle = residuals
  (grad_x, _) = _ll_dispatch_bwd(static, residuals, ct)
  weight_cts = [c for c in (ct.weights, ct.handle.row_weights) if not _is_zero(c)]
  grad_weights = None
  if weight_cts:
    total = functools.reduce(jnp.add, [c.astype(jnp.float32) for c in weight_cts])
    grad_weights = static.backend.ll_rows_to_pairs(_masked_rows(total, handle), idx, handle)
  return grad_x, None, grad_weights


_ll_dispatch_with_weights.defvjp(_ll_dispatch_with_weights_fwd, _ll_dispatch_with_weights_bwd,
                                 symbolic_zeros=True)


# ====================================================================== LL combine
def low_latency_combine(y: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array | None,
                        handle: LowLatencyHandle, *, config: EpConfig) -> jax.Array:
  """Returns each expert row to its source and reduces with the top-k weights.

  Args:
    y: [E_local, R*T_ll, H] bfloat16 (float16/float32 with the portable backend):
      expert outputs in the row order of the matching low_latency_dispatch.
    topk_idx: the [T_local, K] indices given to that dispatch.
    topk_weights: float [T_local, K] (used as float32); None when the weights
      were given to the dispatch instead (then they are applied on the expert
      side, below).
    handle: LowLatencyDispatchResult.handle.
    config: the EpConfig given to initialize().
  Returns:
    [T_local, H] of y.dtype, accumulated in float32. With topk_weights here:
    out[t] = sum over valid k, in k order, of w[t, k] * y_{rank of e_k}[e_k
    local, row of (t, e_k)]. With the weights at the dispatch: each rank r
    holding experts of t returns one row, p_r[t] = the sum over t's rows on r,
    in ascending local expert, of weight * row in float32, rounded once to
    y.dtype; out[t] = the float32 sum of p_r[t] in rank order.
  """
  if _other_axes.other_axes():
    return _other_axes.per_group(low_latency_combine, y, topk_idx, topk_weights, handle,
                                 config=config)
  op = "low_latency_combine"
  state, num_ranks = _prepare(op, config)
  _check_handle(handle, LowLatencyHandle, config, op)
  experts_per_rank = config.experts_per_rank(num_ranks)
  rows = num_ranks * config.ll_max_tokens
  if y.shape != (experts_per_rank, rows, config.hidden):
    raise EpConfigError(f"jax_ep.{op}: y must be [{experts_per_rank}, {rows}, {config.hidden}] "
                        f"(E_local, R*T_ll, H), got {y.shape}")
  if not any(y.dtype == jnp.dtype(d) for d in _validate.ROW_DTYPES):
    raise EpConfigError(f"jax_ep.{op}: y dtype {y.dtype} is not supported; use bfloat16, "
                        "float16 or float32")
  if topk_idx.ndim != 2:
    raise EpConfigError(f"jax_ep.{op}: topk_idx must be [tokens, {config.num_topk}], "
                        f"got {topk_idx.shape}")
  num_tokens = topk_idx.shape[0]
  if num_tokens != handle.num_tokens:
    raise EpConfigError(f"jax_ep.{op}: topk_idx has {num_tokens} tokens but the dispatch had "
                        f"{handle.num_tokens}")
  idx = _validate.topk_indices(topk_idx, num_tokens, config, op)
  static = _Static(config=config, backend=state.backend)
  if _presummed(handle, topk_weights, op):
    y, idx = _varying(config, y, idx)
    return _ll_combine_presummed(static, y, idx, handle)
  weights = _validate.topk_weights(topk_weights, num_tokens, config, op)
  y, idx, weights = _varying(config, y, idx, weights)
  return _ll_combine(static, y, idx, weights, handle)


def _presummed(handle: LowLatencyHandle, topk_weights, op: str) -> bool:
  """Whether the combine applies the dispatch's weights on the expert side;
  the weights live in one place, the dispatch's or the combine's."""
  if handle.row_weights is None and topk_weights is None:
    raise EpConfigError(f"jax_ep.{op}: topk_weights is None but the dispatch got no "
                        "topk_weights either; pass them to one of the two")
  if handle.row_weights is not None and topk_weights is not None:
    raise EpConfigError(f"jax_ep.{op}: the dispatch was given topk_weights and applies them "
                        "on the expert side; pass topk_weights=None here (or give them here "
                        "and not to the dispatch)")
  return handle.row_weights is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine(static: _Static, y, idx, weights, handle):
  return static.backend.ll_combine(y, idx, weights, handle)


def _ll_combine_fwd(static, y, idx, weights, handle):
  args = _primal((y, idx, weights, handle))
  return _ll_combine(static, *args), args


def _ll_combine_bwd(static, residuals, ct):
  y, idx, weights, handle = residuals
  if _is_zero(ct):
    return None, None, None, None
  backend = static.backend
  # Row (t, e) of the cotangent: ct[t] moved exactly like the forward dispatch
  # moved x[t], with the sum of w over the k choosing e beside it (one dispatch).
  ct_rows, row_weight = backend.ll_dispatch_weighted(ct, idx, weights, static.config,
                                                     handle.live)
  ct_rows_f32 = _masked_rows(ct_rows, handle).astype(jnp.float32)
  grad_y = (ct_rows_f32 * row_weight[..., None]).astype(y.dtype)
  row_dot = jnp.sum(ct_rows_f32 * _masked_rows(y, handle).astype(jnp.float32), axis=-1)
  grad_weights = backend.ll_rows_to_pairs(row_dot, idx, handle)
  return grad_y, None, grad_weights, None


_ll_combine.defvjp(_ll_combine_fwd, _ll_combine_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ll_combine_presummed(static: _Static, y, idx, handle):
  return static.backend.ll_combine_presummed(y, idx, handle)


def _ll_combine_presummed_fwd(static, y, idx, handle):
  args = _primal((y, idx, handle))
  return _ll_combine_presummed(static, *args), args


def _ll_combine_presummed_bwd(static, residuals, ct):
  # out[t] = sum_r round(sum_e w_(t,e) y_(t,e)) with the roundings taken as
  # exact: d/dy at row (t, e) is w ct[t], d/dw the dot of ct[t] with that row.
  # ct[t] reaches the rows by a dispatch along the same routing.
  y, idx, handle = residuals
  if _is_zero(ct):
    return None, None, None
  ct_rows = static.backend.ll_dispatch(ct, idx, static.config, False, handle.live).x
  ct_rows_f32 = _masked_rows(ct_rows, handle).astype(jnp.float32)
  grad_y = (ct_rows_f32 * handle.row_weights[..., None]).astype(y.dtype)
  grad_row_weights = jnp.sum(ct_rows_f32 * _masked_rows(y, handle).astype(jnp.float32), axis=-1)
  grad_handle = dataclasses.replace(handle, recv_src=None, count=None,
                                    row_weights=grad_row_weights)
  return grad_y, None, grad_handle


_ll_combine_presummed.defvjp(_ll_combine_presummed_fwd, _ll_combine_presummed_bwd,
                             symbolic_zeros=True)


