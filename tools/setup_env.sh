#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment at <repo>/.venv and
# builds jax_ep into it in place.
#
#   tools/setup_env.sh            # idempotent; a re-run with nothing changed takes seconds
#   JAX_EP_CUDA=OFF tools/setup_env.sh   # AUTO (default) | ON | OFF, passed to CMake
#   JAX_EP_FORCE_REBUILD=1 tools/setup_env.sh
#
# Steps:
#   1. find Python 3.12 (python3.12 on PATH, else $(pyenv root)/versions/3.12*/bin/python3.12);
#   2. create .venv if missing;
#   3. pip install -r requirements-dev.txt (skipped while the file is unchanged);
#   4. pip install --no-build-isolation --no-deps -e . (skipped while the build
#      inputs -- CMakeLists.txt, cmake/, xla_ffi/, cuda/, pyproject.toml, the
#      jax_ep/ file list, JAX_EP_CUDA -- are unchanged and the module imports);
#   5. NVSHMEM with the per-QP API (nvidia-nvshmem-cu13==3.8.0), for Bazel's
#      compile-only check of the RDMA QP branch of cuda/ (//cuda:jax_ep_cuda_qp):
#      only its headers and libnvshmem_device.a, extracted into .venv/nvshmem-qp/,
#      never installed into site-packages (the runtime keeps requirements-dev.txt's
#      3.4.5). Skipped while .venv/nvshmem-qp/ holds that version.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv"
PY="${VENV}/bin/python"
REQ_STAMP="${VENV}/.jax_ep_requirements.stamp"
BUILD_STAMP="${VENV}/.jax_ep_build.stamp"

say() { echo "[setup_env] $*"; }
die() { echo "[setup_env] ERROR: $*" >&2; exit 1; }

cd "${REPO_ROOT}"

# ---------------------------------------------------------------- 1. Python 3.12
is_python312() {
  [[ -x "$1" ]] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1
}

find_python312() {
  local candidate root
  # python3.12 on PATH (a pyenv shim only counts if it resolves to a 3.12).
  if candidate="$(command -v python3.12 2>/dev/null)" && is_python312 "${candidate}"; then
    echo "${candidate}"; return 0
  fi
  local pyenv_root=""
  if command -v pyenv >/dev/null 2>&1; then
    pyenv_root="$(pyenv root 2>/dev/null || true)"
  fi
  for root in "${pyenv_root}" "${PYENV_ROOT:-}" "${HOME:-/root}/.pyenv"; do
    [[ -n "${root}" && -d "${root}/versions" ]] || continue
    while read -r candidate; do
      if is_python312 "${candidate}"; then echo "${candidate}"; return 0; fi
    done < <(ls -d "${root}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r)
  done
  return 1
}

if [[ ! -x "${PY}" ]]; then
  PYTHON312="$(find_python312)" || die "Python 3.12 not found: install it (python3.12 on PATH, or pyenv install 3.12) -- jax 0.11 needs Python >= 3.12"
  say "creating .venv with ${PYTHON312}"
  "${PYTHON312}" -m venv "${VENV}" || die "could not create ${VENV}"
  rm -f "${REQ_STAMP}" "${BUILD_STAMP}"
fi

PY_VERSION="$("${PY}" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')" \
  || die "${PY} does not run; delete .venv and re-run"
case "${PY_VERSION}" in
  3.12.*) ;;
  *) die ".venv has Python ${PY_VERSION}, need 3.12: delete .venv and re-run" ;;
esac
say "python ${PY_VERSION} in .venv"

# ---------------------------------------------------------------- 2. requirements
# Every `name==version` pin of requirements-dev.txt installed at that version?
requirements_satisfied() {
  "${PY}" - requirements-dev.txt <<'PYEOF' >/dev/null 2>&1
import re, sys
from importlib import metadata
for line in open(sys.argv[1]):
  line = line.split("#", 1)[0].strip()
  m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
  if not line:
    continue
  if not m:
    sys.exit(1)  # not a plain pin: let pip decide
  if metadata.version(m.group(1)) != m.group(2):
    sys.exit(1)
PYEOF
}

req_hash="$( { echo "${PY_VERSION}"; cat requirements-dev.txt; } | sha256sum | cut -d' ' -f1)"
if [[ -f "${REQ_STAMP}" && "$(cat "${REQ_STAMP}")" == "${req_hash}" ]] && requirements_satisfied; then
  say "requirements-dev.txt already installed"
else
  say "installing requirements-dev.txt (pip; the first time takes a few minutes)"
  rm -f "${REQ_STAMP}"
  log="${VENV}/.jax_ep_pip.log"
  if ! "${PY}" -m pip install --disable-pip-version-check -r requirements-dev.txt >"${log}" 2>&1; then
    tail -n 40 "${log}" >&2
    die "pip install -r requirements-dev.txt failed (full log: ${log})"
  fi
  echo "${req_hash}" > "${REQ_STAMP}"
  rm -f "${BUILD_STAMP}"   # new jaxlib etc.: rebuild the extension
fi

# ---------------------------------------------------------------- 3. build jax_ep
# Fingerprint of everything the compiled build depends on. Python sources are
# served from the source tree by the editable install, so only their names count.
build_inputs_hash() {
  {
    echo "python=${PY_VERSION} JAX_EP_CUDA=${JAX_EP_CUDA:-AUTO} req=${req_hash}"
    find CMakeLists.txt pyproject.toml cmake xla_ffi cuda -type f \
        ! -name '*.pyc' ! -path '*/__pycache__/*' ! -name 'BUILD.bazel' -print0 2>/dev/null \
      | LC_ALL=C sort -z | xargs -0 -r sha256sum
    find jax_ep -type f ! -name '*.pyc' ! -path '*/__pycache__/*' 2>/dev/null | LC_ALL=C sort
  } | sha256sum | cut -d' ' -f1
}
build_hash="$(build_inputs_hash)"

