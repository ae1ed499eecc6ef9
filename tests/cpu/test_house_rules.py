"""Rules of the house that no single test of an op would catch (see
../shared/architecture.md): state changes drop stale traces through one
mechanism."""

import ast
import os

import jax_ep

PACKAGE = os.path.dirname(os.path.abspath(jax_ep.__file__))


def _functions_calling(attribute: str):
  """(file, enclosing function) of every call of ``<x>.<attribute>(...)`` in the package."""
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if not name.endswith(".py"):
        continue
      path = os.path.join(folder, name)
      tree = ast.parse(open(path, encoding="utf-8").read())
      for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
          continue
        for node in ast.walk(function):
          if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == attribute):
            yield os.path.relpath(path, PACKAGE), function.name


def test_jax_caches_are_cleared_in_one_place():
  """Retracing after initialize, finalize or a mask change goes through
  runtime._drop_traces alone."""
  assert sorted(set(_functions_calling("clear_caches"))) == [("runtime.py", "_drop_traces")]
