"""jax_ep is a typed package: py.typed ships in the package directory (and in the
wheel scikit-build-core makes of it), and the public ops' annotations resolve, with
no parameter or result left unannotated or typed Any."""

import inspect
import os
import typing
from typing import Any

import jax
import pytest

import jax_ep
from jax_ep import ops, types
from wheel_files import wheel_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.dirname(os.path.abspath(jax_ep.__file__))


def _names_any(hint) -> bool:
  return hint is Any or any(_names_any(arg) for arg in typing.get_args(hint))


def _public_ops():
  return [(name, getattr(ops, name)) for name in ops.__all__
          if inspect.isfunction(getattr(ops, name))]


@pytest.mark.parametrize("name,fn", _public_ops(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_public_op_is_annotated_without_any(name, fn):
  hints = typing.get_type_hints(fn)   # raises if an annotation does not resolve
  params = list(inspect.signature(fn).parameters)
  assert [p for p in params + ["return"] if p not in hints] == [], (name, hints)
  assert [k for k, hint in hints.items() if _names_any(hint)] == [], (name, hints)


def test_dispatch_rows_and_layout_counts_have_precise_types():
  """x: an array or an FP8 (rows, scales) pair; get_dispatch_layout: three arrays."""
  x = typing.get_type_hints(ops.dispatch)["x"]
  assert x == types.DispatchInput == typing.Union[jax.Array, tuple[jax.Array, jax.Array]]
  assert typing.get_type_hints(ops.get_dispatch_layout)["return"] == (
      tuple[jax.Array, jax.Array, jax.Array])


def test_py_typed_is_in_the_package_directory():
  assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))
  assert os.path.isfile(os.path.join(ROOT, "jax_ep", "py.typed"))


def test_the_wheel_takes_py_typed():
  """scikit-build-core copies every file of wheel.packages that neither git nor
  wheel.exclude / sdist.exclude leaves out: py.typed must be one of them."""
  targets = wheel_files()
  assert "jax_ep/__init__.py" in targets, sorted(targets)
  assert "jax_ep/py.typed" in targets, sorted(targets)