if [[ -z "${JAX_EP_FORCE_REBUILD:-}" && -f "${BUILD_STAMP}" && "$(cat "${BUILD_STAMP}")" == "${build_hash}" ]] \
   && "${PY}" -c 'import jax_ep._jax_ep_cpu' >/dev/null 2>&1; then
  say "jax_ep build is up to date"
else
  say "building jax_ep (pip install --no-build-isolation --no-deps -e ., JAX_EP_CUDA=${JAX_EP_CUDA:-AUTO})"
  rm -f "${BUILD_STAMP}"
  log="${VENV}/.jax_ep_build.log"
  if ! "${PY}" -m pip install --no-build-isolation --no-deps --disable-pip-version-check -v -e . >"${log}" 2>&1; then
    tail -n 60 "${log}" >&2
    die "building jax_ep failed (full log: ${log})"
  fi
  "${PY}" -c 'import jax_ep._jax_ep_cpu' || die "jax_ep built but jax_ep._jax_ep_cpu does not import"
  echo "${build_hash}" > "${BUILD_STAMP}"
  say "jax_ep built"
fi

# ---------------------------------------------------------------- 4. NVSHMEM with the QP API
# Compile-only: @nvshmem_qp (tools/bazel/repositories.bzl) reads this tree.
NVSHMEM_QP_PIN="nvidia-nvshmem-cu13==3.8.0"
NVSHMEM_QP_DIR="${VENV}/nvshmem-qp"
NVSHMEM_QP_STAMP="${NVSHMEM_QP_DIR}/.stamp"   # "<pin> sha256=<wheel digest>", written last

nvshmem_qp_present() {
  [[ -f "${NVSHMEM_QP_STAMP}" && "$(cut -d' ' -f1 "${NVSHMEM_QP_STAMP}")" == "${NVSHMEM_QP_PIN}" \
     && -f "${NVSHMEM_QP_DIR}/include/nvshmem.h" \
     && -f "${NVSHMEM_QP_DIR}/include/non_abi/nvshmem_version.h" \
     && -f "${NVSHMEM_QP_DIR}/lib/libnvshmem_device.a" ]]
}

if nvshmem_qp_present; then
  say "${NVSHMEM_QP_PIN} headers + libnvshmem_device.a already in .venv/nvshmem-qp"
else
  say "fetching ${NVSHMEM_QP_PIN} headers + libnvshmem_device.a into .venv/nvshmem-qp (compile-only; ~180 MB wheel, first time only)"
  download="${VENV}/.nvshmem-qp-download"
  staging="${NVSHMEM_QP_DIR}.partial"
  rm -rf "${download}" "${staging}"
  mkdir -p "${download}"
  log="${VENV}/.jax_ep_nvshmem_qp.log"
  if ! "${PY}" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
         "${NVSHMEM_QP_PIN}" -d "${download}" >"${log}" 2>&1; then
    tail -n 20 "${log}" >&2
    rm -rf "${download}"
    die "pip download ${NVSHMEM_QP_PIN} failed (full log: ${log})"
  fi
  wheels=("${download}"/nvidia_nvshmem_cu13-*.whl)
  [[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || die "pip download ${NVSHMEM_QP_PIN}: expected one wheel in ${download}"
  # Only nvidia/nvshmem/include/** and nvidia/nvshmem/lib/libnvshmem_device.a,
  # without the nvidia/nvshmem/ prefix.
  if ! "${PY}" - "${wheels[0]}" "${staging}" <<'PYEOF' >>"${log}" 2>&1; then
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1:3]
prefix = "nvidia/nvshmem/"
count = 0
with zipfile.ZipFile(wheel) as z:
  for info in z.infolist():
    name = info.filename
    if info.is_dir() or not name.startswith(prefix):
      continue
    rel = name[len(prefix):]
    if not (rel.startswith("include/") or rel == "lib/libnvshmem_device.a"):
      continue
    if rel.startswith("/") or ".." in rel.split("/"):
      sys.exit("unsafe path in wheel: " + name)
    target = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with z.open(info) as src, open(target, "wb") as dst:
      shutil.copyfileobj(src, dst)
    count += 1
print("extracted %d files" % count)
PYEOF
    tail -n 20 "${log}" >&2
    rm -rf "${download}" "${staging}"
    die "extracting ${wheels[0]} failed (full log: ${log})"
  fi
  digest="$(sha256sum "${wheels[0]}" | cut -d' ' -f1)"
  rm -rf "${NVSHMEM_QP_DIR}"
  mv "${staging}" "${NVSHMEM_QP_DIR}"
  echo "${NVSHMEM_QP_PIN} sha256=${digest}" > "${NVSHMEM_QP_STAMP}"
  rm -rf "${download}"   # the wheel is ~180 MB; the extracted tree is all Bazel needs
  nvshmem_qp_present || die "${NVSHMEM_QP_DIR} is incomplete after extracting ${NVSHMEM_QP_PIN}"
  say "${NVSHMEM_QP_PIN}: $(tail -n 1 "${log}") into .venv/nvshmem-qp"
fi

cuda_status="$("${PY}" -c 'from jax_ep import _extension as e; print(e.cuda_module_status())' 2>/dev/null || echo unknown)"
say "CUDA module: ${cuda_status}"
say "done: ${VENV}"
