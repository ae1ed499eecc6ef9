"""Rules of the house that no single test of an op would catch: state changes
drop stale traces through one mechanism, and library files stay small enough
to read (one purpose each)."""

import ast
import os

import jax_ep

PACKAGE = os.path.dirname(os.path.abspath(jax_ep.__file__))
ROOT = os.path.dirname(PACKAGE)
LIBRARY_FOLDERS = ("cuda", "xla_ffi", "jax_ep")
MAX_LINES = 800


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


def test_no_library_source_file_is_over_800_lines():
  too_long = []
  for top in LIBRARY_FOLDERS:
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
      for name in files:
        if name.endswith((".py", ".pyi", ".cu", ".cuh", ".h", ".cc")):
          path = os.path.join(folder, name)
          with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
          if lines > MAX_LINES:
            too_long.append(f"{os.path.relpath(path, ROOT)}: {lines} lines")
  assert too_long == []
