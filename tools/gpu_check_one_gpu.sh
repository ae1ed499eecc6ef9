# Sourced by tools/gpu_check.sh one-gpu: the GPU suite with N processes on ONE
# GPU (NVSHMEM's limited MPG mode: PEs on one GPU are peer-mapped, so the
# kernels' NVLink code runs). Kernels of different processes take turns on the
# GPU, so nothing timed here is a speed; waits are longer (the tests' timeout_s
# is longer when the launcher marks the GPU shared). XLA collectives cannot run here (NCCL
# refuses two ranks on one GPU): the tests use host oracles.
# Uses from gpu_check.sh: PY, OUT, note, status.

# The suite at N = 1 took 231 s on one H100 on 2026-12-07 (the Mosaic GPU grouped-GEMM
# tests compile their kernels); the launcher's teardown comes after that.
ONE_GPU_SUITE_TIMEOUT_S=${ONE_GPU_SUITE_TIMEOUT_S:-420}
# The schedule fuzzer: its budget per N, and what its run's time limit adds to
# it (start-up, the last program, one timed-out wait of SHARED_GPU_TIMEOUT_S =
# 120 s in tests/gpu/gpu_testing.py, and the teardown).
FUZZ_BUDGET_S=${FUZZ_BUDGET_S:-90}
FUZZ_SLACK_S=${FUZZ_SLACK_S:-300}
QP_BUNDLE=.carry/nvshmem-qp.tar.xz

devices_for() {  # N -> "0,0,...,0"
  local n=$1 list=0 i
  for ((i = 1; i < n; i++)); do list="$list,0"; done
  echo "$list"
}

