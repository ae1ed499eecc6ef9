"""The CUDA backend: jax_ep's kernels as XLA FFI custom calls.

Implements the backend interface of backends/xla.py. Row layouts and handles
are the same, so steps without a kernel (payloads the kernels do not move, and
the small LL backward helpers) run on the portable implementation, on the GPU.
Every custom call is marked side-effecting (all ranks must issue them in the
same order) and its results vary over the EP axis like its inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import fp8 as fp8_lib
from jax_ep._vma import match_vma, result_type
from jax_ep.backends.xla import XlaBackend
from jax_ep.config import EpConfig
from jax_ep.types import DispatchHandle, LowLatencyHandle

I32 = jnp.int32


def _dims(config: EpConfig, num_ranks: int) -> dict:
  """The config attributes every jax_ep CUDA custom call carries (checked by the handler)."""
  return dict(num_ranks=np.int64(num_ranks), num_experts=np.int64(config.num_experts),
              hidden=np.int64(config.hidden), max_tokens=np.int64(config.max_tokens_per_rank),
              num_topk=np.int64(config.num_topk))


def _call(target: str, results, *args, **attrs):
  args = match_vma(*args)
  return jax.ffi.ffi_call(target, results, has_side_effect=True)(*args, **attrs)


def cached_routing(send_row: jax.Array, config: EpConfig) -> jax.Array:
  """int32 [T, K]: token t to the first expert of rank r where send_row[t, r] >= 0
  (needs K >= R). A dispatch with it places rows where the dispatch that made
  send_row did (CudaBackend.ht_dispatch_cached)."""
  num_ranks = send_row.shape[1]
  first_expert = jnp.arange(num_ranks, dtype=I32) * config.experts_per_rank(num_ranks)
  routing = jnp.where(send_row >= 0, first_expert[None, :], -1)
  return jnp.pad(routing, ((0, 0), (0, config.num_topk - num_ranks)), constant_values=-1)


HT_MAX_RANKS = 8  # cuda/ht_launch.h kHtMaxRanks: one NVLink domain
HT_MAX_TOKENS = 65536  # cuda/ht_launch.h kHtMaxTokens: tokens per rank of one HT dispatch
LL_MAX_ROUTING_BYTES = 200 * 1024  # cuda/ll_kernels.cu kMaxDynamicSmem


def ll_routing_fits(num_tokens: int, config: EpConfig) -> bool:
  """Whether the LL dispatch kernel can hold this call's routing in shared memory:
  every token's top-k and two expert histograms, 4 bytes each
  (cuda/ll_kernels.cu DispatchSendSmem). Larger calls take the portable path."""
  entries = num_tokens * config.num_topk + 2 * config.num_experts
  return 4 * entries <= LL_MAX_ROUTING_BYTES


class CudaBackend(XlaBackend):
  """Kernels for bf16 (and FP8) rows; the portable path for everything else."""

  name = "cuda"

  # ---------------------------------------------------------------- HT
  @staticmethod
  def ht_kernel_supports(payloads, config: EpConfig, num_ranks: int) -> bool:
    """bf16 rows or FP8 rows (+ scales), R <= 8, K <= 32: the HT kernels' domain."""
    if num_ranks > HT_MAX_RANKS or config.num_topk > 32 or not config.enable_high_throughput:
      return False
    if len(payloads) == 1:
      return payloads[0].dtype == jnp.bfloat16 and config.hidden % 8 == 0
    return (len(payloads) == 2 and payloads[0].dtype == fp8_lib.FP8_DTYPE
            and config.hidden % 16 == 0)

  def ht_dispatch(self, payloads, topk_idx, topk_weights, config: EpConfig, capacity: int):
    num_ranks = jax.lax.axis_size(config.axis_name)
    if (not self.ht_kernel_supports(payloads, config, num_ranks)
        or payloads[0].shape[0] > HT_MAX_TOKENS):
      return super().ht_dispatch(payloads, topk_idx, topk_weights, config, capacity)
    if config.debug_checks:
      self.layout(topk_idx, config)  # side effect: fails on every rank on a bad index
    x = payloads[0]
    num_tokens = x.shape[0]
    scales = payloads[1] if len(payloads) == 2 else jnp.zeros((num_tokens, 0), jnp.float32)
    k = config.num_topk
    results = (result_type((capacity, config.hidden), x.dtype, x),
               result_type((capacity,) + scales.shape[1:], scales.dtype, x),
               result_type((capacity, k), I32, x), result_type((capacity, k), jnp.float32, x),
               result_type((), I32, x),
               result_type((config.experts_per_rank(num_ranks),), I32, x),
               result_type((), I32, x), result_type((), I32, x),
               result_type((capacity,), I32, x), result_type((num_tokens, num_ranks), I32, x))
    (out_x, out_scales, out_idx, out_w, num_kept, tokens_per_expert, num_dropped, num_invalid,
     recv_src, send_row) = _call("jax_ep_ht_dispatch", results, x, scales, topk_idx,
                                 topk_weights, capacity=np.int64(capacity),
                                 **_dims(config, num_ranks))
    outs = (out_x, out_scales) if len(payloads) == 2 else (out_x,)
    handle = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=num_kept,
                            config=config)
    return outs, out_idx, out_w, num_kept, tokens_per_expert, num_dropped, num_invalid, handle

  def ht_dispatch_cached(self, payload: jax.Array, handle: DispatchHandle) -> jax.Array:
    """Combine's backward on the dispatch kernel: [T_local, H] bf16 rows along
    the handle's layout -> [C, H].

    The kernel is driven by cached_routing: token t to the first expert of
    rank r exactly where send_row[t, r] >= 0. Rows then land in the same
    (source rank, source token) order, so at the same rows: a row kept by the
    original dispatch has only kept rows before it (drops happen past the
    capacity, at the end of that order), so the prefix sums the kernel
    computes from the kept rows alone place it where it was
    (tests/cpu/test_ht.py checks this on the portable path). Needs R <= K;
    otherwise, or with debug_checks, the portable path.
    """
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    num_tokens = handle.send_row.shape[0]
    if (payload.ndim != 2 or payload.shape != (num_tokens, config.hidden)
        or num_ranks > config.num_topk or config.debug_checks
        or not self.ht_kernel_supports((payload,), config, num_ranks)):
      return super().ht_dispatch_cached(payload, handle)
    routing = cached_routing(handle.send_row, config)
    weights = jnp.zeros((num_tokens, config.num_topk), jnp.float32)
    (rows,), *_ = self.ht_dispatch((payload,), routing, weights, config,
                                   handle.recv_src.shape[0])
    return rows

  def ht_combine(self, rows: jax.Array, handle: DispatchHandle) -> jax.Array:
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    if (rows.ndim != 2 or rows.dtype != jnp.bfloat16 or rows.shape[1] != config.hidden
        or not self.ht_kernel_supports((rows,), config, num_ranks)):
      return super().ht_combine(rows, handle)
    capacity = rows.shape[0]
    out = result_type((handle.send_row.shape[0], config.hidden), jnp.bfloat16, rows)
    return _call("jax_ep_ht_combine", out, rows, handle.recv_src, handle.send_row,
                 handle.num_tokens, capacity=np.int64(capacity), **_dims(config, num_ranks))

  # ---------------------------------------------------------------- LL
  @staticmethod
  def ll_kernel_supports(x_dtype, config: EpConfig) -> bool:
    """bf16 rows, K <= 32, hidden a multiple of 8: the LL kernels' domain."""
    return (x_dtype == jnp.bfloat16 and config.num_topk <= 32 and config.hidden % 8 == 0)

  def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig, use_fp8: bool):
    num_ranks = jax.lax.axis_size(config.axis_name)
    if (not self.ll_kernel_supports(x.dtype, config)
        or not ll_routing_fits(x.shape[0], config)):
      return super().ll_dispatch(x, topk_idx, config, use_fp8)
    if config.debug_checks:
      self.layout(topk_idx, config)  # side effect: fails on every rank on a bad index
    results = self._recv_results(config, num_ranks, use_fp8, x) + (result_type((), I32, x),)
    out, scales, count, recv_src, num_invalid = _call(
        "jax_ep_ll_dispatch", results, x, topk_idx, use_fp8=bool(use_fp8),
        **_dims(config, num_ranks))
    handle = LowLatencyHandle(recv_src=recv_src, count=count, config=config,
                              num_tokens=x.shape[0])
    return out, scales if use_fp8 else None, count, num_invalid, handle

  def _recv_results(self, config: EpConfig, num_ranks: int, use_fp8: bool, like: jax.Array):
    experts_per_rank = config.experts_per_rank(num_ranks)
    rows = num_ranks * config.ll_max_tokens
    x_dtype = fp8_lib.FP8_DTYPE if use_fp8 else jnp.bfloat16
    scale_width = config.hidden // fp8_lib.GROUP if use_fp8 else 0
    return (result_type((experts_per_rank, rows, config.hidden), x_dtype, like),
            result_type((experts_per_rank, rows, scale_width), jnp.float32, like),
            result_type((experts_per_rank,), I32, like),
            result_type((experts_per_rank, rows), I32, like))

  def ll_combine(self, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array,
                 handle: LowLatencyHandle) -> jax.Array:
    if rows.ndim != 3 or not self.ll_kernel_supports(rows.dtype, handle.config):
      return super().ll_combine(rows, topk_idx, topk_weights, handle)
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    out = result_type((topk_idx.shape[0], config.hidden), jnp.bfloat16, rows)
    return _call("jax_ep_ll_combine", out, rows, handle.recv_src, handle.count, topk_idx,
                 topk_weights.astype(jnp.float32), **_dims(config, num_ranks))

  # ---------------------------------------------------------------- LL, split for overlap
  def ll_dispatch_send(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig,
                       use_fp8: bool):
    """Starts an LL dispatch; returns (num_invalid, ticket) for ll_dispatch_recv."""
    num_ranks = jax.lax.axis_size(config.axis_name)
    if (not self.ll_kernel_supports(x.dtype, config)
        or not ll_routing_fits(x.shape[0], config)):
      return super().ll_dispatch_send(x, topk_idx, config, use_fp8)
    if config.debug_checks:
      self.layout(topk_idx, config)
    return _call("jax_ep_ll_dispatch_send", (result_type((), I32, x), result_type((), I32, x)),
                 x, topk_idx, use_fp8=bool(use_fp8), **_dims(config, num_ranks))

  def ll_dispatch_recv(self, pending, config: EpConfig, use_fp8: bool, num_tokens: int):
    """Finishes an LL dispatch: (x, scales or None, count, num_invalid, handle)."""
    if not (isinstance(pending, tuple) and len(pending) == 2 and pending[1].ndim == 0):
      return super().ll_dispatch_recv(pending, config, use_fp8, num_tokens)  # portable send
    num_invalid, ticket = pending
    num_ranks = jax.lax.axis_size(config.axis_name)
    out, scales, count, recv_src = _call(
        "jax_ep_ll_dispatch_recv", self._recv_results(config, num_ranks, use_fp8, ticket), ticket,
        use_fp8=bool(use_fp8), num_tokens=np.int64(num_tokens), **_dims(config, num_ranks))
    handle = LowLatencyHandle(recv_src=recv_src, count=count, config=config,
                              num_tokens=num_tokens)
    return out, scales if use_fp8 else None, count, num_invalid, handle

  def ll_combine_send(self, rows: jax.Array, handle: LowLatencyHandle):
    """Starts an LL combine; returns what ll_combine_recv needs."""
    config = handle.config
    if rows.ndim != 3 or not self.ll_kernel_supports(rows.dtype, config):
      return super().ll_combine_send(rows, handle)
    num_ranks = jax.lax.axis_size(config.axis_name)
    return _call("jax_ep_ll_combine_send", result_type((), I32, rows), rows, handle.recv_src,
                 handle.count, num_tokens=np.int64(handle.num_tokens), **_dims(config, num_ranks))

  def ll_combine_recv(self, pending, topk_idx: jax.Array, topk_weights: jax.Array,
                      handle: LowLatencyHandle) -> jax.Array:
    if not isinstance(pending, jax.Array) or pending.ndim != 0:
      return super().ll_combine_recv(pending, topk_idx, topk_weights, handle)
    config = handle.config
    num_ranks = jax.lax.axis_size(config.axis_name)
    out = result_type((topk_idx.shape[0], config.hidden), jnp.bfloat16, topk_idx)
    return _call("jax_ep_ll_combine_recv", out, pending, topk_idx,
                 topk_weights.astype(jnp.float32), **_dims(config, num_ranks))


def lowering_check_targets() -> tuple[str, ...]:
  """FFI targets the CUDA backend emits (tests look for them in lowered HLO)."""
  return ("jax_ep_ht_dispatch", "jax_ep_ht_combine", "jax_ep_ll_dispatch", "jax_ep_ll_combine",
          "jax_ep_ll_dispatch_send",
          "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")

