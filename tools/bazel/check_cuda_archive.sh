#!/usr/bin/env bash
# Test for //tools/bazel:cuda.bzl cuda_device_link outputs.
#   check_cuda_archive.sh <archive.a> <manifest>
# Checks that the archive holds one object per cuda/*.cu source plus the
# device-link object, and that the device-link object defines the
# __cudaRegisterLinkedBinary_* entry point every relocatable object needs.
# Manifest lines from the rule's expect_undefined / compile_checks add:
#   undefined <object> <symbol> <source>: the object references the symbol
#     (nm -u), i.e. the code calling it was compiled in;
#   compiled <object> <source> <text>: the object is in the archive, so the
#     source compiled, which proves <text> (e.g. a static_assert held).
# Writes a JUnit XML report (one test case per check) to $XML_OUTPUT_FILE.
set -uo pipefail

archive="$1"
manifest="$2"
xml="${XML_OUTPUT_FILE:-/dev/null}"

cases=()      # XML fragments
failures=0
skipped=0
total=0

xml_escape() {
  printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g'
}

pass_case() {  # name
  total=$((total + 1))
  echo "PASS  $1"
  cases+=("  <testcase classname=\"cuda_device_link\" name=\"$(xml_escape "$1")\"/>")
}

fail_case() {  # name message
  total=$((total + 1)); failures=$((failures + 1))
  echo "FAIL  $1: $2"
  cases+=("  <testcase classname=\"cuda_device_link\" name=\"$(xml_escape "$1")\"><failure message=\"$(xml_escape "$2")\"/></testcase>")
}

skip_case() {  # name message
  total=$((total + 1)); skipped=$((skipped + 1))
  echo "SKIP  $1: $2"
  cases+=("  <testcase classname=\"cuda_device_link\" name=\"$(xml_escape "$1")\"><skipped message=\"$(xml_escape "$2")\"/></testcase>")
}

write_xml() {
  {
    echo '<?xml version="1.0" encoding="UTF-8"?>'
    echo "<testsuites><testsuite name=\"cuda_device_link\" tests=\"${total}\" failures=\"${failures}\" errors=\"0\" skipped=\"${skipped}\">"
    printf '%s\n' "${cases[@]}"
    echo '</testsuite></testsuites>'
  } > "${xml}"
}
trap write_xml EXIT

status="$(sed -n 's/^status //p' "${manifest}")"
echo "$(sed -n 's/^nvcc //p' "${manifest}")"

case "${status}" in
  empty)
    skip_case "cuda sources" "no cuda/*.cu sources yet: nothing to compile"
    exit 0 ;;
  unavailable)
    skip_case "cuda sources" "CUDA toolchain unavailable: $(sed -n 's/^reason //p' "${manifest}")"
    exit 0 ;;
  available) ;;
  *)
    fail_case "manifest" "unexpected status '${status}' in ${manifest}"
    exit 1 ;;
esac

members="$(ar t "${archive}" 2>&1)" || { fail_case "archive" "ar t ${archive} failed: ${members}"; exit 1; }
workdir="$(mktemp -d "${TEST_TMPDIR:-/tmp}/cuda_check.XXXXXX")"
archive_abs="$(cd "$(dirname "${archive}")" && pwd)/$(basename "${archive}")"
(cd "${workdir}" && ar x "${archive_abs}") || { fail_case "archive" "ar x ${archive} failed"; exit 1; }

dlink="$(sed -n 's/^dlink //p' "${manifest}")"
if grep -qx "${dlink}" <<<"${members}" && [[ -s "${workdir}/${dlink}" ]]; then
  pass_case "device-link object ${dlink} present"
else
  fail_case "device-link object ${dlink} present" "not in ${archive} (members: ${members//$'\n'/ })"
fi
defined="$(nm --defined-only "${workdir}/${dlink}" 2>/dev/null | awk '{print $3}')"
if grep -q '^__cudaRegisterLinkedBinary_.*init_device_cu' <<<"${defined}"; then
  echo "      (NVSHMEM device library objects are linked in)"
fi

while read -r _ src obj; do
  name="${src} -> ${obj}"
  if ! grep -qx "${obj}" <<<"${members}"; then
    fail_case "${name}" "object missing from the archive"
    continue
  fi
  needed="$(nm -u "${workdir}/${obj}" | awk '{print $2}' | grep '^__cudaRegisterLinkedBinary_' || true)"
  if [[ -z "${needed}" ]]; then
    fail_case "${name}" "no __cudaRegisterLinkedBinary_* reference: not compiled with -rdc=true?"
    continue
  fi
  missing=""
  for sym in ${needed}; do
    grep -qx "${sym}" <<<"${defined}" || missing+=" ${sym}"
  done
  if [[ -n "${missing}" ]]; then
    fail_case "${name}" "not device-linked, ${dlink} lacks${missing}"
  else
    pass_case "${name}"
  fi
done < <(grep '^source ' "${manifest}")

while read -r _ obj sym src; do
  name="${src}: ${obj} references ${sym}"
  if [[ ! -s "${workdir}/${obj}" ]]; then
    fail_case "${name}" "object missing from the archive"
  elif nm -u "${workdir}/${obj}" | awk '{print $2}' | grep -qx "${sym}"; then
    pass_case "${name}"
  else
    fail_case "${name}" "nm -u ${obj} does not list ${sym}: the code calling it was compiled out"
  fi
done < <(grep '^undefined ' "${manifest}")

while read -r _ obj src text; do
  name="${src} compiled: ${text}"
  if [[ -s "${workdir}/${obj}" ]]; then
    pass_case "${name}"
  else
    fail_case "${name}" "${obj} missing from the archive"
  fi
done < <(grep '^compiled ' "${manifest}")

rm -rf "${workdir}"
echo "${total} check(s), ${failures} failed"
[[ ${failures} -eq 0 ]]
