"""EpConfig: the static description of one expert-parallel exchange."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jax_ep.errors import EpConfigError

# Default token cap of the low-latency ops: decode batches are small, and the LL
# buffers grow with it times E_local * R (DeepEP's LL benchmarks use 128).
DEFAULT_LOW_LATENCY_MAX_TOKENS = 128
MAX_TIMEOUT_S = 86400.0
FALLBACK_POLICIES = ("warn", "error", "allow")
# What every config of one process shares (jax_ep.initialize with several
# configs): the EP group (axis_name), and what the CUDA runtime holds once per
# process, not per call (the wait bound, the masking policy, the HT SM budget).
# The sizes and the per-call options (debug_checks, fallback) may differ.
PROCESS_WIDE_FIELDS = ("axis_name", "timeout_s", "mask_on_timeout", "num_sms")


@dataclasses.dataclass(frozen=True)
class EpConfig:
  """Sizes of an expert-parallel MoE exchange; frozen and hashable.

  EP rank ``r`` of an EP group (R ranks) owns the global experts
  ``[r * E_local, (r + 1) * E_local)`` with ``E_local = num_experts // R``. The
  EP group spans the ``axis_name`` mesh axes; every coordinate of the other
  mesh axes is a group of its own (jax_ep/groups.py).

  Attributes:
    num_experts: E, global number of experts (a multiple of R).
    hidden: H, width of a token row.
    max_tokens_per_rank: T, the most tokens any rank passes to one
      high-throughput call (``dispatch``); its receive buffers hold ``R * T`` rows.
    num_topk: K, experts chosen per token.
    axis_name: the mesh axis the experts are spread over, or a tuple of axes
      in mesh order (e.g. ``("context", "expert")``): the EP rank is then the
      index linearised over them, first axis major, as
      ``jax.lax.axis_index(axis_name)`` gives it.
    debug_checks: turn out-of-range top-k indices into run-time errors instead
      of treating them as -1 (they are always counted in ``num_invalid``).
    num_sms: streaming multiprocessors the GPU high-throughput kernels may use
      (None: the measured default). Ignored by the portable backend.
    timeout_s: bound on every device-side wait of the GPU kernels.
    mask_on_timeout: GPU low-latency ops mask a peer whose wait timed out
      (jax_ep.masked_ranks() then lists it) instead of recording a fault. The
      portable backend has no timeouts (no effect there). See jax_ep.mask_rank
      and docs/reliability.md.
    enable_low_latency: allocate the GPU low-latency buffers (about
      2 * (E_local*R*T*(2H+16) + E*T*2H) bytes; see jax_ep.buffer_bytes).
    enable_high_throughput: allocate the GPU high-throughput buffers.
    low_latency_max_tokens_per_rank: T_ll, the most tokens any rank passes to
      one low-latency call; LL results and buffers hold ``R * T_ll`` rows per
      local expert. None: ``min(max_tokens_per_rank, 128)``.
    fallback: what happens when the CUDA backend cannot run an op on its
      kernels and takes the portable path instead (slower: an XLA all_to_all
      plus packing): "warn" (default) logs a warning once per (op, reason),
      naming the reason and the fix; "error" raises EpConfigError at trace
      time; "allow" takes it silently. The portable backend ignores it.
  """

  num_experts: int
  hidden: int
  max_tokens_per_rank: int
  num_topk: int
  axis_name: str | tuple[str, ...] = "ep"
  debug_checks: bool = False
  num_sms: int | None = None
  timeout_s: float = 30.0
  mask_on_timeout: bool = False
  enable_low_latency: bool = True
  enable_high_throughput: bool = True
  low_latency_max_tokens_per_rank: int | None = None
  fallback: str = "warn"

  def __post_init__(self) -> None:
    for name in ("num_experts", "hidden", "max_tokens_per_rank", "num_topk"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise EpConfigError(f"EpConfig.{name} must be a positive int, got {value!r}")
    if self.num_topk > self.num_experts:
      raise EpConfigError(
          f"EpConfig.num_topk ({self.num_topk}) cannot exceed num_experts ({self.num_experts})")
    if isinstance(self.axis_name, list):
      object.__setattr__(self, "axis_name", tuple(self.axis_name))  # hashable
    names = (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name
    if (not isinstance(names, tuple) or not names
        or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names)):
      raise EpConfigError(f"EpConfig.axis_name must be a mesh axis name or a tuple of distinct "
                          f"axis names, got {self.axis_name!r}")
    if len(names) == 1 and not isinstance(self.axis_name, str):
      object.__setattr__(self, "axis_name", names[0])  # ("ep",) and "ep" are one config
    if self.num_sms is not None and (not isinstance(self.num_sms, int) or self.num_sms <= 0):
      raise EpConfigError(f"EpConfig.num_sms must be None or a positive int, got {self.num_sms!r}")
    if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
        or not math.isfinite(self.timeout_s) or not 0 < self.timeout_s <= MAX_TIMEOUT_S):
      raise EpConfigError(
          f"EpConfig.timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got "
          f"{self.timeout_s!r}")
    ll_tokens = self.low_latency_max_tokens_per_rank
    if ll_tokens is not None and (not isinstance(ll_tokens, int) or isinstance(ll_tokens, bool)
                                  or ll_tokens <= 0):
      raise EpConfigError(f"EpConfig.low_latency_max_tokens_per_rank must be None or a positive "
                          f"int, got {ll_tokens!r}")
    if self.fallback not in FALLBACK_POLICIES:
      raise EpConfigError(
          f"EpConfig.fallback must be one of {FALLBACK_POLICIES}, got {self.fallback!r}")

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The EP axes as a tuple."""
    return (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name

  @property
  def ll_max_tokens(self) -> int:
    """T_ll: the token cap of the low-latency ops (resolved default)."""
    if self.low_latency_max_tokens_per_rank is not None:
      return self.low_latency_max_tokens_per_rank
    return min(self.max_tokens_per_rank, DEFAULT_LOW_LATENCY_MAX_TOKENS)

  def experts_per_rank(self, num_ranks: int) -> int:
    """E_local for ``num_ranks`` ranks; raises if E is not a multiple of R."""
    if self.num_experts % num_ranks:
      raise EpConfigError(
          f"num_experts ({self.num_experts}) must be divisible by the EP group size of "
          f"{self.axis_name!r} ({num_ranks})")
    return self.num_experts // num_ranks

  def capacity(self, num_ranks: int) -> int:
    """Default HT dispatch row count: every token of every rank, ``R * T``."""
    return num_ranks * self.max_tokens_per_rank


def differences(held: EpConfig, given: EpConfig,
                fields: Sequence[str] | None = None) -> list[tuple[str, Any, Any]]:
  """(field, held value, given value) for each field (all, or ``fields``) where
  the two configs differ, in declaration order."""
  names = fields if fields is not None else [f.name for f in dataclasses.fields(EpConfig)]
  return [(name, getattr(held, name), getattr(given, name)) for name in names
          if getattr(held, name) != getattr(given, name)]


def describe_differences(held: EpConfig, given: EpConfig, held_as: str, given_as: str,
                         fields: Sequence[str] | None = None) -> str:
  """The differing fields, one clause each: "hidden: 16 (held_as) vs 32 (given_as)"."""
  return "; ".join(f"{name}: {a!r} ({held_as}) vs {b!r} ({given_as})"
                   for name, a, b in differences(held, given, fields))


def check_compatible(configs: Sequence[EpConfig], op: str = "initialize") -> None:
  """Raises EpConfigError unless every config shares PROCESS_WIDE_FIELDS with
  the first; the message names each differing field and both values."""
  for i, other in enumerate(configs[1:], start=1):
    clash = describe_differences(configs[0], other, "configs[0]", f"configs[{i}]",
                                 PROCESS_WIDE_FIELDS)
    if clash:
      raise EpConfigError(
          f"jax_ep.{op}: the configs of one process must share "
          f"{', '.join(PROCESS_WIDE_FIELDS)} (one EP group, and what the CUDA runtime holds "
          f"once per process), but {clash}; give them the same values")
