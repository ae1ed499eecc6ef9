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
from jax_ep.types import LowLatencyHandle

I32 = jnp.int32


def _dims(config: EpConfig, num_ranks: int) -> dict:
  """The config attributes every jax_ep CUDA custom call carries (checked by the handler)."""
  return dict(num_ranks=np.int64(num_ranks), num_experts=np.int64(config.num_experts),
              hidden=np.int64(config.hidden), max_tokens=np.int64(config.max_tokens_per_rank),
              num_topk=np.int64(config.num_topk))


def _call(target: str, results, *args, **attrs):
  args = match_vma(*args)
  return jax.ffi.ffi_call(target, results, has_side_effect=True)(*args, **attrs)


class CudaBackend(XlaBackend):
  """Kernels for bf16 (and FP8) rows; the portable path for everything else."""

  name = "cuda"

  # ---------------------------------------------------------------- LL
  @staticmethod
  def ll_kernel_supports(x_dtype, config: EpConfig) -> bool:
    """bf16 rows, K <= 32, hidden a multiple of 8: the LL kernels' domain."""
    return (x_dtype == jnp.bfloat16 and config.num_topk <= 32 and config.hidden % 8 == 0)

  def ll_dispatch(self, x: jax.Array, topk_idx: jax.Array, config: EpConfig, use_fp8: bool):
    if not self.ll_kernel_supports(x.dtype, config):
      return super().ll_dispatch(x, topk_idx, config, use_fp8)
    num_ranks = jax.lax.axis_size(config.axis_name)
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
    rows = num_ranks * config.max_tokens_per_rank
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
    if not self.ll_kernel_supports(x.dtype, config):
      return super().ll_dispatch_send(x, topk_idx, config, use_fp8)
    num_ranks = jax.lax.axis_size(config.axis_name)
    if config.debug_checks:
      self.layout(topk_idx, config)
    return _call("jax_ep_ll_dispatch_send", (result_type((), I32, x), result_type((), I32, x)),
                 x, topk_idx, use_fp8=bool(use_fp8), **_dims(config, num_ranks))

  def ll_dispatch_recv(self, pending, config: EpConfig, use_fp8: bool, num_tokens: int):
    """Finishes an LL dispatch: (x, scales or None, count, num_invalid, handle)."""
    num_invalid, ticket = pending
    if not isinstance(ticket, jax.Array) or ticket.ndim != 0:
      return super().ll_dispatch_recv(pending, config, use_fp8, num_tokens)
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
  return ("jax_ep_ll_dispatch", "jax_ep_ll_combine", "jax_ep_ll_dispatch_send",
          "jax_ep_ll_dispatch_recv", "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv")

