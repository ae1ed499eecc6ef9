"""Bazel py_test entry point: runs pytest on the test files given as arguments.

    pytest_main.py <test file>... [-- <extra pytest args>]

Writes a JUnit report to $XML_OUTPUT_FILE (Bazel's test.xml) so that every
pytest case is counted, and disables pytest's cache (the runfiles tree is not
the source tree).
"""

import os
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the runfiles tree


def main(argv):
  files, extra = argv, []
  if "--" in argv:
    i = argv.index("--")
    files, extra = argv[:i], argv[i + 1:]
  args = list(files) + ["-p", "no:cacheprovider", "-o", "junit_family=xunit1", "-rfEs"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append("--junitxml=" + xml)
  args += extra
  import pytest  # pylint: disable=import-outside-toplevel
  return pytest.main(args)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
