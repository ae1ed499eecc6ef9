"""The package (and the wheel made of it) holds the library and the bench's CLI,
timing and JSON, and not the lab: no module of it imports matplotlib, the
repository's benchmarks/ or tests/, and the host oracle is not among its files
(tests/host_reference.py, benchmarks/README.md)."""

import ast
import importlib.util
import os

from wheel_files import ROOT, wheel_files

PACKAGE = os.path.join(ROOT, "jax_ep")
# Top-level modules no package module may import: plotting, the lab, the tests.
LAB_MODULES = ("matplotlib", "benchmarks", "tests", "host_reference")
ORACLE = "host_reference"


def _package_modules() -> list[str]:
  """The .py files under jax_ep/ in the tree (absolute paths)."""
  return [os.path.join(folder, name) for folder, _, names in os.walk(PACKAGE)
          for name in names if name.endswith(".py")]


def _imports(path: str) -> set[str]:
  """Every module ``path`` imports, anywhere in its code (a function's import
  included), by its dotted name; ``from a import b`` counts as a and a.b."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  names: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def _lab_imports(path: str) -> list[str]:
  """The imports of ``path`` that reach plotting, the lab or the host oracle."""
  return sorted(name for name in _imports(path)
                if name.split(".")[0] in LAB_MODULES or name.split(".")[-1] == ORACLE)


def test_no_package_module_imports_plotting_the_lab_or_the_oracle():
  found = {os.path.relpath(path, ROOT): _lab_imports(path) for path in _package_modules()}
  assert {path: names for path, names in found.items() if names} == {}
  # The check sees imports inside functions (where the plots used to import matplotlib).
  assert "jax_ep.bench.provenance" in _imports(os.path.join(PACKAGE, "bench", "__main__.py"))


def test_the_wheel_takes_no_plotting_and_no_oracle():
  """What scikit-build-core puts in the wheel: the package's files only, none of
  them the oracle, no module among them importing plotting or the lab."""
  files = wheel_files()
  assert "jax_ep/bench/__main__.py" in files, sorted(files)
  assert all(target.startswith("jax_ep/") for target in files), sorted(files)
  assert [t for t in files if os.path.basename(t).startswith(ORACLE)] == []
  found = {target: _lab_imports(source) for target, source in files.items()
           if target.endswith(".py")}
  assert {target: names for target, names in found.items() if names} == {}


def test_the_oracle_and_the_lab_live_outside_the_package():
  assert importlib.util.find_spec(f"jax_ep.{ORACLE}") is None
  assert os.path.isfile(os.path.join(ROOT, "tests", f"{ORACLE}.py"))
  for name in ("plot", "plot_sm_sweep", "plot_sweep", "plot_layer", "medians",
               "gpu_timeline", "kernel_profile", "probe"):
    assert importlib.util.find_spec(f"jax_ep.bench.{name}") is None, name
    assert os.path.isfile(os.path.join(ROOT, "benchmarks", f"{name}.py")), name
