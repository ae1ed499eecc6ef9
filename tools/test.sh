#!/usr/bin/env bash
# The project's one test command:
#   1. Bazel: when `bazel` (or $JAX_EP_BAZEL) is missing, installs Debian's
#      bazel-bootstrap with apt-get (sudo when not root; tools/ensure_bazel.sh)
#   2. tools/setup_env.sh  (creates/refreshes .venv, rebuilds jax_ep if needed)
#   3. bazel test //...     (pytest files, C++ unit tests, CUDA device-link checks:
#                            against the runtime NVSHMEM 3.4.5, and against 3.8.0
#                            to compile the RDMA QP branch)
#   4. counts the individual test cases of this run from the test.xml files;
#      the last line printed is exactly `N passed, N failed` (also when a step
#      before the tests fails: `0 passed, 1 failed`).
# Extra arguments go to `bazel test` (e.g. tools/test.sh //tests/cc/...); with
# none, everything runs. Exit status is non-zero if anything failed.
set -uo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${REPO_ROOT}"

summary_python() {
  if [[ -x .venv/bin/python ]]; then echo .venv/bin/python; else command -v python3; fi
}

# shellcheck source=tools/ensure_bazel.sh
source tools/ensure_bazel.sh
if ! ensure_bazel; then
  echo "no Bazel: no tests were run"
  echo "0 passed, 1 failed"
  exit 1
fi
BAZEL="${JAX_EP_BAZEL:-bazel}"

echo "== tools/setup_env.sh"
if ! tools/setup_env.sh; then
  echo "setup failed: no tests were run"
  echo "0 passed, 1 failed"
  exit 1
fi

targets=("$@")
[[ ${#targets[@]} -eq 0 ]] && targets=("//...")

bep="$(mktemp "${TMPDIR:-/tmp}/jax_ep_bep.XXXXXX.json")"
trap 'rm -f "${bep}"' EXIT

echo "== bazel test ${targets[*]}"
# shellcheck disable=SC2086
"${BAZEL}" ${JAX_EP_BAZEL_STARTUP_OPTS:-} test \
  --keep_going \
  --test_output=errors \
  --jobs="${JAX_EP_BAZEL_JOBS:-2}" \
  --local_test_jobs="${JAX_EP_BAZEL_TEST_JOBS:-2}" \
  --show_progress_rate_limit=15 \
  --build_event_json_file="${bep}" \
  -- "${targets[@]}"
bazel_rc=$?

testlogs="$("${BAZEL}" ${JAX_EP_BAZEL_STARTUP_OPTS:-} info bazel-testlogs 2>/dev/null || echo bazel-testlogs)"
echo "== summary (bazel exit code ${bazel_rc})"
"$(summary_python)" tools/bazel/summarize_tests.py "${bep}" "${bazel_rc}" "${testlogs}"
