#!/usr/bin/env bash
# One command for the GPU machine: build in place, run the GPU tests, run the
# benchmarks, print a short table last. Logs and JSON go to $OUT (default
# /tmp/jax_ep_gpu_check), packed at the end (a device call returns at most 8
# files): the logs in logs.tar.gz, the bench JSONs in results.tar.gz, beside
# summary.txt, machine.txt and the PNGs.
#
#   tools/gpu_check.sh one-gpu [PHASE ...]
#     ONE GPU shared by N processes (NVSHMEM's limited MPG mode): correctness
#     only, never speed. PHASEs (default: all of them; qp only when the bundle
#     .carry/nvshmem-qp.tar.xz was carried):
#       n1        tests/gpu in one process alone on the GPU (EP1: the kernels'
#                 local path), XLA command buffers on and off
#       n2 n4 n8  tests/gpu at N = 2, 4, 8 processes, XLA command buffers on and
#                 off, without the 1000- and 10,000-call tests
#       long      those, at N = 2 with command buffers on
#       rdma      every other PE looks reachable only by RDMA
#                 (JAX_EP_TESTING_RDMA_PEERS=all): the LL suite (the pre-summed
#                 combine too) and the HT ops' documented behaviour, at N = 2 and 4
#       faults    tests/gpu_faults at N = 2, one launcher run per test, the
#                 killed-process tests with --keep_going and
#                 JAX_ENABLE_RECOVERABILITY=1
#       fuzz      tests/gpu_fuzz/schedule_fuzz.py (random programs of jax_ep ops,
#                 checked against the host oracle) at N = 2, 4, 8, FUZZ_BUDGET_S
#                 (default 90) each; FUZZ_SEED (default: the clock)
#       qp        jax_ep rebuilt against the carried NVSHMEM 3.8.0 (per-QP API,
#                 tools/nvshmem_qp_bundle.sh), then the rdma LL suite at N = 2
#                 (runs last: it replaces the build)
#       example   examples/moe_layer.py and examples/readme_use.py in one process
#       ep1bench  jax_ep.bench --mode ht --layouts and --mode ll in one process
#                 alone on the GPU (EP1: these times are speeds); EP1_BENCH_MODES
#                 (default "ht ll"), EP1_BENCH_RUNS (default 1; more: their
#                 medians by python -m benchmarks.medians) and EP1_BENCH_ARGS
#                 (more bench flags, e.g. --nobaselines)
#       ep1compare the ep1bench medians of this tree against a base commit's, both
#                 built in this call, runs alternating; benchmarks.compare flags a
#                 median more than 3% slower (not in the default phases; needs
#                 .carry/base.tar.gz and BASE_COMMIT: tools/gpu_check_one_gpu.sh)
#       layerbench jax_ep.bench --mode gmm and --mode layer in one process alone
#                 on the GPU (EP1 speeds; not in the default phases); tokamax
#                 rows when its wheels are carried in .whl; with JAX_EP_TIMELINE=1
#                 through benchmarks.probe: each layer row's kernel timeline
#       transformer examples/moe_transformer.py with --grouped_matmul xla, then
#                 auto, in one process alone on the GPU (tokens/s of each; not
#                 in the default phases; optax from .whl if the machine lacks it)
#       nvshmem4py nvshmem4py starts NVSHMEM, jax_ep joins it (tests/gpu_nvshmem4py;
#                 needs the nvshmem4py-cu13, cuda-core, cuda-bindings and
#                 cuda-pathfinder wheels carried in .whl)
#   tools/gpu_check.sh [all|tests|bench|ll|ht|faults|build] [quick]
#     one process per GPU (2 or more GPUs): machine.txt, build.log,
#     tests_cmdbuf_{on,off}.log, bench.log, the bench's
#     <mode>_<date>_<commit>.json (ll, ht, ht-ragged; jax_ep/bench/provenance.py;
#     without .git on the GPU machine, JAX_EP_BENCH_COMMIT names the commit) and
#     the HT JSON's charts (benchmarks/), ht_sweep.png and ht_sweep_ops.png.
#     ll / ht: that family's tests and benchmark; tests / bench: one half;
#     faults: only the fault-injection and masking tests; build: only the
#     build; quick: skip the long repeated-call tests, the HT sweeps and the
#     ragged_all_to_all baseline.
# The ragged_all_to_all baseline runs last, in its own process under a time
# limit (RAGGED_TIMEOUT_S, default 240 s; 0 skips it): once it ran for minutes
# without finishing, and a stall there must not cost the other numbers.
#
# Python is the machine's python3 (jax 0.11.2, NVSHMEM wheel, nanobind,
# scikit-build-core preinstalled); nothing is downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
QUICK=${2:-}
OUT=${OUT:-/tmp/jax_ep_gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# NVLink multicast must stay off on shared machines; never disable P2P here.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1
SUMMARY="$(mktemp)"
: > "$SUMMARY"
: > "$OUT/bench.log"
status=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# At most 8 files come back from a device call: the logs travel as logs.tar.gz
# and the bench JSONs as results.tar.gz; summary.txt, machine.txt and the PNGs
# stay as they are.
pack_out() {
  cp "$SUMMARY" "$OUT/summary.txt"
  (
    cd "$OUT" || exit
    shopt -s nullglob
    logs=(./*.log) jsons=(./*.json ./compare_*/*.json)   # ep1compare: one folder a side
    if (( ${#logs[@]} )); then tar -czf logs.tar.gz "${logs[@]}" && rm -f "${logs[@]}"; fi
    if (( ${#jsons[@]} )); then tar -czf results.tar.gz "${jsons[@]}" && rm -f "${jsons[@]}"; fi
  )
}

start=$(date +%s)
# The commit the JSONs are named by (jax_ep/bench/provenance.py). The device
# machine's copy of the tree has no .git, so the caller names it:
#   JAX_EP_BENCH_COMMIT=$(git rev-parse --short HEAD) tools/gpu_check.sh ...
if [[ -n "${JAX_EP_BENCH_COMMIT:-}" ]]; then
  note "commit: $JAX_EP_BENCH_COMMIT (JAX_EP_BENCH_COMMIT)"
elif head=$(git rev-parse --short HEAD 2>/dev/null); then
  note "commit: $head (from the .git here; on the device machine it can be stale:" \
       "JAX_EP_BENCH_COMMIT wins over it)"
else
  note "commit: UNKNOWN: no .git here and JAX_EP_BENCH_COMMIT is not set; the bench" \
       "JSONs will be named <mode>_<date>_unknown.json and cannot be cited"
fi
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } \
    > "$OUT/machine.txt" 2>&1
echo "== build (JAX_EP_CUDA=ON, in place)"
if ! JAX_EP_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir \
      -Cbuild-dir=build/gpu -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  note "build: FAILED (see build.log)"
  exit 1
fi
"$PY" - <<'PY' | tee -a "$SUMMARY"
from jax_ep import _extension
m = _extension.cuda_module()
print("build: ok; CUDA extension:", _extension.cuda_module_status(),
      "| NVSHMEM loaded", m.nvshmem_loaded_version() if m else None,
      "compiled", m.nvshmem_compiled_version() if m else None,
      "QP API", m.has_qp_api() if m else None)
PY
note "build time: $(( $(date +%s) - start )) s"
[[ "$WHAT" == build ]] && exit 0

if [[ "$WHAT" == one-gpu ]]; then
  shift
  source tools/gpu_check_one_gpu.sh
  run_one_gpu "$@"
  note "total time: $(( $(date +%s) - start )) s"
  pack_out
  echo
  echo "==================== summary ===================="
  cat "$SUMMARY"
  exit $status
fi

run_tests() {  # $1 = label, $2 = pytest -k expression ("" = all), $3 = test path, rest = env
  local label=$1 filter=$2 path=$3
  shift 3
  local log="$OUT/tests_${label}.log"
  env "$@" "$PY" -m jax_ep.launch -n 2 -m pytest "$path" -q -s -p no:cacheprovider \
      ${filter:+-k "$filter"} > "$log" 2>&1
  local rc=$?
  local line
  line=$(grep -E "^\[rank 0\] .*[0-9]+ (passed|failed|error)" "$log" | tail -1)
  note "tests ($label): rc=$rc ${line#\[rank 0\] }"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E "FAILED|Error|error" "$log" | head -20
  fi
}

case "$WHAT" in
  ll) test_path=tests/gpu/test_ll_gpu.py ;;
  ht) test_path=tests/gpu/test_ht_gpu.py ;;
  *) test_path=tests/gpu ;;
esac
long_tests="not 1000 and not 10000"
if [[ "$WHAT" != bench && "$WHAT" != faults ]]; then
  run_tests cmdbuf_on "${QUICK:+$long_tests}" "$test_path" XLA_FLAGS="${XLA_FLAGS:-}"
  run_tests cmdbuf_off "$long_tests" "$test_path" \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
fi
if [[ "$WHAT" == all || "$WHAT" == tests || "$WHAT" == faults ]]; then
  # Fault injection: each test leaves its EP group out of step, so one
  # launcher run per test (tests/gpu_faults/conftest.py).
  for fault in ll ht protocol_fault masked_rank_is_skipped mask_on_timeout; do
    run_tests "faults_$fault" "$fault" tests/gpu_faults XLA_FLAGS="${XLA_FLAGS:-}"
    grep -E "^\[rank 0\] (time to error|next call refused|finalize after|first call|then )" \
        "$OUT/tests_faults_$fault.log" | sed 's/^\[rank 0\] /  /' | tee -a "$SUMMARY"
  done
  # The status check's execute stage alone (no prepare stage, no command buffers).
  run_tests faults_protocol_fault_no_prepare protocol_fault_without_the_prepare_stage \
      tests/gpu_faults JAX_EP_PREPARE_STATUS_CHECK=0 \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
fi

# $1 = mode, rest = extra flags; output streams into $OUT/bench.log as it runs.
# BENCH_JSON: the JSON it wrote ("" if none).
bench() {
  local mode=$1
  shift
  local start_line
  start_line=$(( $(wc -l < "$OUT/bench.log" 2>/dev/null || echo 0) + 1 ))
  timeout "${BENCH_TIMEOUT_S:-900}" "$PY" -m jax_ep.launch -n 2 -m jax_ep.bench --mode "$mode" \
      --out_dir "$OUT" "$@" >> "$OUT/bench.log" 2>&1 \
      || { status=1; note "bench $mode $*: FAILED or timed out"; \
           tail -n +"$start_line" "$OUT/bench.log" | grep -v "^\[rank [01]\] [IW]1" | tail -15; }
  tail -n +"$start_line" "$OUT/bench.log" | grep -E "^\[rank 0\] " | sed 's/^\[rank 0\] //' \
      | sed -n '/^jax_ep bench/,$p' >> "$SUMMARY"
  BENCH_JSON=$(tail -n +"$start_line" "$OUT/bench.log" | sed -n 's/^\[rank 0\] results: //p' \
      | tail -1)
}

# $1 = benchmarks module (plot, plot_sweep, ...), $2 = PNG: the chart of the last
# bench's JSON (benchmarks/README.md); its output goes to $OUT/bench.log.
chart() {
  if [[ -z "${BENCH_JSON:-}" ]]; then
    status=1
    note "chart $1: the bench wrote no JSON"
    return
  fi
  "$PY" -m "benchmarks.$1" "$BENCH_JSON" --out "$2" >> "$OUT/bench.log" 2>&1 \
      || { status=1; note "chart $1 of $BENCH_JSON: FAILED"; tail -3 "$OUT/bench.log"; }
}

if [[ "$WHAT" == all || "$WHAT" == bench || "$WHAT" == ll ]]; then bench ll; fi
if [[ ( "$WHAT" == all || "$WHAT" == bench || "$WHAT" == ht ) && -f jax_ep/bench/ht.py ]]; then
  if [ -n "$QUICK" ]; then
    bench ht
  else
    bench ht --sm_sweep 8,16,24,32,48 --sweep
    chart plot_sweep "$OUT/ht_sweep.png"
    chart plot "$OUT/ht_sweep_ops.png"
    if [[ "${RAGGED_TIMEOUT_S:-240}" != 0 ]]; then
      # XLA's multi-process NCCL send/recv fallback hangs on a second execution
      # (jax 0.11.2); the dense decomposer runs (tools/ragged_probe.sh, 2026-11-30).
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true" \
          BENCH_TIMEOUT_S=${RAGGED_TIMEOUT_S:-240} bench ht --ragged
    fi
  fi
fi

note "total time: $(( $(date +%s) - start )) s"
pack_out
echo
echo "==================== summary ===================="
cat "$SUMMARY"
exit $status
