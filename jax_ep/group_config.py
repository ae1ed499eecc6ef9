"""EpGroup: the settings one expert-parallel group shares, whatever the layer."""

from __future__ import annotations

import dataclasses
import math

from jax_ep.errors import EpConfigError

MAX_TIMEOUT_S = 86400.0


@dataclasses.dataclass(frozen=True)
class EpGroup:
  """The EP group and what the CUDA runtime holds once for it; frozen and hashable.

  An EP group is the set of devices that exchange tokens with each other: the
  devices along the ``axis_name`` mesh axes (R ranks); every coordinate of the
  other mesh axes is a group of its own (jax_ep/groups.py). A process belongs
  to one EP group, and the CUDA runtime holds these settings once per process,
  not per call or per layer, so every EpConfig passed to one
  ``jax_ep.initialize`` carries the same EpGroup (``EpConfig.group``); the
  layers' sizes may differ.

  Attributes:
    axis_name: the mesh axis the experts are spread over, or a tuple of axes
      in mesh order (e.g. ``("context", "expert")``): the EP rank is then the
      index linearised over them, first axis major, as
      ``jax.lax.axis_index(axis_name)`` gives it. ``("ep",)`` is stored as
      ``"ep"`` (one group, one value).
    timeout_s: bound in seconds on every device-side wait of the GPU kernels.
    mask_on_timeout: GPU low-latency ops mask a peer whose wait timed out
      (jax_ep.masked_ranks() then lists it) instead of recording a fault. The
      portable backend has no timeouts (no effect there). See jax_ep.mask_rank
      and docs/reliability.md.
    num_sms: streaming multiprocessors the GPU high-throughput kernels may use
      (None: the measured default). Ignored by the portable backend.
  """

  axis_name: str | tuple[str, ...] = "ep"
  timeout_s: float = 30.0
  mask_on_timeout: bool = False
  num_sms: int | None = None

  def __post_init__(self) -> None:
    if isinstance(self.axis_name, list):
      object.__setattr__(self, "axis_name", tuple(self.axis_name))  # hashable
    names = (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name
    if (not isinstance(names, tuple) or not names
        or any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names)):
      raise EpConfigError(f"EpGroup.axis_name must be a mesh axis name or a tuple of distinct "
                          f"axis names, got {self.axis_name!r}")
    if len(names) == 1 and not isinstance(self.axis_name, str):
      object.__setattr__(self, "axis_name", names[0])  # ("ep",) and "ep" are one group
    if self.num_sms is not None and (not isinstance(self.num_sms, int)
                                     or isinstance(self.num_sms, bool) or self.num_sms <= 0):
      raise EpConfigError(f"EpGroup.num_sms must be None or a positive int, got {self.num_sms!r}")
    if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
        or not math.isfinite(self.timeout_s) or not 0 < self.timeout_s <= MAX_TIMEOUT_S):
      raise EpConfigError(
          f"EpGroup.timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got "
          f"{self.timeout_s!r}")

  @property
  def axis_names(self) -> tuple[str, ...]:
    """The EP axes as a tuple."""
    return (self.axis_name,) if isinstance(self.axis_name, str) else self.axis_name
