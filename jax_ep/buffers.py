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
    combine receive 2 * (R*T*2H + R*8),
    expert-major: counts per local expert 2*R*E_local*4, pair ranks R*T*K*4, and
    this rank's pair plan (64*E + T*K + E)*4

Several configs (``jax_ep.initialize((a, b), mesh)``) share one allocation,
sized by ``sizing_config``: the element-wise maximum of their sizes (E, H, K
over every config, T over those with the HT buffers, T_ll over those with the
LL buffers), a family allocated when any config enables it. Each call's kernels
get that call's own sizes and index every buffer with them; only the row
strides that the runtime derives from H (an LL message, an HT receive row) and
the HT chunk counters per source are the allocation's, the same on every rank.
A buffer's extent is a product of sizes (and of those strides), so a call whose
every size is at most the allocation's stays inside each buffer
(docs/design.md, "Several configs").
"""

from __future__ import annotations

from typing import Sequence

from jax_ep import _extension
from jax_ep.config import EpConfig, check_same_group

_ALIGN = 256


def _align(value: int, alignment: int = _ALIGN) -> int:
  return (value + alignment - 1) // alignment * alignment


def ll_message_bytes(hidden: int) -> int:
  """Bytes of one LL dispatch message: 16-byte header + bf16 or fp8+scales payload."""
  payload = max(2 * hidden, hidden + 4 * (hidden // 128))
  return _align(16 + payload, 16)


def sizing_config(configs: EpConfig | Sequence[EpConfig]) -> EpConfig:
  """The config the CUDA buffers are allocated for when they serve ``configs``.

  Sizes: the maximum of num_experts, hidden and num_topk over every config;
  of max_tokens_per_rank over the configs with enable_high_throughput, and of
  ll_max_tokens over those with enable_low_latency (over every config when none
  has that family: the value is then unused). A family is allocated when any
  config enables it. The group is the configs' one EpGroup (EpConfigError
  when they differ); debug_checks and fallback are per call and left at their
  defaults. One config: itself, those two fields reset.
  """
  configs = (configs,) if isinstance(configs, EpConfig) else tuple(configs)
  if not configs:
    raise ValueError("sizing_config needs at least one EpConfig")
  group = check_same_group(configs)
  ht = [c for c in configs if c.enable_high_throughput] or list(configs)
  ll = [c for c in configs if c.enable_low_latency] or list(configs)
  return EpConfig(
      num_experts=max(c.num_experts for c in configs), hidden=max(c.hidden for c in configs),
      max_tokens_per_rank=max(c.max_tokens_per_rank for c in ht),
      num_topk=max(c.num_topk for c in configs),
      low_latency_max_tokens_per_rank=max(c.ll_max_tokens for c in ll),
      enable_low_latency=any(c.enable_low_latency for c in configs),
      enable_high_throughput=any(c.enable_high_throughput for c in configs),
      group=group)


def buffer_bytes(config: EpConfig | Sequence[EpConfig], num_ranks: int, *,
                 rdma_staging: bool = False) -> int:
  """Bytes of symmetric memory jax_ep's CUDA backend allocates on each GPU for
  ``config``, or for several configs (their ``sizing_config``)."""
  return sum(buffer_bytes_by_family(config, num_ranks, rdma_staging=rdma_staging).values())


def buffer_bytes_by_family(config: EpConfig | Sequence[EpConfig], num_ranks: int, *,
                           rdma_staging: bool = False) -> dict[str, int]:
  """{"low_latency": bytes, "high_throughput": bytes} of symmetric memory per GPU
  (several configs: of their ``sizing_config``)."""
  if not isinstance(config, EpConfig):
    config = sizing_config(config)
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
    limits = _extension.limits()
    t = config.max_tokens_per_rank
    row = _align(max(2 * h, h + 4 * (h // 128)), 16)
    high_throughput += [2 * r * r * 4, 2 * r * 8, r * t * row, r * t * (h // 128) * 4, r * t * 4,
                        r * t * k * 4, r * t * k * 4, r * -(-t // limits.ht_chunk_rows) * 4]
    for _ in range(2):
      high_throughput += [r * t * 2 * h, r * 8]
    # cuda/ht_types.h HtPlanBlockRows
    plan_block_rows = limits.ht_one_rank_plan_blocks if r == 1 else limits.ht_plan_blocks
    high_throughput += [2 * r * e_local * 4, r * t * k * 4, plan_block_rows * e * 4, t * k * 4,
                        e * 4]
    if r == 1:  # the one-rank dispatch's work taking: plan_block_before, plan_token_slot
      high_throughput += [limits.ht_one_rank_plan_blocks * e * 4, t * 4]
  return {"low_latency": sum(_align(s) for s in low_latency),
          "high_throughput": sum(_align(s) for s in high_throughput)}
