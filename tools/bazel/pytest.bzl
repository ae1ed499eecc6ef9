"""pytest_test / pytest_suite: one Bazel py_test per pytest file.

The tests run under the project venv (//tools/bazel:venv_toolchain), where
tools/setup_env.sh installed jax and built jax_ep in place. Bazel cannot see
that pip-installed build, so the tests are tagged "external" (never cached;
re-run on every `bazel test`).
"""

_RUNNER = "//tools/bazel:pytest_main.py"

def pytest_test(name, src, data = [], args = [], tags = [], size = "large", timeout = "eternal", **kwargs):
    """A py_test running pytest on one file, JUnit XML into $XML_OUTPUT_FILE."""
    native.py_test(
        name = name,
        srcs = [_RUNNER, src],
        main = _RUNNER,
        args = ["$(rootpath %s)" % src] + (["--"] + args if args else []),
        data = data,
        python_version = "PY3",
        srcs_version = "PY3",
        legacy_create_init = False,
        tags = ["external"] + tags,
        size = size,
        timeout = timeout,
        **kwargs
    )

def pytest_suite(name, srcs, data = [], shard_counts = {}, **kwargs):
    """One pytest_test per file of srcs (named after the file, without .py),
    plus a test_suite `name` of all of them. shard_counts: test name -> Bazel
    shard_count (pytest_main.py deals the file's tests round-robin), for files
    whose tests are long enough to be the run's critical path together."""
    tests = []
    for src in srcs:
        test_name = src[:-len(".py")] if src.endswith(".py") else src
        test_name = test_name.split("/")[-1].split(":")[-1]
        if test_name in shard_counts:
            pytest_test(name = test_name, src = src, data = data,
                        shard_count = shard_counts[test_name], **kwargs)
        else:
            pytest_test(name = test_name, src = src, data = data, **kwargs)
        tests.append(":" + test_name)
    native.test_suite(name = name, tests = tests)
