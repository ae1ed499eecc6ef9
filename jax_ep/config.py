"""EpConfig: the static description of one expert-parallel exchange."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jax_ep import fallbacks
from jax_ep.errors import EpConfigError
from jax_ep.group_config import EpGroup

# Default token cap of the low-latency ops: decode batches are small, and the LL
# buffers grow with it times E_local * R (DeepEP's LL benchmarks use 128).
DEFAULT_LOW_LATENCY_MAX_TOKENS = 128
FALLBACK_POLICIES = fallbacks.POLICIES


@dataclasses.dataclass(frozen=True)
class EpConfig:
  """Sizes of an expert-parallel MoE exchange (one layer's); frozen and hashable.

  EP rank ``r`` of an EP group (R ranks) owns the global experts
  ``[r * E_local, (r + 1) * E_local)`` with ``E_local = num_experts // R``.
  What the whole EP group shares (its mesh axes, the GPU wait bound, the
  masking policy, the SM budget) lives in ``group`` (an EpGroup); the
  read-only properties ``axis_name``, ``axis_names``, ``timeout_s``,
  ``mask_on_timeout`` and ``num_sms`` return the group's values. Layers of
  different sizes initialized together share one EpGroup.

  Attributes:
    num_experts: E, global number of experts (a multiple of R).
    hidden: H, width of a token row.
    max_tokens_per_rank: T, the most tokens any rank passes to one
      high-throughput call (``dispatch``); its receive buffers hold ``R * T`` rows.
    num_topk: K, experts chosen per token.
    group: the EP group (jax_ep.EpGroup: axis_name, timeout_s,
      mask_on_timeout, num_sms), the same for every config of one process.
    debug_checks: turn out-of-range top-k indices into run-time errors instead
      of treating them as -1 (they are always counted in ``num_invalid``).
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
  group: EpGroup = EpGroup()
  debug_checks: bool = False
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
    if not isinstance(self.group, EpGroup):
      raise EpConfigError(f"EpConfig.group must be a jax_ep.EpGroup (e.g. "
                          f"EpGroup(axis_name='ep')), got {self.group!r}")
    ll_tokens = self.low_latency_max_tokens_per_rank
    if ll_tokens is not None and (not isinstance(ll_tokens, int) or isinstance(ll_tokens, bool)
                                  or ll_tokens <= 0):
      raise EpConfigError(f"EpConfig.low_latency_max_tokens_per_rank must be None or a positive "
                          f"int, got {ll_tokens!r}")
    if self.fallback not in FALLBACK_POLICIES:
      raise EpConfigError(
          f"EpConfig.fallback must be one of {FALLBACK_POLICIES}, got {self.fallback!r}")

  # The group's fields, read through the config: the ops and the backends take
  # one EpConfig and read these as config.axis_name etc.
  @property
  def axis_name(self) -> str | tuple[str, ...]:
    """The EP mesh axis or axes (``group.axis_name``)."""
    return self.group.axis_name

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The EP axes as a tuple (``group.axis_names``)."""
    return self.group.axis_names

  @property
  def timeout_s(self) -> float:
    """Bound on every device-side wait of the GPU kernels (``group.timeout_s``)."""
    return self.group.timeout_s

  @property
  def mask_on_timeout(self) -> bool:
    """Whether GPU LL ops mask a timed-out peer (``group.mask_on_timeout``)."""
    return self.group.mask_on_timeout

  @property
  def num_sms(self) -> int | None:
    """SMs of the GPU high-throughput kernels (``group.num_sms``)."""
    return self.group.num_sms

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
  the two configs differ, in declaration order; ``group`` is one field."""
  names = fields if fields is not None else [f.name for f in dataclasses.fields(EpConfig)]
  return [(name, getattr(held, name), getattr(given, name)) for name in names
          if getattr(held, name) != getattr(given, name)]


def describe_differences(held: EpConfig, given: EpConfig, held_as: str, given_as: str,
                         fields: Sequence[str] | None = None) -> str:
  """The differing fields, one clause each: "hidden: 16 (held_as) vs 32 (given_as)"."""
  return "; ".join(f"{name}: {a!r} ({held_as}) vs {b!r} ({given_as})"
                   for name, a, b in differences(held, given, fields))


def check_same_group(configs: Sequence[EpConfig], op: str = "initialize") -> EpGroup:
  """The configs' one EpGroup; EpConfigError naming both groups where one differs.

  A process belongs to one EP group, and the CUDA runtime holds the group's
  settings once, so this is the only rule between the configs of one process
  (besides their fitting the buffers, which are sized for all of them)."""
  group = configs[0].group
  for i, other in enumerate(configs[1:], start=1):
    if other.group != group:
      raise EpConfigError(
          f"jax_ep.{op}: configs[{i}].group is {other.group!r} but configs[0].group is "
          f"{group!r}: one process has one EP group; build every layer's EpConfig with the "
          "same EpGroup")
  return group
