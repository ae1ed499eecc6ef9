"""The one seam between Python and C++: the compiled modules export their FFI
target names and the kernels' limits (xla_ffi/exports.h), Python reads them in
jax_ep/_extension.py alone, and the type stubs describe the modules as built."""

import ast
import os
import re

import pytest

import jax_ep
from jax_ep import _extension

PACKAGE = os.path.dirname(os.path.abspath(jax_ep.__file__))
ROOT = os.path.dirname(PACKAGE)


def _python_sources():
  for folder, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        yield os.path.join(folder, name)


def _stub_names(stub: str) -> set[str]:
  tree = ast.parse(open(os.path.join(PACKAGE, stub), encoding="utf-8").read())
  names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
  names |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
  return names


def _module_names(module) -> set[str]:
  return {name for name in dir(module) if not name.startswith("_")}


def test_every_cpu_handler_has_an_exported_name():
  module = _extension.cpu_module()
  assert set(module.handlers()) == set(module.cpu_targets().values())


def test_the_cuda_names_cover_every_cuda_handler():
  module = _extension.cuda_module()
  if module is None:
    pytest.skip(f"no CUDA module: {_extension.cuda_module_status()}")
  exported = set(module.cuda_targets().values())
  assert set(module.handlers()) == exported - {_extension.cuda_target("status_check")}


def test_limits_are_the_typed_record_of_the_exported_table():
  limits = _extension.limits()
  assert {k: getattr(limits, k) for k in _extension.cpu_module().limits()} == (
      _extension.cpu_module().limits())
  assert all(isinstance(v, int) and v > 0 for v in vars(limits).values())


def test_no_python_source_names_a_target_or_copies_a_kernel_limit():
  """Target names and kernel limits come from the extension: no string literal
  in the package is a target name, and no module-level constant cites a C++
  one (the old form was `HT_MAX_RANKS = 8  # cuda/ht_launch.h kHtMaxRanks`)."""
  targets = (set(_extension.cpu_module().cpu_targets().values())
             | set(_extension.cpu_module().cuda_targets().values()))
  offenders = []
  for path in _python_sources():
    text = open(path, encoding="utf-8").read()
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, ast.Constant) and node.value in targets:
        offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value!r}")
    for number, line in enumerate(text.splitlines(), 1):
      if re.match(r"^_?[A-Z][A-Z0-9_]* = .*#.*\bk[A-Z]\w+", line):
        offenders.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
  assert offenders == []


@pytest.mark.parametrize("stub,load", [("_jax_ep_cpu.pyi", _extension.cpu_module),
                                       ("_jax_ep_cuda.pyi", _extension.cuda_module)])
def test_the_stubs_describe_the_built_modules(stub, load):
  module = load()
  if module is None:
    pytest.skip(f"no CUDA module: {_extension.cuda_module_status()}")
  assert _stub_names(stub) == _module_names(module)
