"""The high-throughput ops: get_dispatch_layout, dispatch and combine (token-major and
expert-major), with their custom_vjps. Shapes and conventions: jax_ep/ops.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_ep import _other_axes
from jax_ep import _validate
from jax_ep._op_support import _Static, _check_handle, _is_zero, _prepare, _primal, _varying
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.types import (DispatchHandle, DispatchInput, DispatchLayoutCounts, DispatchResult,
                          ExpertMajorHandle)


# ====================================================================== layout
def get_dispatch_layout(topk_idx: jax.Array, *, config: EpConfig) -> DispatchLayoutCounts:
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
def dispatch(x: DispatchInput, topk_idx: jax.Array, topk_weights: jax.Array, *, config: EpConfig,
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
      float8_e8m0fnu scales, see jax_ep.fp8.quantize) for an FP8 dispatch
      (jax_ep.types.DispatchInput).
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
    DispatchResult (see jax_ep.types). Its ``topk_weights`` has the layout's
    shape: float32[C, K] token-major (each received row's K weights, 0 where
    the expert lives elsewhere), float32[M] expert-major (one per pair row).
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
    per_slot = backend.ht_slot_values(ct.topk_weights.astype(jnp.float32), handle)
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
      already applied by the caller; padding rows are ignored. Token-major
      (a DispatchHandle): [C, H], row i from dispatch row i, with
      d.topk_weights float32[C, K] (each local expert's output weighted by
      its k entry, summed into the row). Expert-major (an
      ExpertMajorHandle): [M, H], one row per pair, with d.topk_weights
      float32[M] (``y * d.topk_weights[:, None]``).
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
  _validate.combine_rows(y, rows, expert_major_layout, config, op)
  if not any(y.dtype == jnp.dtype(d) for d in _validate.ROW_DTYPES):
    raise EpConfigError(f"jax_ep.{op}: y dtype {y.dtype} is not supported; use bfloat16, "
                        "float16 or float32")
  (y,) = _varying(config, y)
  static = _Static(config=config, backend=state.backend)
  if expert_major_layout:
    return _ht_combine_expert_major(static, y, handle)
  return _ht_combine(static, y, handle)



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


