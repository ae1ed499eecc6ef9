"""Symmetric GPU memory of the CUDA backend: the documented sizing formula.

Mirrors ``ComputeLayout`` in cuda/runtime.cu (a test checks they agree). Per
GPU, with R ranks, T = max_tokens_per_rank (HT), T_ll = the low-latency token
cap (``EpConfig.ll_max_tokens``), E experts, E_local = E/R, H hidden, K top-k,
every buffer rounded up to 256 bytes:

  low latency (double-buffered, x2):
    dispatch receive  E_local * R * T_ll * M   M = 16 + max(2H, H + H/32), to 16 B
    dispatch tokens   R * T_ll * M             (NVLink: one payload per token and rank)
    dispatch flags    E_local * R * 8
    combine receive   E * T_ll * 2H
    combine values    E * T_ll * 4             (one float per (expert, token): gradients)
    combine flags     E * 8
    (+ RDMA staging T_ll*M + T_ll*K*16 + E_local*R*T_ll*(2H + 4) when some peer
     is reachable only by RDMA)
  high throughput:
    counts 2*R*R*4, flags 2*R*8 (by parity), rows R*T*W (W = max(2H, H + H/32) to 16 B),
    scales R*T*(H/128)*4, sources R*T*4, top-k R*T*K*8, chunk counters R*ceil(T/32)*4,
    combine receive 2 * (R*T*2H + R*8)
"""

from __future__ import annotations

from jax_ep.config import EpConfig

_ALIGN = 256
_HT_CHUNK_ROWS = 32  # kHtChunkRows in cuda/ht_types.h


def _align(value: int, alignment: int = _ALIGN) -> int:
  return (value + alignment - 1) // alignment * alignment


def ll_message_bytes(hidden: int) -> int:
  """Bytes of one LL dispatch message: 16-byte header + bf16 or fp8+scales payload."""
  payload = max(2 * hidden, hidden + 4 * (hidden // 128))
  return _align(16 + payload, 16)


def buffer_bytes(config: EpConfig, num_ranks: int, *, rdma_staging: bool = False) -> int:
  """Bytes of symmetric memory jax_ep's CUDA backend allocates on each GPU."""
  return sum(buffer_bytes_by_family(config, num_ranks, rdma_staging=rdma_staging).values())


def buffer_bytes_by_family(config: EpConfig, num_ranks: int, *,
                           rdma_staging: bool = False) -> dict[str, int]:
  """{"low_latency": bytes, "high_throughput": bytes} of symmetric memory per GPU."""
  r, h, k = num_ranks, config.hidden, config.num_topk
  e = config.num_experts
  e_local = config.experts_per_rank(num_ranks)
  low_latency, high_throughput = [], []
  if config.enable_low_latency:
    t = config.ll_max_tokens
    message = ll_message_bytes(h)
    for _ in range(2):
      low_latency += [e_local * r * t * message, r * t * message, e_local * r * 8, e * t * 2 * h,
                      e * t * 4, e * 8]
    if rdma_staging:
      low_latency += [t * message, t * k * 16, e_local * r * t * 2 * h, e_local * r * t * 4]
  if config.enable_high_throughput:
    t = config.max_tokens_per_rank
    row = _align(max(2 * h, h + 4 * (h // 128)), 16)
    high_throughput += [2 * r * r * 4, 2 * r * 8, r * t * row, r * t * (h // 128) * 4, r * t * 4,
                        r * t * k * 4, r * t * k * 4, r * -(-t // _HT_CHUNK_ROWS) * 4]
    for _ in range(2):
      high_throughput += [r * t * 2 * h, r * 8]
  return {"low_latency": sum(_align(s) for s in low_latency),
          "high_throughput": sum(_align(s) for s in high_throughput)}
