#!/usr/bin/env bash
# Packs NVSHMEM with the per-QP API (nvidia-nvshmem-cu13 3.8.0) for the GPU
# machine, which has 3.4.5 and no network: only what building and running
# jax_ep against it needs (headers, libnvshmem_device.a, libnvshmem_host.so.3,
# the unique-id bootstrap plugin), xz-compressed, into
# .carry/nvshmem-qp.tar.xz (ignored by git; carry ".carry" with the device
# call). tools/gpu_check.sh qp unpacks it, builds jax_ep against it and runs
# the LL suite with the RDMA QP branch (docs/reliability.md).
#   tools/nvshmem_qp_bundle.sh [python]   # needs pip and PyPI here
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PIN="nvidia-nvshmem-cu13==3.8.0"
OUT_DIR=.carry
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
"${PY}" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${PIN}" -d "${work}" >/dev/null
wheel=("${work}"/nvidia_nvshmem_cu13-*.whl)
mkdir -p "${work}/nvshmem"
"${PY}" - "${wheel[0]}" "${work}/nvshmem" <<'PYEOF'
import os, shutil, sys, zipfile
wheel, dest = sys.argv[1:3]
prefix = "nvidia/nvshmem/"
keep_libs = {"lib/libnvshmem_device.a", "lib/libnvshmem_host.so.3", "lib/nvshmem_bootstrap_uid.so.3"}
with zipfile.ZipFile(wheel) as z:
  for info in z.infolist():
    name = info.filename
    if info.is_dir() or not name.startswith(prefix):
      continue
    rel = name[len(prefix):]
    if not (rel.startswith("include/") or rel in keep_libs):
      continue
    if rel.startswith("/") or ".." in rel.split("/"):
      sys.exit("unsafe path in wheel: " + name)
    target = os.path.join(dest, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with z.open(info) as src, open(target, "wb") as dst:
      shutil.copyfileobj(src, dst)
missing = [lib for lib in keep_libs if not os.path.exists(os.path.join(dest, lib))]
if missing:
  sys.exit(f"the wheel lacks {missing}")
PYEOF
echo "${PIN}" > "${work}/nvshmem/VERSION"
mkdir -p "${OUT_DIR}"
tar -C "${work}" -cJf "${OUT_DIR}/nvshmem-qp.tar.xz" nvshmem
ls -l "${OUT_DIR}/nvshmem-qp.tar.xz"