# $1 label, $2 N, $3 pytest path, $4 -k filter ("" = all), $5 extra launcher flags,
# rest: environment. Prints one summary line; the log is $OUT/<label>.log.
one_gpu_run() {
  local label=$1 n=$2 path=$3 filter=$4 launch_flags=$5
  shift 5
  local log="$OUT/$label.log" begin rc line
  begin=$(date +%s)
  # $path and $launch_flags may hold several words. shellcheck disable=SC2086
  env "$@" timeout "$ONE_GPU_SUITE_TIMEOUT_S" "$PY" -m jax_ep.launch -n "$n" \
      --devices "$(devices_for "$n")" $launch_flags -m pytest $path -q -s -p no:cacheprovider \
      ${filter:+-k "$filter"} > "$log" 2>&1
  rc=$?
  line=$(grep -E "^\[rank 0\] .*[0-9]+ (passed|failed|error|skipped)" "$log" | tail -1)
  note "$(printf '%-28s N=%d rc=%-3s %4ss  %s' "$label" "$n" "$rc" "$(( $(date +%s) - begin ))" \
      "${line#\[rank 0\] }")"
  if [ "$rc" -ne 0 ]; then
    status=1
    grep -E "FAILED|Error|error:|Timeout|timed out" "$log" | grep -v "^\[rank [0-9]\] [IW]1" \
        | head -12
  fi
  return "$rc"
}

LONG_TESTS="1000_calls or 10000_calls"

# ONE_GPU_CMDBUF: the XLA command-buffer settings the suite runs under (default "on off").
# ONE_GPU_SUITE_PATH: the tests it runs (default tests/gpu, e.g. one file of it).
one_gpu_suite() {  # N: the suite without the long tests, command buffers on and off
  local n=$1 cmdbuf path=${ONE_GPU_SUITE_PATH:-tests/gpu}
  for cmdbuf in ${ONE_GPU_CMDBUF:-on off}; do
    if [[ $cmdbuf == on ]]; then
      one_gpu_run "suite_n${n}_cmdbuf_on" "$n" "$path" "not ($LONG_TESTS)" "" \
          XLA_FLAGS="${XLA_FLAGS:-}"
    else
      one_gpu_run "suite_n${n}_cmdbuf_off" "$n" "$path" "not ($LONG_TESTS)" "" \
          XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
    fi
  done
}

one_gpu_long() {  # the 1000- and 10,000-call tests, at N=2 with command buffers on
  one_gpu_run "long_n2" 2 tests/gpu "$LONG_TESTS" "" XLA_FLAGS="${XLA_FLAGS:-}"
  grep -E "^\[rank [0-9]\] .*hash" "$OUT/long_n2.log" | head -4 | tee -a "$SUMMARY"
}

one_gpu_rdma() {
  local n
  for n in 2 4; do
    one_gpu_run "rdma_n${n}" "$n" \
        "tests/gpu/test_ll_gpu.py tests/gpu/test_ll_presummed_gpu.py tests/gpu/test_rdma_peers_gpu.py" \
        "not 1000_calls" "" JAX_EP_TESTING_RDMA_PEERS=all XLA_FLAGS="${XLA_FLAGS:-}"
  done
}

one_gpu_faults() {
  local fault
  for fault in ll_dispatch_skipped ht_dispatch_skipped protocol_fault masked_rank_is_skipped \
      mask_on_timeout; do
    one_gpu_run "faults_$fault" 2 tests/gpu_faults "$fault" "" XLA_FLAGS="${XLA_FLAGS:-}"
    grep -E "^\[rank 0\] (time to error|next call refused|finalize after|first call|then )" \
        "$OUT/faults_$fault.log" | sed 's/^\[rank 0\] /    /' | tee -a "$SUMMARY"
  done
  # The status check's execute stage alone (no prepare stage, no command buffers).
  one_gpu_run "faults_protocol_fault_no_prepare" 2 tests/gpu_faults \
      protocol_fault_without_the_prepare_stage "" JAX_EP_PREPARE_STATUS_CHECK=0 \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
  # The killed rank's launcher status is 137 (SIGKILL): what counts is that the
  # survivor's pytest passed and every process exited (the launcher returned).
  local before
  for fault in killed_peer_mid_call killed_peer_is_masked; do
    before=$status
    one_gpu_run "faults_$fault" 2 tests/gpu_faults "$fault" "--keep_going" \
        JAX_ENABLE_RECOVERABILITY=1 XLA_FLAGS="${XLA_FLAGS:-}"
    status=$before
    if grep -qE "^\[rank 0\] .*1 passed" "$OUT/faults_$fault.log" \
        && grep -q "rank 1 exited with status -9" "$OUT/faults_$fault.log"; then
      note "    survivor passed, rank 1 killed (-9), every process exited"
    else
      note "    FAILED: the survivor did not pass or rank 1 was not killed"
      status=1
    fi
    grep -E "^\[rank 0\] (call with a peer|loop with rank|finalize with)" \
        "$OUT/faults_$fault.log" | sed 's/^\[rank 0\] /    /' | tee -a "$SUMMARY"
  done
}

# tests/gpu_fuzz/schedule_fuzz.py at N = 2, 4, 8 (FUZZ_PROCESSES), FUZZ_BUDGET_S
# each; FUZZ_SEED (default: the clock) picks the programs. Each program's seed
# is in fuzz_n<N>.log; `schedule_fuzz.py --replay SEED` at the same N reruns it.
one_gpu_fuzz() {
  local seed=${FUZZ_SEED:-$(date +%s)} n log rc begin line
  for n in ${FUZZ_PROCESSES:-2 4 8}; do
    log="$OUT/fuzz_n${n}.log"
    begin=$(date +%s)
    timeout $(( FUZZ_BUDGET_S + FUZZ_SLACK_S )) "$PY" -m jax_ep.launch -n "$n" \
        --devices "$(devices_for "$n")" tests/gpu_fuzz/schedule_fuzz.py \
        --budget_s "$FUZZ_BUDGET_S" --seed "$seed" > "$log" 2>&1
    rc=$?
    line=$(grep -E "^\[rank 0\] schedule fuzz:" "$log" | tail -1)
    note "$(printf '%-28s N=%d rc=%-3s %4ss  %s' "fuzz_n${n}" "$n" "$rc" \
        "$(( $(date +%s) - begin ))" "${line#\[rank 0\] }")"
    if [ "$rc" -ne 0 ]; then
      status=1
      grep -E "FAILED|stopped after|Error|Timeout|timed out" "$log" \
          | grep -v "^\[rank [0-9]\] [IW]1" | cut -c1-400 | head -12
      # No summary line: the program that did not finish is the last one printed.
      [ -z "$line" ] && grep -E "^\[rank 0\] program [0-9]+ seed" "$log" | tail -1 | cut -c1-400 \
          | sed 's/^\[rank 0\] /    unfinished: /' | tee -a "$SUMMARY"
    fi
  done
}

one_gpu_example() {  # the main job and the README's snippet, one process on the GPU (EP1)
  local name log rc
  for name in moe_layer readme_use; do
    log="$OUT/example_${name}_ep1.log"
    timeout 300 "$PY" "examples/$name.py" > "$log" 2>&1
    rc=$?
    note "examples/$name.py (EP1, one process) rc=$rc: $(grep -vE "^[IWE][0-9]{4} " "$log" \
        | grep -E "backend|custom calls|OK|MISMATCH|out\[" | tail -3 | tr '\n' ' ')"
    [ "$rc" -ne 0 ] && status=1 && tail -20 "$log"
  done
  # The MoE transformer needs optax: the machine's, or a wheel carried in .whl.
  local site=()
  if ! "$PY" -c "import optax" > /dev/null 2>&1 && ls .whl/optax-* > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jax_ep_optax \
        .whl/optax-*.whl
    site=(PYTHONPATH="/tmp/jax_ep_optax:${PYTHONPATH:-}")
  fi
  log="$OUT/example_moe_transformer_ep1.log"
  env "${site[@]}" timeout 600 "$PY" examples/moe_transformer.py --plot "$OUT/moe_transformer.png" \
      > "$log" 2>&1
  rc=$?
  note "examples/moe_transformer.py (EP1, one process) rc=$rc: $(grep -E \
      "^(dense check|step +[0-9]+/|learning|OK|MISMATCH|NO LEARNING)" "$log" | tail -4 | tr '\n' ' ')"
  [ "$rc" -ne 0 ] && status=1 && tail -20 "$log"
}

# examples/moe_transformer.py's training speed with its experts on each grouped
# matmul (--grouped_matmul xla: jax.lax.ragged_dot; auto: the Pallas Hopper
# kernels), one process alone on the GPU (EP1): tokens/s of each, same steps.
# TRANSFORMER_ARGS: more flags of both runs.
one_gpu_transformer() {
  local site=() gmm log rc
  if ! "$PY" -c "import optax" > /dev/null 2>&1 && ls .whl/optax-* > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jax_ep_optax \
        .whl/optax-*.whl
    site=(PYTHONPATH="/tmp/jax_ep_optax:${PYTHONPATH:-}")
  fi
  for gmm in xla auto; do
    log="$OUT/example_moe_transformer_gmm_${gmm}.log"
    # TRANSFORMER_ARGS may hold several flags. shellcheck disable=SC2086
    env "${site[@]}" timeout "${BENCH_TIMEOUT_S:-600}" "$PY" examples/moe_transformer.py \
        --grouped_matmul "$gmm" ${TRANSFORMER_ARGS:-} > "$log" 2>&1
    rc=$?
    note "moe_transformer --grouped_matmul $gmm (EP1) rc=$rc: $(grep -E \
        "^(step +[0-9]+/|OK|MISMATCH|NO LEARNING)" "$log" | tail -2 | tr '\n' ' ')"
    [ "$rc" -ne 0 ] && status=1 && grep -vE "^[IWE][0-9]{4} " "$log" | tail -15
  done
}

# EP1_BENCH_MODES (default "ht ll") and EP1_BENCH_RUNS (default 1): the
# targets are medians of >= 5 runs (python -m benchmarks.medians over the JSONs).
# EP1_BENCH_ARGS: more bench flags (--nobaselines: no portable rows, quick runs).
one_gpu_ep1_bench() {  # one process alone on the GPU (EP1): a speed measurement, unlike the rest
  local mode log rc run
  for ((run = 1; run <= ${EP1_BENCH_RUNS:-1}; run++)); do
    for mode in ${EP1_BENCH_MODES:-ht ll}; do
      log="$OUT/bench_ep1_${mode}_${run}.log"
      # EP1_BENCH_ARGS may hold several flags. shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT_S:-600}" "$PY" -m jax_ep.bench --mode "$mode" --out_dir "$OUT" \
          $([[ $mode == ht ]] && echo --layouts) ${EP1_BENCH_ARGS:-} > "$log" 2>&1
      rc=$?
      note "bench --mode $mode (EP1, one process, run $run) rc=$rc"
      sed -n '/^jax_ep bench/,$p' "$log" | grep -v "^in-kernel profile" | tee -a "$SUMMARY"
      [ "$rc" -ne 0 ] && status=1 && grep -v "^[IW][0-9]\{4\} " "$log" | tail -15
    done
  done
  if [[ ${EP1_BENCH_RUNS:-1} -gt 1 ]]; then
    for mode in ${EP1_BENCH_MODES:-ht ll}; do
      "$PY" -m benchmarks.medians "$OUT/${mode}"_*.json | tee -a "$SUMMARY"
    done
  fi
}

# The EP1 medians of this tree against a base commit's, in one device call: both
# built here, their runs alternating (base, head) so that machine and clocks are the
# same for both; then benchmarks.compare (SLOWER: a head median more than
# COMPARE_TOLERANCE, default 0.03, over the base's). Needs the base's source carried:
#   git archive --format=tar.gz -o .carry/base.tar.gz BASE    (carry [".carry"])
# and BASE_COMMIT=<its short hash>. EP1_BENCH_MODES (default "ht ll"), EP1_BENCH_RUNS
# (default 5), EP1_BENCH_ARGS as for ep1bench.
one_gpu_ep1_compare() {
  local base_src=/tmp/jax_ep_base_src base_site=/tmp/jax_ep_base_site run mode side log rc
  if [[ ! -f .carry/base.tar.gz || -z "${BASE_COMMIT:-}" ]]; then
    note "ep1compare: skipped (needs .carry/base.tar.gz, git archive of the base, and BASE_COMMIT)"
    status=1
    return
  fi
  rm -rf "$base_src" "$base_site" && mkdir -p "$base_src" && tar -xzf .carry/base.tar.gz -C "$base_src"
  # The base is installed into its own folder and run from outside the tree with
  # that folder on PYTHONPATH; the tree's in-place build serves the head's runs.
  if ! (cd "$base_src" && JAX_EP_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps \
        --no-cache-dir --target "$base_site" . > "$OUT/build_base.log" 2>&1); then
    note "ep1compare: build of $BASE_COMMIT FAILED (build_base.log)"
    status=1
    tail -30 "$OUT/build_base.log"
    return
  fi
  mkdir -p "$OUT/compare_base" "$OUT/compare_head"
  for ((run = 1; run <= ${EP1_BENCH_RUNS:-5}; run++)); do
    for mode in ${EP1_BENCH_MODES:-ht ll}; do
      for side in base head; do
        log="$OUT/compare_${side}_${mode}_${run}.log"
        # EP1_BENCH_ARGS may hold several flags. shellcheck disable=SC2086
        if [[ $side == base ]]; then
          (cd /tmp && PYTHONPATH="$base_site" JAX_EP_BENCH_COMMIT="$BASE_COMMIT" \
              timeout "${BENCH_TIMEOUT_S:-600}" "$PY" -m jax_ep.bench --mode "$mode" \
              --out_dir "$OUT/compare_base" $([[ $mode == ht ]] && echo --layouts) \
              ${EP1_BENCH_ARGS:-}) > "$log" 2>&1
        else
          timeout "${BENCH_TIMEOUT_S:-600}" "$PY" -m jax_ep.bench --mode "$mode" \
              --out_dir "$OUT/compare_head" $([[ $mode == ht ]] && echo --layouts) \
              ${EP1_BENCH_ARGS:-} > "$log" 2>&1
        fi
        rc=$?
        note "ep1compare run $run, $mode, $side rc=$rc"
        [ "$rc" -ne 0 ] && status=1 && grep -v "^[IW][0-9]\{4\} " "$log" | tail -8
      done
    done
  done
  for mode in ${EP1_BENCH_MODES:-ht ll}; do
    "$PY" -m benchmarks.compare --base "$OUT/compare_base/${mode}"_*.json \
        --head "$OUT/compare_head/${mode}"_*.json --tolerance "${COMPARE_TOLERANCE:-0.03}" \
        --out "$OUT/compare_${mode}.json" | tee -a "$SUMMARY"
    [ "${PIPESTATUS[0]}" -ne 0 ] && status=1
  done
}

# The MoE layer's speed (one process alone on the GPU, EP1): bench --mode gmm
# (the expert GEMMs' products on every implementation; tokamax when its wheels
# were carried in .whl) and bench --mode layer (the layer against MaxText's
# algorithm and the floor, with its chart, moe_layer_ep1.png, drawn from its JSON
# by benchmarks/plot_layer.py). LAYER_BENCH_MODES: which (default "gmm layer");
# LAYER_BENCH_ARGS: more flags of both.
one_gpu_layer_bench() {
  local site=() mode log rc json
  if ls .whl/tokamax-* > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jax_ep_bench_site \
        .whl/*.whl > "$OUT/bench_site.log" 2>&1
    site=(PYTHONPATH="/tmp/jax_ep_bench_site:${PYTHONPATH:-}")
  fi
  # JAX_EP_TIMELINE=1: the layer's rows with their kernel timelines (benchmarks/probe.py).
  local bench=jax_ep.bench
  [[ "${JAX_EP_TIMELINE:-}" == 1 ]] && bench=benchmarks.probe
  for mode in ${LAYER_BENCH_MODES:-gmm layer}; do
    log="$OUT/bench_ep1_${mode}.log"
    # LAYER_BENCH_ARGS may hold several flags. shellcheck disable=SC2086
    env "${site[@]}" timeout "${BENCH_TIMEOUT_S:-600}" "$PY" -m "$bench" --mode "$mode" \
        --out_dir "$OUT" ${LAYER_BENCH_ARGS:-} > "$log" 2>&1
    rc=$?
    note "bench --mode $mode (EP1, one process, $bench) rc=$rc"
    grep -E "^(forward|forward_backward|gate_up|down) " "$log" | tee -a "$SUMMARY"
    [ "$rc" -ne 0 ] && status=1 && grep -v "^[IW][0-9]\{4\} " "$log" | tail -15
    json=$(sed -n 's/^results: //p' "$log" | tail -1)
    # A run stopped by its time limit leaves its JSON of the rows so far ("complete": false).
    [[ -z "$json" ]] && json=$(ls -t "$OUT/${mode}"_*.json 2>/dev/null | head -1)
    if [[ $mode == layer && -n "$json" ]] && ! "$PY" -m benchmarks.plot_layer "$json" \
        --out "$OUT/moe_layer_ep1.png" >> "$log" 2>&1; then
      status=1
      note "chart of $json: FAILED"
      tail -3 "$log"
    fi
  done
}

one_gpu_qp() {
  if [[ ! -f "$QP_BUNDLE" ]]; then
    note "qp: skipped ($QP_BUNDLE was not carried; tools/nvshmem_qp_bundle.sh makes it)"
    return
  fi
  local dir=/tmp/jax_ep_nvshmem_qp
  rm -rf "$dir" && mkdir -p "$dir" && tar -C "$dir" -xJf "$QP_BUNDLE"
  if ! JAX_EP_CUDA=ON "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir \
        -Cbuild-dir=build/gpu-qp -Ccmake.define.JAX_EP_NVSHMEM_DIR="$dir/nvshmem" -e . \
        > "$OUT/build_qp.log" 2>&1; then
    note "qp: build against $(cat "$dir/nvshmem/VERSION") FAILED (build_qp.log)"
    status=1
    tail -30 "$OUT/build_qp.log"
    return
  fi
  local env_qp=(JAX_EP_NVSHMEM_HOST_LIB="$dir/nvshmem/lib/libnvshmem_host.so.3"
                LD_LIBRARY_PATH="$dir/nvshmem/lib:${LD_LIBRARY_PATH:-}")
  env "${env_qp[@]}" "$PY" - <<'PY' 2>&1 | tee -a "$SUMMARY"
from jax_ep import _extension
m = _extension.cuda_module()
print("qp build:", _extension.cuda_module_status(), "| NVSHMEM loaded",
      m.nvshmem_loaded_version() if m else None, "compiled",
      m.nvshmem_compiled_version() if m else None, "QP API", m.has_qp_api() if m else None)
PY
  one_gpu_run "qp_rdma_n2" 2 "tests/gpu/test_ll_gpu.py tests/gpu/test_rdma_peers_gpu.py" \
      "not 1000_calls" "" JAX_EP_TESTING_RDMA_PEERS=all "${env_qp[@]}" XLA_FLAGS="${XLA_FLAGS:-}"
  grep -E "nvshmemx_qp_create|QP" "$OUT/qp_rdma_n2.log" | grep -v "^\[rank [0-9]\] [IW]1" \
      | head -5 | tee -a "$SUMMARY"
}

one_gpu_nvshmem4py() {  # needs the nvshmem4py-cu13 wheel carried in .whl (see below)
  if ! ls .whl/nvshmem4py* > /dev/null 2>&1; then
    note "nvshmem4py: skipped (no .whl/nvshmem4py*: pip download --no-deps --only-binary=:all:"
    note "    --python-version 3.12 -d .whl nvshmem4py-cu13==0.4.1 cuda-core~=0.5.0 cuda-bindings~=13.0.0"
    note "    cuda-pathfinder)"
    return
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/jax_ep_site .whl/*.whl
  one_gpu_run "nvshmem4py_n2" 2 tests/gpu_nvshmem4py "" "" \
      PYTHONPATH="/tmp/jax_ep_site:${PYTHONPATH:-}" XLA_FLAGS="${XLA_FLAGS:-}"
}

run_one_gpu() {
  local phases=("$@") phase
  if [[ ${#phases[@]} -eq 0 ]]; then
    phases=(n1 n2 n4 n8 long rdma faults fuzz example ep1bench nvshmem4py)
    [[ -f "$QP_BUNDLE" ]] && phases+=(qp)
  fi
  note "one GPU, several processes: correctness only"
  for phase in "${phases[@]}"; do
    case "$phase" in
      n1) one_gpu_suite 1 ;;
      n2) one_gpu_suite 2 ;;
      n4) one_gpu_suite 4 ;;
      n8) one_gpu_suite 8 ;;
      long) one_gpu_long ;;
      rdma) one_gpu_rdma ;;
      faults) one_gpu_faults ;;
      fuzz) one_gpu_fuzz ;;
      example) one_gpu_example ;;
      ep1bench) one_gpu_ep1_bench ;;
      ep1compare) one_gpu_ep1_compare ;;
      layerbench) one_gpu_layer_bench ;;
      transformer) one_gpu_transformer ;;
      qp) one_gpu_qp ;;
      nvshmem4py) one_gpu_nvshmem4py ;;
      *) note "unknown phase $phase"; status=1 ;;
    esac
  done
}
