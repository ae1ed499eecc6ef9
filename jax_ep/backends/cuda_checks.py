"""Why the CUDA kernels cannot run a call: each check returns (reason, fix), the
reason naming the limit the call passes and the fix how to stay on the
kernels, or None where the kernels serve it. CudaBackend._kernel_or_portable
(backends/cuda.py) takes the portable path on a reason and announces it with
both; tests match on the messages.

The limits come from the CUDA extension (_extension.limits, cuda/limits.h).
Shapes: R EP ranks, T_local tokens of this rank, K top-k, H hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from jax_ep import _extension
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError

WhyNot = tuple[str, str] | None  # (reason, fix) when the kernels cannot run a call

HT_ROW_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)  # float32 rows travel in two passes


def ht_unsupported(config: EpConfig, num_ranks: int) -> WhyNot:
  """(reason, fix) when the HT kernels cannot serve this config at all, else None."""
  if not config.enable_high_throughput:
    return ("EpConfig(enable_high_throughput=False): no high-throughput buffers were allocated",
            "set enable_high_throughput=True (the HT kernels need every EP peer on NVLink)")
  limits = _extension.limits()
  if num_ranks > limits.ht_max_ranks:
    return (f"{num_ranks} EP ranks; the HT kernels serve one NVLink domain of at most "
            f"{limits.ht_max_ranks} ranks", f"use at most {limits.ht_max_ranks} ranks on the EP "
            "axis")
  if config.num_topk > limits.max_topk:
    return (f"num_topk={config.num_topk} > {limits.max_topk}",
            f"use num_topk <= {limits.max_topk}")
  if config.experts_per_rank(num_ranks) > limits.ht_max_experts_per_rank:
    return (f"{config.experts_per_rank(num_ranks)} experts per rank > "
            f"{limits.ht_max_experts_per_rank}",
            f"use at most {limits.ht_max_experts_per_rank} experts per rank (more EP ranks, or "
            "fewer experts)")
  if config.hidden % 8:
    return (f"hidden={config.hidden} is not a multiple of 8 (16-byte rows)",
            "pad hidden to a multiple of 8")
  return None


def ht_payload_unsupported(payloads: tuple[jax.Array, ...], config: EpConfig) -> WhyNot:
  """(reason, fix) when the HT dispatch kernel cannot move these rows, else None."""
  num_tokens = payloads[0].shape[0]
  max_tokens = _extension.limits().ht_max_tokens
  if num_tokens > max_tokens:
    return (f"{num_tokens} tokens per rank > {max_tokens} (the kernel's send plan lives in "
            "shared memory)", f"dispatch at most {max_tokens} tokens per call")
  if len(payloads) == 2:
    if config.hidden % 16:
      return (f"FP8 rows of hidden={config.hidden} are not 16-byte multiples",
              "pad hidden to a multiple of 16")
    return None
  if not any(payloads[0].dtype == jnp.dtype(d) for d in HT_ROW_DTYPES):
    return (f"rows of dtype {payloads[0].dtype}", "dispatch bfloat16, float16, float32 or FP8 "
            "rows")
  return None


def ll_unsupported(x_dtype: DTypeLike, num_tokens: int, config: EpConfig, num_ranks: int,
                   dispatch: bool = False) -> WhyNot:
  """(reason, fix) when the LL kernels cannot run this call, else None; the
  routing table limit binds only the dispatch (`dispatch`)."""
  if x_dtype != jnp.bfloat16:
    return (f"rows of dtype {jnp.dtype(x_dtype)}; the LL kernels move bfloat16 rows",
            "cast to bfloat16 (use_fp8=True sends FP8)")
  limits = _extension.limits()
  if num_ranks > limits.ll_max_ranks:
    return (f"{num_ranks} EP ranks > {limits.ll_max_ranks}",
            f"use at most {limits.ll_max_ranks} EP ranks")
  if config.num_topk > limits.max_topk:
    return (f"num_topk={config.num_topk} > {limits.max_topk}",
            f"use num_topk <= {limits.max_topk}")
  if config.hidden % 8:
    return (f"hidden={config.hidden} is not a multiple of 8 (16-byte rows)",
            "pad hidden to a multiple of 8")
  if dispatch and not ll_routing_fits(num_tokens, config):
    return (f"{num_tokens} tokens x top-{config.num_topk} with {config.num_experts} experts "
            f"exceed the dispatch kernel's {limits.ll_max_dynamic_smem_bytes // 1024} KB routing "
            "table",
            "send fewer tokens per low-latency call, or use jax_ep.dispatch (high throughput)")
  return None


def require_low_latency(config: EpConfig, op: str) -> None:
  """The LL ops run on the LL buffers: none exist with enable_low_latency=False."""
  if not config.enable_low_latency:
    raise EpConfigError(
        f"jax_ep.{op}: EpConfig(enable_low_latency=False) allocated no low-latency buffers on "
        "the CUDA backend; set enable_low_latency=True (and call jax_ep.initialize again) to use "
        "the low-latency ops")


def ll_routing_fits(num_tokens: int, config: EpConfig) -> bool:
  """Whether the LL dispatch kernel can hold this call's routing in shared memory:
  every token's top-k and two expert histograms, 4 bytes each
  (cuda/ll_kernels.cu DispatchSendSmem)."""
  entries = num_tokens * config.num_topk + 2 * config.num_experts
  return 4 * entries <= _extension.limits().ll_max_dynamic_smem_bytes


def cotangent_unsupported(payload: jax.Array, num_tokens: int, config: EpConfig,
                          num_ranks: int) -> WhyNot:
  """(reason, fix) when a combine's backward cannot run its cotangent rows
  [T_local, H] on the dispatch kernel, else None."""
  if payload.ndim != 2 or payload.shape != (num_tokens, config.hidden):
    return (f"cotangent rows of shape {payload.shape}", f"rows of [{num_tokens}, "
            f"{config.hidden}]")
  return ht_unsupported(config, num_ranks) or ht_payload_unsupported((payload,), config)


def ht_combine_rows_unsupported(rows: jax.Array, config: EpConfig, num_ranks: int,
                                rows_name: str) -> WhyNot:
  """(reason, fix) when the combine kernels cannot take these [rows_name, W] rows."""
  why = ht_unsupported(config, num_ranks)
  if why is None and (rows.ndim != 2
                      or not any(rows.dtype == jnp.dtype(d) for d in HT_ROW_DTYPES)):
    why = (f"rows of dtype {rows.dtype} and shape {rows.shape}", "combine bfloat16, float16 "
           f"or float32 [{rows_name}, W] rows")
  return why


def ll_combine_rows_unsupported(rows: jax.Array, num_tokens: int, config: EpConfig,
                                num_ranks: int) -> WhyNot:
  """(reason, fix) when the LL combine kernels cannot take these rows, else None."""
  why = ll_unsupported(rows.dtype, num_tokens, config, num_ranks)
  if why is None and rows.ndim != 3:
    why = (f"rows of shape {rows.shape}", "combine [E_local, R*T_ll, H] rows")
  return why
