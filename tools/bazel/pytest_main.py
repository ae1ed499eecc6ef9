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


def _shard_plugin(pytest):
  """Bazel's test sharding (a target's shard_count): this shard keeps every
  TEST_TOTAL_SHARDS-th test from TEST_SHARD_INDEX on, in collection order, and
  deselects the rest (counted by none of the shards' JUnit files twice). The
  status file tells Bazel that this runner shards. None without sharding."""
  status = os.environ.get("TEST_SHARD_STATUS_FILE")
  if status:
    with open(status, "a", encoding="utf-8"):
      pass
  total = int(os.environ.get("TEST_TOTAL_SHARDS") or 1)
  index = int(os.environ.get("TEST_SHARD_INDEX") or 0)
  if total <= 1:
    return None

  class Shard:
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
      keep = [item for i, item in enumerate(items) if i % total == index]
      dropped = [item for i, item in enumerate(items) if i % total != index]
      if dropped:
        config.hook.pytest_deselected(items=dropped)
      items[:] = keep

  return Shard()


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
  shard = _shard_plugin(pytest)
  code = pytest.main(args, plugins=[shard] if shard else [])
  # A shard that got no test (more shards than tests) passes.
  return 0 if shard and code == pytest.ExitCode.NO_TESTS_COLLECTED else code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
