"""What the op modules share: the static part of a call, the runtime read, handle checks
and the custom_vjp helpers."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from jax_ep import _validate
from jax_ep import runtime
from jax_ep._vma import match_vma
from jax_ep.config import EpConfig, describe_differences
from jax_ep.errors import EpConfigError


def _primal(tree: Any) -> Any:
  """Unwraps the CustomVJPPrimal leaves a symbolic-zeros fwd rule receives."""
  return jax.tree.map(lambda p: p.value, tree, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))


def _is_zero(ct: Any) -> bool:
  return ct is None or isinstance(ct, SymbolicZero)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Static (hashable) arguments of one op call: what the runtime state said
  when it was traced (config, backend, live ranks) and the call's options."""

  config: EpConfig
  backend: Any
  capacity: int = 0
  fp8: bool = False
  live: tuple[bool, ...] = ()
  alignment: int = 1


def _prepare(op: str, config: EpConfig,
             every_rank: bool = False) -> tuple[runtime.RuntimeState, int]:
  """The runtime state, read once for this trace, and R (checked against the mesh)."""
  state = runtime.require(config, op, every_rank=every_rank)
  return state, _validate.axis_size(config, state, op)


def _varying(config: EpConfig, *arrays: jax.Array) -> list[jax.Array]:
  return match_vma(*arrays, extra_axes=config.axis_names)


def _check_handle(handle, cls, config: EpConfig, op: str) -> None:
  classes = cls if isinstance(cls, tuple) else (cls,)
  if not isinstance(handle, classes):
    raise EpConfigError(f"jax_ep.{op}: handle must be a "
                        f"{' or '.join(c.__name__ for c in classes)}, got "
                        f"{type(handle).__name__}")
  if handle.config != config:
    raise EpConfigError(
        f"jax_ep.{op}: the handle comes from a dispatch with another config: "
        f"{describe_differences(handle.config, config, 'the dispatch', 'this call')}; pass "
        "the dispatch's config")

