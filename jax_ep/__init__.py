"""jax_ep: expert-parallel MoE dispatch/combine for JAX.

Typical use (one JAX process per GPU on CUDA; any mesh with the portable
backend), inside ``jax.shard_map`` over the EP axis; examples/readme_use.py
(the README's "Use" section) is a complete, tested version::

  config = jax_ep.EpConfig(num_experts=32, hidden=256, max_tokens_per_rank=64,
                           num_topk=4, group=jax_ep.EpGroup(axis_name="ep"))
  jax_ep.initialize(config, mesh)          # before jit

  def moe(x, topk_idx, topk_weights):      # per shard: [T, H], int32/f32 [T, K]
    d = jax_ep.dispatch(x, topk_idx, topk_weights, config=config)
    # d.x [R*T, H]: each received token once, in (source rank, source token)
    # order; d.topk_idx: its local experts (-1 elsewhere). Group (row, expert)
    # pairs by expert for ragged_dot, weight, and sum back per row.
    y = expert_mlp(d.x, d.topk_idx, d.topk_weights, w1, w2)
    return jax_ep.combine(y, d.handle, config=config)   # [T, H], y's dtype
"""

from jax_ep import fp8
from jax_ep import reference
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.group_config import EpGroup
from jax_ep.ops import (LowLatencyPending, combine, dispatch, get_dispatch_layout,
                        low_latency_combine, low_latency_combine_recv, low_latency_combine_send,
                        low_latency_dispatch, low_latency_dispatch_recv,
                        low_latency_dispatch_send)
from jax_ep.buffers import buffer_bytes
from jax_ep.runtime import finalize, initialize, mask_rank, masked_ranks, status, unmask_all
from jax_ep.runtime import state as runtime_state
from jax_ep.types import (DispatchHandle, DispatchResult, ExpertMajorHandle,
                          LowLatencyDispatchResult, LowLatencyHandle)

__version__ = "0.1.0"

__all__ = [
    "EpConfig", "EpConfigError", "EpGroup", "buffer_bytes", "status", "EpError",
    "DispatchHandle", "DispatchResult",
    "ExpertMajorHandle",
    "LowLatencyDispatchResult", "LowLatencyHandle", "LowLatencyPending", "combine", "dispatch", "finalize",
    "fp8", "get_dispatch_layout", "initialize", "low_latency_combine", "low_latency_combine_recv",
    "low_latency_combine_send", "low_latency_dispatch", "low_latency_dispatch_recv",
    "low_latency_dispatch_send", "mask_rank", "masked_ranks",
    "reference", "runtime_state", "unmask_all",
]
