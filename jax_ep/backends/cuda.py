"""The CUDA backend: jax_ep's kernels as XLA FFI custom calls.

Implements the backend interface (backends/base.py) by composing the portable
backend (backends/xla.py): row layouts and handles are the same, so a call
the kernels cannot run (cuda_checks.py says why) takes the portable
implementation instead (on the GPU, through XLA collectives, several times
slower). CudaBackend._kernel_or_portable is the one place that picks the
path; ``EpConfig.fallback`` decides whether the portable one is announced
once per (op, reason) ("warn", the default), refused at trace time ("error")
or silent ("allow"); see ``portable_fallback``. Every custom call is marked
side-effecting (all ranks must issue them in the same order), carries the
traced config as one struct attribute (``config``), and its results vary over
the EP axis like its inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import fp8 as fp8_lib
from jax_ep import _extension, fallbacks
from jax_ep._vma import match_vma, result_type
from jax_ep.backends.base import Backend
from jax_ep.backends.cuda_checks import (WhyNot, cotangent_unsupported,
                                         ht_combine_rows_unsupported, ht_payload_unsupported,
                                         ht_unsupported, ll_combine_rows_unsupported,
                                         ll_unsupported, require_low_latency)
from jax_ep.backends.cuda_checks import ll_routing_fits  # noqa: F401 (named here in docs, tests)
from jax_ep.backends.xla import XlaBackend
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError
from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle, Layout,
                          LowLatencyDispatchResult, LowLatencyHandle, LowLatencySent)

I32 = jnp.int32
F32 = jnp.float32
T = TypeVar("T")


def config_attr(config: EpConfig, num_ranks: int) -> dict:
  """The config struct attribute every jax_ep CUDA custom call carries
  (xla_ffi/cuda/handler_common.h CallConfig; the handler checks it against
  the runtime)."""
  return dict(num_ranks=np.int64(num_ranks), num_experts=np.int64(config.num_experts),
              hidden=np.int64(config.hidden), max_tokens=np.int64(config.max_tokens_per_rank),
              ll_max_tokens=np.int64(config.ll_max_tokens), num_topk=np.int64(config.num_topk))


def _status_token() -> jax.Array:
  """The status check's result, s32[]: every jax_ep call's last operand.

  One side-effect-free custom call on one constant, the same everywhere, so
  XLA's CSE keeps one per computation; its prepare stage fails an execution
  that follows a recorded fault, inside command buffers too
  (xla_ffi/cuda/handler_common.h). On every call instead, it would cost each
  call host time before the executable's launch."""
  return jax.ffi.ffi_call(_extension.cuda_target("status_check"),
                          jax.ShapeDtypeStruct((), I32))(jnp.zeros((), I32))


def _call(op: str, results, *args, **attrs):
  """The custom call of CUDA handler ``op`` (xla_ffi/exports.h names its target)."""
  args = match_vma(*args, _status_token())
  return jax.ffi.ffi_call(_extension.cuda_target(op), results, has_side_effect=True)(*args,
                                                                                       **attrs)


# ---------------------------------------------------------------- fallbacks
def portable_fallback(op: str, config: EpConfig, reason: str, fix: str) -> None:
  """Called when `op` is about to take the portable path for `reason` (at trace
  time): per ``config.fallback``, logs a warning the first time for this (op,
  reason), raises EpConfigError, or does nothing (jax_ep/fallbacks.py)."""
  message = (f"jax_ep.{op}: the CUDA kernels cannot run this call ({reason}), so it takes the "
             f"portable path: an XLA all_to_all plus packing, several times slower. To stay on "
             f"the kernels: {fix}.")
  fallbacks.slower_path(config.fallback, ("exchange", op, reason), message, "EpConfig",
                        "runs it on the portable path, with a warning")


def _ll_ranks(op: str, config: EpConfig) -> int:
  """The EP size (inside shard_map) of LL op ``op``; raises first when the
  config allocated no LL buffers, whichever path the call would take."""
  require_low_latency(config, op)
  return jax.lax.axis_size(config.axis_name)


def cached_routing(send_row: jax.Array, config: EpConfig) -> jax.Array:
  """int32 [T, K]: for token t, the first expert of each rank r where
  send_row[t, r] >= 0, in rank order, then -1. A dispatch with it places rows
  where the dispatch that made send_row did (CudaBackend.ht_dispatch_cached).

  A token is kept on at most K ranks (each needs one of its K experts), so the
  ranks always fit the K entries, whatever R is.
  """
  num_tokens, num_ranks = send_row.shape
  first_expert = jnp.arange(num_ranks, dtype=I32) * config.experts_per_rank(num_ranks)
  kept = send_row >= 0
  width = min(config.num_topk, num_ranks)
  ranks = jnp.argsort(~kept, axis=1, stable=True)[:, :width]  # kept ranks first, in order
  routing = jnp.where(jnp.take_along_axis(kept, ranks, axis=1), first_expert[ranks], -1)
  return jnp.pad(routing, ((0, 0), (0, config.num_topk - width)), constant_values=-1)


