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
experts are left out. With ``EpGroup(mask_on_timeout=True)`` an LL wait that
times out masks its peer instead of recording a fault; ``masked_ranks()`` then
includes it (read from host-mapped memory, without a GPU sync).

This module holds the pure semantics; the mask itself (``jax_ep.mask_rank``,
``masked_ranks``, ``unmask_all``) belongs to the runtime (jax_ep/runtime.py),
which hands the live ranks to the backends as an argument.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from jax_ep.errors import EpConfigError


def check_rank(rank, num_ranks: int, op: str) -> int:
  """``rank`` as an int, or EpConfigError unless it is an EP rank (0 <= rank < R)."""
  if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
    raise EpConfigError(f"jax_ep.{op}: rank must be an int, got {rank!r}")
  if not 0 <= int(rank) < num_ranks:
    raise EpConfigError(f"jax_ep.{op}: rank {rank} is not an EP rank (0 <= rank < {num_ranks})")
  return int(rank)


def live_ranks(num_ranks: int, masked: Iterable[int]) -> tuple[bool, ...]:
  """(): every rank is live; else one bool per rank, False where masked.

  A static (hashable) value: the portable backend's mask is a trace-time constant.
  """
  masked = {r for r in masked if 0 <= r < num_ranks}
  return tuple(r not in masked for r in range(num_ranks)) if masked else ()
