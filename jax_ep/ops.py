"""The public ops: dispatch/combine (high-throughput) and their low-latency twins.

Every op is called inside ``jax.shard_map`` over ``config.axis_name`` with
per-shard arrays, after ``jax_ep.initialize(config, mesh)``. Shapes: R ranks,
T = max_tokens_per_rank (T_ll = low_latency_max_tokens_per_rank for the LL ops),
T_local <= T tokens on this rank, K = num_topk,
E experts, E_local = E / R, H = hidden, C = HT row capacity (R * T by default).

T_local = 0 is allowed: results keep their static shapes, with nothing
received (dispatch: C padding rows, num_tokens 0; the LL dispatch: count 0) and
[0, H] back from the combines. A rank with no tokens while others have some
passes its tokens with topk_idx -1 (per-shard shapes are equal in shard_map).

Top-k ids: pass int32. int64 ids need ``jax_enable_x64``: without it JAX
truncates int64 arrays to int32 when they enter jit or shard_map, before
jax_ep sees them, so 2**32 + 3 becomes expert 3 and is not counted in
``num_invalid``. Where an int64 array still reaches an op with x64 off (a
concrete array closed over by the traced function, or an int64 tracer), the op
raises EpConfigError if a value does not fit int32.

Autodiff (``jax.custom_vjp``): dispatch's backward is a combine of the
cotangent along the same layout, combine's backward a dispatch along the cached
layout; the LL ops likewise, including the gradient of ``topk_weights``.
Forward-mode differentiation is not supported (JAX raises its custom_vjp error).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jax_ep import _other_axes
from jax_ep import _validate
from jax_ep import expert_major
from jax_ep import local_ops
from jax_ep import runtime
from jax_ep._vma import match_vma
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle,
                          LowLatencyDispatchResult, LowLatencyHandle, LowLatencySent)


def _primal(tree: Any) -> Any:
  """Unwraps the CustomVJPPrimal leaves a symbolic-zeros fwd rule receives."""
  return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _is_zero(ct: Any) -> bool:
  return ct is None or isinstance(ct, SymbolicZero)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static (hashable) arguments of one op call: what the runtime state said
  when it was traced (config, backend, live ranks) and the call's options."""

  config: EpConfig
  backend: Any
  capacity: int = 0
  fp8: bool = False
  live: tuple[bool, ...] = ()
  alignment: int = 1


def _prepare(op: str, config: EpConfig,
             every_rank: bool = False) -> tuple[runtime.RuntimeState, int]:
  """The runtime state, read once for this trace, and R (checked against the mesh)."""
  state = runtime.require(config, op, every_rank=every_rank)
  return state, _validate.axis_size(config, state, op)


def _varying(config: EpConfig, *arrays: jax.Array) -> list[jax.Array]:
  return match_vma(*arrays, extra_axes=config.axis_names)


# ====================================================================== layout
def get_dispatch_layout(topk_idx: jax.Array, *, config: EpConfig):
  """Counts of this rank's routing, as a dispatch would send it.

  Args:
    topk_idx: int32 [T_local, K] in [-1, E); -1 = no expert (int64 with
      jax_enable_x64, see the module docstring).
    config: the EpConfig given to initialize().
  Returns:
    (tokens_per_rank int32[R], tokens_per_expert int32[E], is_token_in_rank
    bool[T_local, R]); a token counts once per rank and once per expert.
  """
  if _other_axes.other_axes():
    return _other_axes.per_group(get_dispatch_layout, topk_idx, config=config)
  state, _ = _prepare("get_dispatch_layout", config)
  idx = _validate.topk_indices(topk_idx, topk_idx.shape[0] if topk_idx.ndim == 2 else -1,
                               config, "get_dispatch_layout")
  (idx,) = _varying(config, idx)
  layout = state.backend.layout(idx, config)
  return layout.tokens_per_rank, layout.tokens_per_expert, layout.is_token_in_rank


