# Sourced by tools/test.sh. ensure_bazel makes ${JAX_EP_BAZEL:-bazel} runnable:
# when it is not on PATH, it installs Debian's bazel-bootstrap (Bazel 4.2, works
# offline) with apt-get, as root directly or else through sudo. When it cannot,
# it prints what to do and returns 1.
# shellcheck shell=bash

ensure_bazel() {
  local bazel="${JAX_EP_BAZEL:-bazel}"
  command -v "${bazel}" >/dev/null 2>&1 && return 0
  local -a as_root=()
  if [[ "$(id -u)" != 0 ]]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "${bazel} not found; installing Debian's bazel-bootstrap needs root and there is" \
           "no sudo: run 'apt-get install bazel-bootstrap' as root, then re-run"
      return 1
    fi
    as_root=(sudo)
  fi
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "${bazel} not found, and no apt-get to install Debian's bazel-bootstrap:" \
         "install Bazel (4.2 or later; JAX_EP_BAZEL names its command), then re-run"
    return 1
  fi
  echo "== ${bazel} not found: ${as_root[*]:+${as_root[*]} }apt-get install bazel-bootstrap"
  local -a apt=(${as_root[@]+"${as_root[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get -qq)
  if ! "${apt[@]}" update >/dev/null || \
     ! "${apt[@]}" install -y --no-install-recommends bazel-bootstrap >/dev/null; then
    echo "apt-get install bazel-bootstrap failed (see above): install it, or Bazel, then re-run"
    return 1
  fi
  if ! command -v "${bazel}" >/dev/null 2>&1; then
    echo "bazel-bootstrap is installed, but ${bazel} is still not on PATH"
    return 1
  fi
}
