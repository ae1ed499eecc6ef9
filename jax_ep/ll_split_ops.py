"""The low-latency ops split in send and recv halves, for overlap. Shapes and
conventions: jax_ep/ops.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jax_ep import _other_axes
from jax_ep import _validate
from jax_ep._op_support import _check_handle, _prepare, _varying
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.types import LowLatencyDispatchResult, LowLatencyHandle, LowLatencySent
from jax_ep.ll_ops import _presummed


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