def _pad_columns(rows: jax.Array) -> jax.Array:
  """[N, W] -> [N, W'] with W' * itemsize a multiple of 16 bytes (zero columns)."""
  per_vector = 16 // rows.dtype.itemsize
  missing = -rows.shape[1] % per_vector
  return jnp.pad(rows, ((0, 0), (0, missing))) if missing else rows


def _pad_scale_words(scales: jax.Array) -> jax.Array:
  """[N, G] -> [N, G'] with G' * itemsize a multiple of 4 bytes: the HT dispatch
  kernel moves scale rows as 4-byte words, so float8_e8m0fnu scales of a hidden
  size that is not a multiple of 512 (G not a multiple of 4) travel with zero
  bytes appended (cut off again after the kernel)."""
  if scales.dtype.itemsize != 1 or scales.shape[1] % 4 == 0:  # float32: whole words
    return scales
  raw = jax.lax.bitcast_convert_type(scales, jnp.uint8)
  padded = jnp.pad(raw, ((0, 0), (0, -scales.shape[1] % 4)))
  return jax.lax.bitcast_convert_type(padded, scales.dtype)


class CudaBackend:
  """The kernels where they apply; the portable backend, announced, elsewhere.

  Composes a portable backend (``portable``, XlaBackend unless given) rather
  than extending it: the kernels produce and read the same rows and handles,
  so each call can take either path. Every op with a kernel goes through
  ``_kernel_or_portable``, the one place that picks the path and announces the
  portable one; ``layout`` has no kernel and is the portable backend's.
  """

  name = "cuda"

  def __init__(self, portable: Backend | None = None) -> None:
    self.portable: Backend = portable if portable is not None else XlaBackend()

  def _kernel_or_portable(self, op: str, config: EpConfig, why_not: WhyNot,
                          kernel: Callable[[], T], portable: Callable[[], T], *,
                          announce: bool = True) -> T:
    """``kernel()`` when ``why_not`` is None, else ``portable()`` (at trace time).

    ``why_not``: (reason, fix), why the kernels cannot run this call of ``op``
    (cuda_checks.py). The portable path is announced through portable_fallback
    (per ``config.fallback``: a warning once per (op, reason), an error, or
    nothing), except with ``announce=False``: where it was announced already
    (the recv half of a split op, after its send) or is announced by the op
    that takes the result (ht_slot_values, before the combine).
    """
    if why_not is None:
      return kernel()
    if announce:
      portable_fallback(op, config, *why_not)
    return portable()

  # ---------------------------------------------------------------- layout
  def layout(self, topk_idx: jax.Array, config: EpConfig) -> Layout:
    """No kernel (XLA's fused jnp layout measured faster, docs/design.md): the
    portable backend's counts of topk_idx int32[T_local, K]."""
    return self.portable.layout(topk_idx, config)

  # ---------------------------------------------------------------- HT
  def ht_dispatch(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                  topk_weights: jax.Array, config: EpConfig, capacity: int) -> DispatchResult:
    """payloads (x [T_local, H],) or (x_fp8, scales), topk_idx int32[T_local, K],
    topk_weights f32[T_local, K] -> C = capacity rows on the dispatch kernel."""
    num_ranks = jax.lax.axis_size(config.axis_name)

    def kernel() -> DispatchResult:
      if config.debug_checks:
        self.layout(topk_idx, config)  # side effect: fails on every rank on a bad index
      return self._ht_dispatch_kernel(payloads, topk_idx, topk_weights, config, capacity,
                                      num_ranks)

    return self._kernel_or_portable(
        "dispatch", config,
        ht_unsupported(config, num_ranks) or ht_payload_unsupported(payloads, config), kernel,
        lambda: self.portable.ht_dispatch(payloads, topk_idx, topk_weights, config, capacity))

  def _ht_dispatch_kernel(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                          topk_weights: jax.Array, config: EpConfig, capacity: int,
                          num_ranks: int) -> DispatchResult:
    x = payloads[0]
    num_tokens = x.shape[0]
    scales = payloads[1] if len(payloads) == 2 else jnp.zeros((num_tokens, 0), F32)
    scale_columns = scales.shape[1]
    scales = _pad_scale_words(scales)
    k = config.num_topk
    results = (result_type((capacity, config.hidden), x.dtype, x),
               result_type((capacity,) + scales.shape[1:], scales.dtype, x),
               result_type((capacity, k), I32, x), result_type((capacity, k), F32, x),
               result_type((), I32, x),
               result_type((config.experts_per_rank(num_ranks),), I32, x),
               result_type((), I32, x), result_type((), I32, x),
               result_type((capacity,), I32, x), result_type((num_tokens, num_ranks), I32, x))
    (out_x, out_scales, out_idx, out_w, num_kept, tokens_per_expert, num_dropped, num_invalid,
     recv_src, send_row) = _call("ht_dispatch", results, x, scales, topk_idx,
                                 topk_weights, capacity=np.int64(capacity),
                                 config=config_attr(config, num_ranks))
    handle = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=num_kept,
                            config=config)
    out_scales = out_scales[:, :scale_columns]
    return DispatchResult(x=out_x, scales=out_scales if len(payloads) == 2 else None,
                          topk_idx=out_idx, topk_weights=out_w, num_tokens=num_kept,
                          tokens_per_expert=tokens_per_expert, num_dropped=num_dropped,
                          num_invalid=num_invalid, handle=handle)

  def ht_dispatch_cached(self, payload: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Combine's backward on the dispatch kernel: [T_local, H] rows along the
    handle's layout -> [C, H].

    The kernel is driven by cached_routing: token t to the first expert of
    each rank r where send_row[t, r] >= 0. Rows then land in the same
    (source rank, source token) order, so at the same rows: a row kept by the
    original dispatch has only kept rows before it (drops happen past the
    capacity, at the end of that order), so the prefix sums the kernel
    computes from the kept rows alone place it where it was
    (tests/cpu/test_ht.py checks this on the portable path). The synthetic
    routing is always valid, so debug_checks add nothing here.
    """
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    num_tokens = handle.send_row.shape[0]

    def kernel() -> jax.Array:
      routing = cached_routing(handle.send_row, config)
      weights = jnp.zeros((num_tokens, config.num_topk), F32)
      return self._ht_dispatch_kernel((payload,), routing, weights, config,
                                      handle.recv_src.shape[0], num_ranks).x

    return self._kernel_or_portable(
        "combine (backward)", config,
        cotangent_unsupported(payload, num_tokens, config, num_ranks), kernel,
        lambda: self.portable.ht_dispatch_cached(payload, handle))

  def ht_combine(self, rows: jax.Array, handle: DispatchHandle) -> jax.Array:
    """[C, W] rows (bf16/f16/f32; hidden rows, or e.g. the weights' [C, K]) back
    to their sources, summed in fp32 in rank order -> [T_local, W]."""
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)

    def kernel() -> jax.Array:
      width = rows.shape[1]
      padded = _pad_columns(rows)
      out = result_type((handle.send_row.shape[0], padded.shape[1]), rows.dtype, rows)
      summed = _call("ht_combine", out, padded, handle.recv_src, handle.send_row,
                     handle.num_tokens, capacity=np.int64(rows.shape[0]),
                     config=config_attr(config, num_ranks))
      return summed[:, :width] if padded.shape[1] != width else summed

    return self._kernel_or_portable(
        "combine", config, ht_combine_rows_unsupported(rows, config, num_ranks, "C"), kernel,
        lambda: self.portable.ht_combine(rows, handle))

  # ---------------------------------------------------------------- HT, expert-major
  # The kernels write and read the pair rows themselves (jax_ep/expert_major.py
  # states the row formula): the dispatch kernel places each (token, local
  # expert) pair straight into its row of [M, H] and returns the pair table
  # with the token-major staging layout (capacity R * T) underneath; the
  # combine kernel sums each token's pair rows per rank in float32, in
  # ascending local expert, and those partials in rank order. Same results
  # as the portable path (backends/xla.py), bit for bit.
  def ht_dispatch_expert_major(self, payloads: tuple[jax.Array, ...], topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, num_rows: int,
                               alignment: int) -> DispatchResult:
    """payloads as ht_dispatch's -> M = num_rows pair rows, groups aligned to A."""
    num_ranks = jax.lax.axis_size(config.axis_name)

    def kernel() -> DispatchResult:
      if config.debug_checks:
        self.layout(topk_idx, config)  # side effect: fails on every rank on a bad index
      return self._ht_dispatch_expert_major_kernel(payloads, topk_idx, topk_weights, config,
                                                   num_rows, alignment, num_ranks)

    return self._kernel_or_portable(
        "dispatch", config,
        ht_unsupported(config, num_ranks) or ht_payload_unsupported(payloads, config), kernel,
        lambda: self.portable.ht_dispatch_expert_major(payloads, topk_idx, topk_weights,
                                                       config, num_rows, alignment))

  def _ht_dispatch_expert_major_kernel(self, payloads: tuple[jax.Array, ...],
                                       topk_idx: jax.Array, topk_weights: jax.Array,
                                       config: EpConfig, num_rows: int, alignment: int,
                                       num_ranks: int) -> DispatchResult:
    x = payloads[0]
    num_tokens = x.shape[0]
    scales = payloads[1] if len(payloads) == 2 else jnp.zeros((num_tokens, 0), F32)
    scale_columns = scales.shape[1]
    scales = _pad_scale_words(scales)
    capacity = config.capacity(num_ranks)  # the token-major staging rows: nothing dropped
    k = config.num_topk
    experts_per_rank = config.experts_per_rank(num_ranks)
    results = (result_type((num_rows, config.hidden), x.dtype, x),
               result_type((num_rows,) + scales.shape[1:], scales.dtype, x),
               result_type((num_rows,), I32, x), result_type((num_rows,), F32, x),
               result_type((num_rows,), I32, x), result_type((), I32, x),
               result_type((experts_per_rank,), I32, x), result_type((experts_per_rank,), I32, x),
               result_type((), I32, x), result_type((), I32, x),
               result_type((capacity,), I32, x), result_type((num_tokens, num_ranks), I32, x),
               result_type((), I32, x),
               result_type((capacity, k), I32, x), result_type((capacity, k), I32, x))
    (out_x, out_scales, pair_expert, pair_weight, pair_src, num_pairs, tokens_per_expert,
     group_sizes, num_dropped, num_invalid, recv_src, send_row, num_kept, slot_row,
     rows_by_expert) = _call("ht_dispatch_expert_major", results, x, scales, topk_idx,
                             topk_weights, capacity=np.int64(capacity),
                             num_rows=np.int64(num_rows), alignment=np.int64(alignment),
                             config=config_attr(config, num_ranks))
    token_major = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=num_kept,
                                 config=config)
    handle = ExpertMajorHandle(token_major=token_major, pair_src=pair_src,
                               rows_by_expert=rows_by_expert, slot_row=slot_row,
                               topk_idx=topk_idx, num_tokens=num_pairs, alignment=alignment,
                               config=config)
    out_scales = out_scales[:, :scale_columns]
    return DispatchResult(x=out_x, scales=out_scales if len(payloads) == 2 else None,
                          topk_idx=pair_expert, topk_weights=pair_weight, num_tokens=num_pairs,
                          tokens_per_expert=tokens_per_expert, num_dropped=num_dropped,
                          num_invalid=num_invalid, handle=handle, group_sizes=group_sizes)

  def ht_dispatch_cached_expert_major(self, payload: jax.Array,
                                      handle: ExpertMajorHandle) -> jax.Array:
    """The expert-major combine's backward on the expert-major dispatch kernel:
    [T_local, H] rows -> [M, H], each at every pair row of its token.

    The kernel runs again on the forward's routing (handle.topk_idx, as the
    forward dispatch took it) with the same M and A, so every pair lands in
    the row it had: the rows depend on the routing alone (the expert_major.py
    formula), not on the weights, which are zeros here. debug_checks add
    nothing: the forward checked this routing."""
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    num_tokens = handle.topk_idx.shape[0]

    def kernel() -> jax.Array:
      weights = jnp.zeros((num_tokens, config.num_topk), F32)
      return self._ht_dispatch_expert_major_kernel(
          (payload,), handle.topk_idx, weights, config, handle.pair_src.shape[0],
          handle.alignment, num_ranks).x

    return self._kernel_or_portable(
        "combine (backward)", config,
        cotangent_unsupported(payload, num_tokens, config, num_ranks), kernel,
        lambda: self.portable.ht_dispatch_cached_expert_major(payload, handle))

  def ht_combine_expert_major(self, rows: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    """[M, W] pair rows (bf16/f16/f32; hidden rows, or any width) -> [T_local, W]."""
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)

    def kernel() -> jax.Array:
      token_major = handle.token_major
      width = rows.shape[1]
      padded = _pad_columns(rows)
      out = result_type((token_major.send_row.shape[0], padded.shape[1]), rows.dtype, rows)
      summed = _call("ht_combine_expert_major", out, padded, handle.rows_by_expert,
                     token_major.recv_src, token_major.send_row, token_major.num_tokens,
                     capacity=np.int64(token_major.recv_src.shape[0]),
                     config=config_attr(config, num_ranks))
      return summed[:, :width] if padded.shape[1] != width else summed

    return self._kernel_or_portable(
        "combine", config, ht_combine_rows_unsupported(rows, config, num_ranks, "M"), kernel,
        lambda: self.portable.ht_combine_expert_major(rows, handle))

  def ht_slot_values(self, values: jax.Array, handle: ExpertMajorHandle) -> jax.Array:
    """float32[M] -> float32[R*T, K] on a local kernel (no peer). Where the HT
    kernels cannot serve the config at all, the portable gather (also local;
    the combine that takes its result announces the portable path)."""
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)

    def kernel() -> jax.Array:
      out = result_type(handle.slot_row.shape, F32, values)
      return _call("ht_slot_values", out, values.astype(F32), handle.slot_row,
                   config=config_attr(config, num_ranks))

    return self._kernel_or_portable(
        "ht_slot_values", config, ht_unsupported(config, num_ranks), kernel,
        lambda: self.portable.ht_slot_values(values, handle), announce=False)

  # ---------------------------------------------------------------- LL
  # The kernels read the rank mask from device memory (cuda_runtime sets it);
  # `live` matters only to the portable path and the handles.
  def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig, use_fp8: bool,
                  live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    """x bf16[T_local, H] -> [E_local, R*T_ll, H] rows (FP8 with use_fp8)."""
    num_ranks = _ll_ranks("low_latency_dispatch", config)
    return self._kernel_or_portable(
        "low_latency_dispatch", config,
        ll_unsupported(x.dtype, x.shape[0], config, num_ranks, dispatch=True),
        lambda: self._ll_dispatch_kernel(x, topk_idx, None, config, use_fp8, num_ranks,
                                         live)[0],
        lambda: self.portable.ll_dispatch(x, topk_idx, config, use_fp8, live))

  def ll_dispatch_weighted(self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                           config: EpConfig,
                           live: tuple[bool, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """One kernel: each pair's weight travels in its header. The LL combine's
    backward: (rows [E_local, R*T_ll, H], row_weights f32[E_local, R*T_ll])."""
    num_ranks = _ll_ranks("low_latency_combine", config)

    def kernel() -> tuple[jax.Array, jax.Array]:
      result, row_weights = self._ll_dispatch_kernel(x, topk_idx, topk_weights.astype(F32),
                                                     config, False, num_ranks, live)
      return result.x, row_weights

    return self._kernel_or_portable(
        "low_latency_combine (backward)", config,
        ll_unsupported(x.dtype, x.shape[0], config, num_ranks, dispatch=True), kernel,
        lambda: self.portable.ll_dispatch_weighted(x, topk_idx, topk_weights, config, live))

  def ll_dispatch_with_weights(self, x: jax.Array, topk_idx: jax.Array,
                               topk_weights: jax.Array, config: EpConfig, use_fp8: bool,
                               live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    """One kernel: each pair's weight travels in its header (as for the LL
    combine's backward)."""
    num_ranks = _ll_ranks("low_latency_dispatch", config)

    def kernel() -> LowLatencyDispatchResult:
      result, row_weights = self._ll_dispatch_kernel(x, topk_idx, topk_weights.astype(F32),
                                                     config, use_fp8, num_ranks, live)
      return dataclasses.replace(
          result, weights=row_weights,
          handle=dataclasses.replace(result.handle, row_weights=row_weights))

    return self._kernel_or_portable(
        "low_latency_dispatch", config,
        ll_unsupported(x.dtype, x.shape[0], config, num_ranks, dispatch=True), kernel,
        lambda: self.portable.ll_dispatch_with_weights(x, topk_idx, topk_weights, config,
                                                       use_fp8, live))

  def ll_combine_presummed(self, rows: jax.Array, topk_idx: jax.Array,
                           handle: LowLatencyHandle) -> jax.Array:
    """One kernel (cuda/ll_presummed_kernels.cu): each rank returns one row per
    (token, rank), its rows' weights applied on the expert side."""
    config = handle.config
    num_ranks = _ll_ranks("low_latency_combine", config)

    def kernel() -> jax.Array:
      experts_per_rank = config.experts_per_rank(num_ranks)
      out = result_type((topk_idx.shape[0], config.hidden), jnp.bfloat16, topk_idx)
      no_pair_values = result_type((topk_idx.shape[0], 0), F32, topk_idx)
      result, _ = _call("ll_combine", (out, no_pair_values), rows,
                        jnp.zeros((experts_per_rank, 0), F32), handle.row_weights.astype(F32),
                        handle.recv_src, handle.count, topk_idx,
                        jnp.zeros((topk_idx.shape[0], 0), F32),
                        config=config_attr(config, num_ranks))
      return result

    return self._kernel_or_portable(
        "low_latency_combine", config,
        ll_combine_rows_unsupported(rows, handle.num_tokens, config, num_ranks), kernel,
        lambda: self.portable.ll_combine_presummed(rows, topk_idx, handle))

  def _ll_dispatch_kernel(self, x: jax.Array, topk_idx: jax.Array,
                          topk_weights: jax.Array | None, config: EpConfig, use_fp8: bool,
                          num_ranks: int, live: tuple[bool, ...]
                          ) -> tuple[LowLatencyDispatchResult, jax.Array | None]:
    """The dispatch kernel; with topk_weights f32[T_local, K], also each row's
    weight f32[E_local, R*T_ll] (else None)."""
    if config.debug_checks:
      self.layout(topk_idx, config)  # side effect: fails on every rank on a bad index
    experts_per_rank = config.experts_per_rank(num_ranks)
    rows = num_ranks * config.ll_max_tokens
    with_weights = topk_weights is not None
    weights_in = topk_weights if with_weights else jnp.zeros((x.shape[0], 0), F32)
    results = self._recv_results(config, num_ranks, use_fp8, x) + (
        result_type((experts_per_rank, rows if with_weights else 0), F32, x),
        result_type((), I32, x))
    out, scales, count, recv_src, row_weights, num_invalid = _call(
        "ll_dispatch", results, x, topk_idx, weights_in, use_fp8=bool(use_fp8),
        config=config_attr(config, num_ranks))
    handle = LowLatencyHandle(recv_src=recv_src, count=count, config=config,
                              num_tokens=x.shape[0], live=live)
    result = LowLatencyDispatchResult(x=out, scales=scales if use_fp8 else None, count=count,
                                      num_invalid=num_invalid, handle=handle)
    return result, row_weights if with_weights else None

  def _recv_results(self, config: EpConfig, num_ranks: int, use_fp8: bool,
                    like: jax.Array) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The received rows, scales, count and recv_src of an LL dispatch kernel."""
    experts_per_rank = config.experts_per_rank(num_ranks)
    rows = num_ranks * config.ll_max_tokens
    x_dtype = fp8_lib.FP8_DTYPE if use_fp8 else jnp.bfloat16
    scale_width = config.hidden // fp8_lib.GROUP if use_fp8 else 0
    return (result_type((experts_per_rank, rows, config.hidden), x_dtype, like),
            result_type((experts_per_rank, rows, scale_width), F32, like),
            result_type((experts_per_rank,), I32, like),
            result_type((experts_per_rank, rows), I32, like))

  def ll_combine(self, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                 handle: LowLatencyHandle) -> jax.Array:
    """[E_local, R*T_ll, H] bf16 rows -> [T_local, H] = sum_k w * row, fp32."""
    config = handle.config
    num_ranks = _ll_ranks("low_latency_combine", config)
    return self._kernel_or_portable(
        "low_latency_combine", config,
        ll_combine_rows_unsupported(rows, topk_idx.shape[0], config, num_ranks),
        lambda: self._ll_combine_kernel(rows, None, topk_idx, topk_weights, handle,
                                        num_ranks)[0],
        lambda: self.portable.ll_combine(rows, topk_idx, topk_weights, handle))

  def ll_rows_to_pairs(self, values: jax.Array, topk_idx: jax.Array,
                       handle: LowLatencyHandle) -> jax.Array:
    """values f32[E_local, R*T_ll] -> f32[T_local, K] on the combine kernel
    (its per-pair values, no rows)."""
    config = handle.config
    num_ranks = _ll_ranks("low_latency_combine", config)
    return self._kernel_or_portable(
        "low_latency_combine (backward)", config,
        ll_unsupported(jnp.bfloat16, topk_idx.shape[0], config, num_ranks),
        lambda: self._ll_combine_kernel(None, values.astype(F32), topk_idx,
                                        jnp.zeros(topk_idx.shape, F32), handle, num_ranks)[1],
        lambda: self.portable.ll_rows_to_pairs(values, topk_idx, handle))

  def _ll_combine_kernel(self, rows: jax.Array | None, row_values: jax.Array | None,
                         topk_idx: jax.Array, topk_weights: jax.Array,
                         handle: LowLatencyHandle, num_ranks: int) -> tuple[jax.Array, jax.Array]:
    """The combine kernel: (rows' sums bf16[T_local, H] (width 0 without rows),
    per-pair values f32[T_local, K] (width 0 without row_values))."""
    config = handle.config
    experts_per_rank = config.experts_per_rank(num_ranks)
    num_tokens = topk_idx.shape[0]
    like = topk_idx
    if rows is None:
      rows = jnp.zeros((experts_per_rank, num_ranks * config.ll_max_tokens, 0), jnp.bfloat16)
    if row_values is None:
      row_values = jnp.zeros((experts_per_rank, 0), F32)
    results = (result_type((num_tokens, rows.shape[2]), jnp.bfloat16, like),
               result_type((num_tokens, config.num_topk if row_values.shape[1] else 0), F32,
                           like))
    no_row_weights = jnp.zeros((experts_per_rank, 0), F32)
    return _call("ll_combine", results, rows, row_values, no_row_weights, handle.recv_src,
                 handle.count, topk_idx, topk_weights.astype(F32),
                 config=config_attr(config, num_ranks))

  # ---------------------------------------------------------------- LL, split for overlap
  # The kernel path's sends: "kernel", or "kernel_weights" when the pairs carry
  # topk_weights (the recv then returns the rows' weights too). A recv takes
  # the path its send took (its why-not says so); the send announced it.
  _KERNEL_PATHS: tuple[str, ...] = ("kernel", "kernel_weights")
  _SENT_PORTABLE: WhyNot = ("its send half took the portable path", "see the send's reason")

  def ll_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig,
                       use_fp8: bool, live: tuple[bool, ...] = (),
                       topk_weights: jax.Array | None = None) -> LowLatencySent:
    """Starts an LL dispatch; the kernel path hands (num_invalid, ticket) to the
    recv; with topk_weights each pair's weight travels in its header."""
    num_ranks = _ll_ranks("low_latency_dispatch_send", config)

    def kernel() -> LowLatencySent:
      if config.debug_checks:
        self.layout(topk_idx, config)
      with_weights = topk_weights is not None
      weights_in = (topk_weights.astype(F32) if topk_weights is not None
                    else jnp.zeros((x.shape[0], 0), F32))
      sent = _call("ll_dispatch_send", (result_type((), I32, x), result_type((), I32, x)),
                   x, topk_idx, weights_in, use_fp8=bool(use_fp8),
                   config=config_attr(config, num_ranks))
      return LowLatencySent(path=self._KERNEL_PATHS[with_weights], payload=tuple(sent))

    return self._kernel_or_portable(
        "low_latency_dispatch_send", config,
        ll_unsupported(x.dtype, x.shape[0], config, num_ranks, dispatch=True), kernel,
        lambda: self.portable.ll_dispatch_send(x, topk_idx, config, use_fp8, live,
                                               topk_weights))

  def ll_dispatch_recv(self, sent: LowLatencySent, config: EpConfig, use_fp8: bool,
                       num_tokens: int, live: tuple[bool, ...] = ()) -> LowLatencyDispatchResult:
    """Finishes an LL dispatch on the path its send took."""
    return self._kernel_or_portable(
        "low_latency_dispatch_recv", config,
        self._SENT_PORTABLE if sent.path not in self._KERNEL_PATHS else None,
        lambda: self._ll_dispatch_recv_kernel(sent, config, use_fp8, num_tokens, live),
        lambda: self.portable.ll_dispatch_recv(sent, config, use_fp8, num_tokens, live),
        announce=False)

  def _ll_dispatch_recv_kernel(self, sent: LowLatencySent, config: EpConfig, use_fp8: bool,
                               num_tokens: int,
                               live: tuple[bool, ...]) -> LowLatencyDispatchResult:
    with_weights = sent.path == "kernel_weights"
    num_invalid, ticket = sent.payload
    num_ranks = jax.lax.axis_size(config.axis_name)
    rows = num_ranks * config.ll_max_tokens
    results = self._recv_results(config, num_ranks, use_fp8, ticket) + (
        result_type((config.experts_per_rank(num_ranks), rows if with_weights else 0), F32,
                    ticket),)
    out, scales, count, recv_src, row_weights = _call(
        "ll_dispatch_recv", results, ticket, use_fp8=bool(use_fp8),
        num_tokens=np.int64(num_tokens), config=config_attr(config, num_ranks))
    handle = LowLatencyHandle(recv_src=recv_src, count=count, config=config,
                              num_tokens=num_tokens, live=live,
                              row_weights=row_weights if with_weights else None)
    return LowLatencyDispatchResult(x=out, scales=scales if use_fp8 else None, count=count,
                                    num_invalid=num_invalid, handle=handle,
                                    weights=row_weights if with_weights else None)

  def ll_combine_send(self, rows: jax.Array, handle: LowLatencyHandle) -> LowLatencySent:
    """Starts an LL combine; the kernel path hands its ticket to the recv."""
    config = handle.config
    num_ranks = _ll_ranks("low_latency_combine_send", config)
    return self._kernel_or_portable(
        "low_latency_combine_send", config,
        ll_combine_rows_unsupported(rows, handle.num_tokens, config, num_ranks),
        lambda: self._ll_combine_send_kernel(rows, handle, False, num_ranks),
        lambda: self.portable.ll_combine_send(rows, handle))

  def ll_combine_presummed_send(self, rows: jax.Array,
                                handle: LowLatencyHandle) -> LowLatencySent:
    """Starts a pre-summed LL combine (the dispatch's rows' weights applied here)."""
    config = handle.config
    num_ranks = _ll_ranks("low_latency_combine_send", config)
    return self._kernel_or_portable(
        "low_latency_combine_send", config,
        ll_combine_rows_unsupported(rows, handle.num_tokens, config, num_ranks),
        lambda: self._ll_combine_send_kernel(rows, handle, True, num_ranks),
        lambda: self.portable.ll_combine_presummed_send(rows, handle))

  def _ll_combine_send_kernel(self, rows: jax.Array, handle: LowLatencyHandle,
                              presummed: bool, num_ranks: int) -> LowLatencySent:
    """The send kernel on [E_local, R*T_ll, H] bf16 rows; ``presummed``: with the
    dispatch's rows' weights (handle.row_weights), one pre-summed row per
    (token, rank)."""
    config = handle.config
    row_weights = (handle.row_weights.astype(F32) if presummed
                   else jnp.zeros((config.experts_per_rank(num_ranks), 0), F32))
    ticket = _call("ll_combine_send", result_type((), I32, rows), rows, row_weights,
                   handle.recv_src, handle.count, num_tokens=np.int64(handle.num_tokens),
                   config=config_attr(config, num_ranks))
    return LowLatencySent(path="kernel", payload=ticket)

  def ll_combine_recv(self, sent: LowLatencySent, topk_idx: jax.Array, topk_weights: jax.Array,
                      handle: LowLatencyHandle) -> jax.Array:
    """Finishes an LL combine on the path its send took -> [T_local, H]."""
    return self._kernel_or_portable(
        "low_latency_combine_recv", handle.config,
        self._SENT_PORTABLE if sent.path == "portable" else None,
        lambda: self._ll_combine_recv_kernel(sent, topk_idx, topk_weights.astype(F32), handle),
        lambda: self.portable.ll_combine_recv(sent, topk_idx, topk_weights, handle),
        announce=False)

  def ll_combine_presummed_recv(self, sent: LowLatencySent, topk_idx: jax.Array,
                                handle: LowLatencyHandle) -> jax.Array:
    """Finishes a pre-summed LL combine on the path its send took -> [T_local, H]."""
    return self._kernel_or_portable(
        "low_latency_combine_recv", handle.config,
        self._SENT_PORTABLE if sent.path == "portable" else None,
        lambda: self._ll_combine_recv_kernel(sent, topk_idx,
                                             jnp.zeros((topk_idx.shape[0], 0), F32), handle),
        lambda: self.portable.ll_combine_presummed_recv(sent, topk_idx, handle),
        announce=False)

  def _ll_combine_recv_kernel(self, sent: LowLatencySent, topk_idx: jax.Array,
                              topk_weights: jax.Array, handle: LowLatencyHandle) -> jax.Array:
    """The recv kernel; topk_weights f32[T_local, K], or [T_local, 0] when the
    send pre-summed the rows."""
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    out = result_type((topk_idx.shape[0], config.hidden), jnp.bfloat16, topk_idx)
    return _call("ll_combine_recv", out, sent.payload, topk_idx, topk_weights,
                 config=config_attr(config, num_ranks))


def lowering_check_targets() -> tuple[str, ...]:
  """FFI targets the CUDA backend emits (tests look for them in lowered HLO)."""
  return tuple(_extension.cuda_target(op) for op in (
      "ht_dispatch", "ht_combine", "ht_dispatch_expert_major", "ht_combine_expert_major",
      "ht_slot_values", "ll_dispatch", "ll_combine", "ll_dispatch_send", "ll_dispatch_recv",
      "ll_combine_send", "ll_combine_recv"))
