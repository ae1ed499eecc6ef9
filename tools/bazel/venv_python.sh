#!/usr/bin/env bash
# Interpreter of the Bazel Python toolchain (//tools/bazel:venv_py3_runtime):
# runs <workspace>/.venv/bin/python, the environment tools/setup_env.sh builds.
# The workspace root is found from this script's real location
# (<workspace>/tools/bazel/venv_python.sh), so no machine path is committed.
self="${BASH_SOURCE[0]}"
real="$(readlink -f "${self}" 2>/dev/null || echo "${self}")"
root="$(cd "$(dirname "${real}")/../.." && pwd)"
py="${root}/.venv/bin/python"
if [[ ! -x "${py}" ]]; then
  echo "venv_python.sh: ${py} not found; run tools/setup_env.sh first" >&2
  exit 127
fi
exec "${py}" "$@"