# ====================================================================== HT dispatch
def dispatch(x, topk_idx: jax.Array, topk_weights: jax.Array, *, config: EpConfig,
             capacity: int | None = None, layout: str = "token_major",
             expert_alignment: int = 1) -> DispatchResult:
  """Sends each token once to every rank holding one of its top-k experts.

  With ``layout="token_major"`` (the default) each received token is one row;
  with ``layout="expert_major"`` each received (token, local expert) pair is
  one row, grouped by local expert and aligned for a grouped matmul
  (``jax.lax.ragged_dot(d.x, w, d.group_sizes)``); see DispatchResult.

  Args:
    x: [T_local, H] bfloat16/float16/float32 rows, or a pair
      ``(float8_e4m3fn[T_local, H], scales[T_local, H/128])`` (float32 or
      float8_e8m0fnu scales, see jax_ep.fp8.quantize) for an FP8 dispatch.
    topk_idx: int32 [T_local, K] in [-1, E); -1 = no expert. Other values are
      treated as -1 and counted in ``num_invalid`` (int64 with jax_enable_x64,
      see the module docstring).
    topk_weights: float [T_local, K] (used as float32).
    config: the EpConfig given to initialize().
    capacity: rows of the result. Token-major: default R * T; tokens past it,
      in (source rank, source token) order, are dropped and counted in
      ``num_dropped``. Expert-major: M, a multiple of expert_alignment, default
      (and at most) R*T*min(K, E_local) + E_local*(A-1) rounded up to A; pairs
      whose row would be past it (the last experts' last rows) are dropped and
      counted in ``num_dropped``.
    layout: "token_major" or "expert_major".
    expert_alignment: A >= 1 (expert-major only): every group's row count
      (``group_sizes``) is a multiple of A, e.g. 128 for grouped-GEMM tiles.
  Returns:
    DispatchResult (see jax_ep.types).
  """
  if _other_axes.other_axes():
    return _other_axes.per_group(dispatch, x, topk_idx, topk_weights, config=config,
                                 capacity=capacity, layout=layout,
                                 expert_alignment=expert_alignment)
  op = "dispatch"
  state, num_ranks = _prepare(op, config, every_rank=True)
  alignment = _validate.expert_alignment(layout, expert_alignment, op)
  is_fp8 = isinstance(x, (tuple, list))
  if is_fp8:
    num_tokens = _validate.fp8_pair(x, config, op)
    payloads = tuple(x)
  else:
    num_tokens = _validate.tokens(x, config, op)
    payloads = (x,)
  idx = _validate.topk_indices(topk_idx, num_tokens, config, op)
  weights = _validate.topk_weights(topk_weights, num_tokens, config, op)
  if layout == "expert_major":
    rows = _validate.pair_rows(capacity, alignment, config, num_ranks, op)
    static = _Static(config=config, backend=state.backend, capacity=rows, fp8=is_fp8,
                     alignment=alignment)
    *payloads, idx, weights = _varying(config, *payloads, idx, weights)
    return _ht_dispatch_expert_major(static, tuple(payloads), idx, weights)
  static = _Static(config=config, backend=state.backend,
                   capacity=_validate.capacity(capacity, config, num_ranks, op), fp8=is_fp8)
  *payloads, idx, weights = _varying(config, *payloads, idx, weights)
  return _ht_dispatch(static, tuple(payloads), idx, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ht_dispatch(static: _Static, payloads, idx, weights) -> DispatchResult:
  return static.backend.ht_dispatch(payloads, idx, weights, static.config, static.capacity)


def _ht_dispatch_fwd(static, payloads, idx, weights):
  result = _ht_dispatch(static, *_primal((payloads, idx, weights)))
  return result, (result.handle, result.topk_idx)


def _ht_dispatch_bwd(static, residuals, ct: DispatchResult):
  handle, out_idx = residuals
  backend = static.backend
  _no_fp8_row_grads(static, ct)
  if static.fp8:
    grad_payloads = (None, None)
  else:
    grad_payloads = (None,) if _is_zero(ct.x) else (backend.ht_combine(ct.x, handle),)
  grad_weights = None
  if not _is_zero(ct.topk_weights):
    kept = jnp.where(out_idx >= 0, ct.topk_weights, 0.0)
    grad_weights = backend.ht_combine(kept, handle)
  return grad_payloads, None, grad_weights


_ht_dispatch.defvjp(_ht_dispatch_fwd, _ht_dispatch_bwd, symbolic_zeros=True)


def _no_fp8_row_grads(static: _Static, ct: DispatchResult) -> None:
  if static.fp8 and not (_is_zero(ct.x) and _is_zero(ct.scales)):
    raise EpError(
        "jax_ep.dispatch: gradients through an FP8 dispatch's rows are not supported; "
        "dispatch bfloat16 rows where you differentiate (gradients of topk_weights are)")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ht_dispatch_expert_major(static: _Static, payloads, idx, weights) -> DispatchResult:
  return static.backend.ht_dispatch_expert_major(payloads, idx, weights, static.config,
                                                 static.capacity, static.alignment)


def _ht_dispatch_expert_major_fwd(static, payloads, idx, weights):
  result = _ht_dispatch_expert_major(static, *_primal((payloads, idx, weights)))
  return result, result.handle


def _ht_dispatch_expert_major_bwd(static, handle, ct: DispatchResult):
  # x[t] went to every pair row of t: its gradient is the combine of ct.x. A
  # pair's weight is the sum of its token's weights for that expert, so each
  # of those weights gets the pair's cotangent; the other ranks add zeros.
  backend = static.backend
  _no_fp8_row_grads(static, ct)
  if static.fp8:
    grad_payloads = (None, None)
  else:
    grad_payloads = (None,) if _is_zero(ct.x) else (
        backend.ht_combine_expert_major(ct.x, handle),)
  grad_weights = None
  if not _is_zero(ct.topk_weights):
    per_slot = expert_major.slot_values(ct.topk_weights.astype(jnp.float32), handle.slot_row)
    grad_weights = backend.ht_combine(per_slot, handle.token_major)
  return grad_payloads, None, grad_weights


_ht_dispatch_expert_major.defvjp(_ht_dispatch_expert_major_fwd, _ht_dispatch_expert_major_bwd,
                                 symbolic_zeros=True)


# ====================================================================== HT combine
def combine(y: jax.Array, handle: DispatchHandle | ExpertMajorHandle, *,
            config: EpConfig) -> jax.Array:
  """Returns each dispatched row to its source and sums the copies of each token.

  Args:
    y: bfloat16/float16/float32 rows computed from the dispatch's rows, weights
      already applied by the caller (e.g. ``y * d.topk_weights[:, None]`` for
      the expert-major layout); padding rows are ignored. Token-major
      (a DispatchHandle): [C, H], row i from dispatch row i. Expert-major (an
      ExpertMajorHandle): [M, H], one row per pair.
    handle: DispatchResult.handle of the matching dispatch.
    config: the EpConfig given to initialize().
  Returns:
    [T_local, H] of y.dtype, accumulated in float32; zeros for tokens sent
    nowhere. Token-major: out[t] = sum over ranks r that received token t of
    y_r[row of t on r], in rank order. Expert-major: out[t] = sum over ranks r,
    in rank order, of (sum over t's pairs on r, in ascending local expert, of
    y_r[row of the pair]).
  """
  if _other_axes.other_axes():
    return _other_axes.per_group(combine, y, handle, config=config)
  op = "combine"
  state, _ = _prepare(op, config, every_rank=True)
  _check_handle(handle, (DispatchHandle, ExpertMajorHandle), config, op)
  expert_major_layout = isinstance(handle, ExpertMajorHandle)
  rows = (handle.pair_src if expert_major_layout else handle.recv_src).shape[0]
  if y.ndim != 2 or y.shape != (rows, config.hidden):
    raise EpConfigError(
        f"jax_ep.{op}: y must be [{rows}, {config.hidden}] (the dispatch's rows), "
        f"got {y.shape}")
  if not any(y.dtype == jnp.dtype(d) for d in _validate.ROW_DTYPES):
    raise EpConfigError(f"jax_ep.{op}: y dtype {y.dtype} is not supported; use bfloat16, "
                        "float16 or float32")
  (y,) = _varying(config, y)
  static = _Static(config=config, backend=state.backend)
  if expert_major_layout:
    return _ht_combine_expert_major(static, y, handle)
  return _ht_combine(static, y, handle)


def _check_handle(handle, cls, config: EpConfig, op: str) -> None:
  classes = cls if isinstance(cls, tuple) else (cls,)
  if not isinstance(handle, classes):
    raise EpConfigError(f"jax_ep.{op}: handle must be a "
                        f"{' or '.join(c.__name__ for c in classes)}, got "
                        f"{type(handle).__name__}")
  if handle.config != config:
    raise EpConfigError(f"jax_ep.{op}: the handle comes from a dispatch with {handle.config}, "
                        f"not {config}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ht_combine(static: _Static, y, handle):
  return static.backend.ht_combine(y, handle)


def _ht_combine_fwd(static, y, handle):
  y, handle = _primal((y, handle))
  return _ht_combine(static, y, handle), handle


def _ht_combine_bwd(static, handle, ct):
  if _is_zero(ct):
    return None, None
  return static.backend.ht_dispatch_cached(ct, handle), None


_ht_combine.defvjp(_ht_combine_fwd, _ht_combine_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ht_combine_expert_major(static: _Static, y, handle):
  return static.backend.ht_combine_expert_major(y, handle)


def _ht_combine_expert_major_fwd(static, y, handle):
  y, handle = _primal((y, handle))
  return _ht_combine_expert_major(static, y, handle), handle


def _ht_combine_expert_major_bwd(static, handle, ct):
  if _is_zero(ct):
    return None, None
  return static.backend.ht_dispatch_cached_expert_major(ct, handle), None


_ht_combine_expert_major.defvjp(_ht_combine_expert_major_fwd, _ht_combine_expert_major_bwd,
                                symbolic_zeros=True)


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


# ====================================================================== LL, split
# The one-call LL ops split in two so XLA can schedule other work while the rows
# travel. A send must be followed by its recv before the next send of the same
# kind (the GPU records a protocol fault otherwise). Not differentiable.
@dataclasses.dataclass(frozen=True)
class _Pending:
  """What a split LL send hands to its recv (a registered pytree)."""

  sent: LowLatencySent  # which path the send took, and its arrays
  config: EpConfig
  backend: Any
  use_fp8: bool
  num_tokens: int
  live: tuple[bool, ...] = ()
  handle: Any = None
  presummed: bool = False  # a combine applying the dispatch's weights on the expert side


jax.tree_util.register_dataclass(_Pending, data_fields=["sent", "handle"],
                                 meta_fields=["config", "backend", "use_fp8", "num_tokens",
                                              "live", "presummed"])
LowLatencyPending = _Pending


def _require_every_axis_manual(op: str) -> None:
  """The split ops run only inside a shard_map over every mesh axis: their
  pending state holds per-group scalars (the ticket) that do not stack."""
  others = _other_axes.other_axes()
  if others:
    raise EpConfigError(
        f"jax_ep.{op}: the split low-latency ops need a shard_map over every mesh axis, but "
        f"{others} are not manual here (axis_names= a subset); use the one-call op, or "
        "shard_map over the whole mesh (each coordinate of the other axes is its own EP group "
        "either way)")


def _no_grad(fn, name: str):
  """fn with a custom_vjp whose backward raises a clear error."""
  wrapped = jax.custom_vjp(fn)

  def bwd(*_):
    raise EpError(f"jax_ep.{name} is not differentiable; use the one-call "
                  f"{name.rsplit('_', 1)[0]} op where you need gradients")

  wrapped.defvjp(lambda *a: (fn(*a), None), bwd)
  return wrapped


def low_latency_dispatch_send(x: jax.Array, topk_idx: jax.Array, *, config: EpConfig,
                              use_fp8: bool = False,
                              topk_weights: jax.Array | None = None) -> LowLatencyPending:
  """First half of low_latency_dispatch: starts sending; returns a pending dispatch.

  Same arguments as low_latency_dispatch. Pass the result to
  low_latency_dispatch_recv; compute in between overlaps with the transfer.
  """
  op = "low_latency_dispatch_send"
  _require_every_axis_manual(op)
  state, _ = _prepare(op, config)
  num_tokens = _validate.tokens(x, config, op, low_latency=True)
  idx = _validate.topk_indices(topk_idx, num_tokens, config, op)
  if use_fp8 and config.hidden % 128:
    raise EpConfigError(f"jax_ep.{op}: use_fp8 needs hidden to be a multiple of 128")
  backend = state.backend
  live = state.live_ranks()
  if topk_weights is None:
    x, idx = _varying(config, x, idx)
    sent = _no_grad(lambda x, i: backend.ll_dispatch_send(x, i, config, bool(use_fp8), live),
                    op)(x, idx)
  else:
    weights = _validate.topk_weights(topk_weights, num_tokens, config, op)
    x, idx, weights = _varying(config, x, idx, weights)
    sent = _no_grad(lambda x, i, w: backend.ll_dispatch_send(x, i, config, bool(use_fp8), live,
                                                             topk_weights=w), op)(x, idx, weights)
  return _Pending(sent=sent, config=config, backend=backend, use_fp8=bool(use_fp8),
                  num_tokens=num_tokens, live=live)


def low_latency_dispatch_recv(pending: LowLatencyPending, *,
                              config: EpConfig) -> LowLatencyDispatchResult:
  """Second half of low_latency_dispatch: waits for the rows; same result."""
  op = "low_latency_dispatch_recv"
  _require_every_axis_manual(op)
  _prepare(op, config)
  if not isinstance(pending, _Pending) or pending.handle is not None or pending.config != config:
    raise EpConfigError(f"jax_ep.{op}: pass the result of low_latency_dispatch_send with the "
                        "same config")
  fn = lambda s: pending.backend.ll_dispatch_recv(s, config, pending.use_fp8,  # noqa: E731
                                                  pending.num_tokens, pending.live)
  return _no_grad(fn, op)(pending.sent)


def low_latency_combine_send(y: jax.Array, handle: LowLatencyHandle, *,
                             config: EpConfig) -> LowLatencyPending:
  """First half of low_latency_combine: starts returning the rows."""
  op = "low_latency_combine_send"
  _require_every_axis_manual(op)
  state, num_ranks = _prepare(op, config)
  _check_handle(handle, LowLatencyHandle, config, op)
  rows = num_ranks * config.ll_max_tokens
  if y.shape != (config.experts_per_rank(num_ranks), rows, config.hidden):
    raise EpConfigError(f"jax_ep.{op}: y must be [E_local, R*T_ll, H], got {y.shape}")
  (y,) = _varying(config, y)
  backend = state.backend
  presummed = handle.row_weights is not None  # the dispatch's weights, applied here
  send = backend.ll_combine_presummed_send if presummed else backend.ll_combine_send
  sent = _no_grad(send, op)(y, handle)
  return _Pending(sent=sent, config=config, backend=backend, use_fp8=False,
                  num_tokens=handle.num_tokens, live=handle.live, handle=handle,
                  presummed=presummed)


def low_latency_combine_recv(pending: LowLatencyPending, topk_idx: jax.Array,
                             topk_weights: jax.Array | None, *, config: EpConfig) -> jax.Array:
  """Second half of low_latency_combine: waits and reduces; same result
  (topk_weights None when the dispatch had them)."""
  op = "low_latency_combine_recv"
  _require_every_axis_manual(op)
  _prepare(op, config)
  if not isinstance(pending, _Pending) or pending.handle is None or pending.config != config:
    raise EpConfigError(f"jax_ep.{op}: pass the result of low_latency_combine_send with the "
                        "same config")
  num_tokens = pending.num_tokens
  idx = _validate.topk_indices(topk_idx, num_tokens, config, op)
  if _presummed(pending.handle, topk_weights, op):
    (idx,) = _varying(config, idx)
    fn = lambda s, i, h: pending.backend.ll_combine_presummed_recv(s, i, h)  # noqa: E731
    return _no_grad(fn, op)(pending.sent, idx, pending.handle)
  weights = _validate.topk_weights(topk_weights, num_tokens, config, op)
  idx, weights = _varying(config, idx, weights)
  fn = lambda s, i, w, h: pending.backend.ll_combine_recv(s, i, w, h)  # noqa: E731
  return _no_grad(fn, op)(pending.sent, idx, weights, pending.handle)
