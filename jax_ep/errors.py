"""Exceptions raised by jax_ep."""

from __future__ import annotations


class EpError(RuntimeError):
  """A jax_ep operation failed or cannot run (runtime faults, timeouts, misuse)."""


class EpConfigError(EpError, ValueError):
  """An EpConfig or an op argument is inconsistent; raised at trace time."""
