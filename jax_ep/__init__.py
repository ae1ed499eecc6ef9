"""jax_ep: expert-parallel MoE dispatch/combine for JAX.

Typical use (one JAX process per GPU on CUDA; any mesh with the portable backend)::

  config = jax_ep.EpConfig(num_experts=256, hidden=7168, max_tokens_per_rank=4096,
                           num_topk=8, axis_name="ep")
  jax_ep.initialize(config, mesh)

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, in_specs=..., out_specs=...)
  def moe(x, topk_idx, topk_weights):
    d = jax_ep.dispatch(x, topk_idx, topk_weights, config=config)
    y = experts(d.x, d.tokens_per_expert) * ...
    return jax_ep.combine(y, d.handle, config=config)
"""

from jax_ep import fp8
from jax_ep import reference
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError, EpError
from jax_ep.ops import (LowLatencyPending, combine, dispatch, get_dispatch_layout,
                        low_latency_combine, low_latency_combine_recv, low_latency_combine_send,
                        low_latency_dispatch, low_latency_dispatch_recv,
                        low_latency_dispatch_send)
from jax_ep.buffers import buffer_bytes
from jax_ep.masking import mask_rank, masked_ranks, unmask_all
from jax_ep.runtime import finalize, initialize, status
from jax_ep.runtime import state as runtime_state
from jax_ep.types import (DispatchHandle, DispatchResult, LowLatencyDispatchResult,
                          LowLatencyHandle)

__version__ = "0.1.0"

__all__ = [
    "EpConfig", "EpConfigError", "buffer_bytes", "status", "EpError", "DispatchHandle", "DispatchResult",
    "LowLatencyDispatchResult", "LowLatencyHandle", "LowLatencyPending", "combine", "dispatch", "finalize",
    "fp8", "get_dispatch_layout", "initialize", "low_latency_combine", "low_latency_combine_recv",
    "low_latency_combine_send", "low_latency_dispatch", "low_latency_dispatch_recv",
    "low_latency_dispatch_send", "mask_rank", "masked_ranks",
    "reference", "runtime_state", "unmask_all",
]
