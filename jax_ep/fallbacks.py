"""The one policy for a path slower than the one the user asked for.

Every such path (an op off the CUDA kernels onto the portable all_to_all, the
expert GEMMs off the grouped-GEMM kernels onto ``jax.lax.ragged_dot``) goes
through :func:`slower_path` at trace time, under its config's ``fallback``:

* ``"warn"`` (default): a warning, once per key for the life of the process;
* ``"error"``: an EpConfigError at trace time;
* ``"allow"``: nothing.

This module holds the only record of what was already told (``_told``).
"""

from __future__ import annotations

from typing import Hashable

from absl import logging

from jax_ep.errors import EpConfigError

POLICIES = ("warn", "error", "allow")

_told: set[Hashable] = set()


def slower_path(policy: str, key: Hashable, message: str, config_name: str,
                run_anyway: str) -> None:
  """Tells the user, per ``policy``, that this call takes a slower path.

  Args:
    policy: the config's ``fallback`` (POLICIES).
    key: what "once" is counted by (e.g. (op, reason)).
    message: what happens and why, and how to stay on the fast path.
    config_name: the config class whose ``fallback`` field sets the policy.
    run_anyway: what ``fallback='warn'`` does instead of the error (for the
      error's message), e.g. "runs it anyway".
  """
  if policy == "allow":
    return
  if policy == "error":
    raise EpConfigError(f"{message} ({config_name}(fallback='warn') {run_anyway}.)")
  if key not in _told:
    _told.add(key)
    logging.warning("%s This warning is shown once; %s(fallback='error') makes it an error, "
                    "fallback='allow' silences it.", message, config_name)


def forget() -> None:
  """Forgets what was told, so every slower path warns again (tests)."""
  _told.clear()
