"""Bazel py_test entry point: runs pytest on the test files given as arguments.

    pytest_main.py <test file>... [-- <extra pytest args>]

Writes a JUnit report to $XML_OUTPUT_FILE (Bazel's test.xml) so that every
pytest case is counted, and disables pytest's cache.

The test files are run from the source tree (their runfiles entries are
symlinks into it), from the workspace root, exactly as a developer's
`pytest tests/cpu/test_x.py` would: conftest.py, pyproject.toml's pytest
settings and paths relative to the tests (examples/, ...) all resolve as they
do outside Bazel. The tests are tagged "external" anyway: what they exercise
(.venv and the jax_ep build in it) is outside Bazel's view.
"""

import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the runfiles tree


def _workspace_root(path):
  directory = os.path.dirname(path)
  while True:
    if os.path.exists(os.path.join(directory, "WORKSPACE")):
      return directory
    parent = os.path.dirname(directory)
    if parent == directory:
      return None
    directory = parent


def main(argv):
  files, extra = argv, []
  if "--" in argv:
    i = argv.index("--")
    files, extra = argv[:i], argv[i + 1:]
  files = [os.path.realpath(f) for f in files]
  args = list(files) + ["-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-rfEs"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append("--junitxml=" + os.path.abspath(xml))
  root = _workspace_root(files[0]) if files else None
  if root:
    os.chdir(root)
    args += ["--rootdir", root]
  args += extra
  import pytest  # pylint: disable=import-outside-toplevel
  return pytest.main(args)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
