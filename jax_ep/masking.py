"""Rank masking for the low-latency ops: keep serving when an EP rank is lost.

A masked rank is treated as gone by this process's low-latency ops:

* dispatch: (token, expert) pairs whose expert lives on a masked rank are not
  sent (as if the top-k entry were -1), and rows from a masked source are not
  received (its experts receive nothing from it, its tokens contribute nothing);
* combine: the experts of a masked rank contribute nothing to a token's sum.

The survivors therefore compute exactly what the oracle computes on the live
ranks alone (``jax_ep.reference`` with those top-k entries set to -1). The mask
is per process: every surviving process masks the lost rank itself (on a
timeout, or when the serving system tells it).

The high-throughput ``dispatch``/``combine`` need every rank; they raise
``EpError`` at trace time while a rank is masked.

Portable backend: the mask is a trace-time constant. Changing it clears JAX's
caches (``jax.clear_caches()``), so jitted functions retrace on their next call;
an executable compiled ahead of time (``.lower().compile()``) keeps the mask it
was compiled with.

CUDA backend: the mask also lives in device memory, read by the LL kernels on
every call: a masked rank is not waited for, not written to, and its rows and
experts are left out. With ``EpConfig(mask_on_timeout=True)`` an LL wait that
times out masks its peer instead of recording a fault; ``masked_ranks()`` then
includes it (read from host-mapped memory, without a GPU sync).
"""

from __future__ import annotations

import jax
import numpy as np

from jax_ep.errors import EpConfigError, EpError

_masked: frozenset[int] = frozenset()


def mask_rank(rank: int) -> None:
  """Masks EP rank ``rank`` (0 <= rank < R) for this process's low-latency ops."""
  global _masked
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  state = runtime.state()
  if state is None:
    raise EpError("jax_ep.mask_rank: call jax_ep.initialize(config, mesh) first")
  if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
    raise EpConfigError(f"jax_ep.mask_rank: rank must be an int, got {rank!r}")
  if not 0 <= int(rank) < state.num_ranks:
    raise EpConfigError(
        f"jax_ep.mask_rank: rank {rank} is not an EP rank (0 <= rank < {state.num_ranks})")
  if int(rank) in _masked:
    return
  _masked = _masked | {int(rank)}
  _set_device_mask(state)
  jax.clear_caches()  # jitted functions retrace with the new mask


def masked_ranks() -> tuple[int, ...]:
  """The ranks this process has masked, ascending (on CUDA, also those a kernel
  masked on a timeout)."""
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  state = runtime.state()
  on_device = set(state.cuda.module.masked()) if state is not None and state.cuda else set()
  return tuple(sorted(_masked | on_device))


def unmask_all() -> None:
  """Clears every mask of this process."""
  global _masked
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  state = runtime.state()
  if state is not None and state.cuda is not None and state.cuda.module.masked():
    state.cuda.module.set_masked([])
  if _masked:
    _masked = frozenset()
    jax.clear_caches()


def _set_device_mask(state) -> None:
  if state.cuda is not None:
    state.cuda.module.set_masked(sorted(_masked | set(state.cuda.module.masked())))


def live_ranks_mask(num_ranks: int) -> np.ndarray:
  """bool[num_ranks]: True for ranks that are not masked (a trace-time constant)."""
  live = np.ones((num_ranks,), bool)
  for rank in _masked:
    if rank < num_ranks:
      live[rank] = False
  return live


def require_unmasked(op: str) -> None:
  """Raises EpError for ops that need every rank while some rank is masked
  (by mask_rank, or on CUDA by a kernel's mask_on_timeout)."""
  masked = masked_ranks()
  if masked:
    raise EpError(
        f"jax_ep.{op}: ranks {masked} are masked; rank masking covers the low-latency "
        "ops only, and this op needs every EP rank (jax_ep.unmask_all() to lift the masks)")
