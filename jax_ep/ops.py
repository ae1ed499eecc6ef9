"""The public ops: dispatch/combine (high-throughput) and their low-latency twins.

Every op is called inside ``jax.shard_map`` over ``config.axis_name`` with
per-shard arrays, after ``jax_ep.initialize(config, mesh)`` (or with several
configs, ``jax_ep.initialize((config, other), mesh)``). Shapes: R ranks,
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

from jax_ep.ht_ops import combine, dispatch, get_dispatch_layout
from jax_ep.ll_ops import low_latency_combine, low_latency_dispatch
from jax_ep.ll_split_ops import (LowLatencyPending, low_latency_combine_recv,
                                 low_latency_combine_send, low_latency_dispatch_recv,
                                 low_latency_dispatch_send)

__all__ = ["LowLatencyPending", "combine", "dispatch", "get_dispatch_layout",
           "low_latency_combine", "low_latency_combine_recv", "low_latency_combine_send",
           "low_latency_dispatch", "low_latency_dispatch_recv", "low_latency_dispatch_send"]
