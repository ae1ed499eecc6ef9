#!/usr/bin/env bash
# Tries jax.lax.ragged_all_to_all across 2 processes (one GPU each) under several
# XLA flag variants, each under a time limit, and prints how far each got
# (tools/ragged_probe.py). On 2x H200 with jax 0.11.2 and the NCCL send/recv
# fallback, the second execution of a program never returned (2026-11-30).
# The variants come from reading XLA's ragged_all_to_all_thunk.cc: the fallback
# is documented there as slow and prone to hangs; the one-shot path needs the
# NVLink domain recognised (slice-size override); the decomposer avoids it.
# Logs: $OUT/ragged_probe_<variant>.log (OUT defaults to /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
LIMIT=${RAGGED_PROBE_TIMEOUT_S:-45}
export NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
declare -A variants=(
  [fallback]="--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"
  [one_shot_slice2]="--xla_gpu_unsupported_override_fast_interconnect_slice_size=2"
  [decomposer]="--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"
  [fallback_no_cmdbuf]="--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true --xla_gpu_enable_command_buffer="
)
for name in fallback one_shot_slice2 decomposer fallback_no_cmdbuf; do
  RAGGED_PROBE_FLAGS="${variants[$name]}" timeout "$LIMIT" python3 -m jax_ep.launch -n 2 \
      tools/ragged_probe.py "${RAGGED_PROBE_TOKENS:-4096}" > "$OUT/ragged_probe_$name.log" 2>&1
  rc=$?
  last=$(grep -E "^\[rank 0\] \[" "$OUT/ragged_probe_$name.log" | tail -1)
  err=$(grep -m1 -E "Error|error:|Unknown flag" "$OUT/ragged_probe_$name.log" | cut -c1-160)
  echo "ragged $name: rc=$rc last: ${last:-none} ${err:+| $err}"
done
