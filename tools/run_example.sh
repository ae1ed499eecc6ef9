#!/usr/bin/env bash
# Sets up the environment (tools/setup_env.sh) and runs the main job,
# examples/moe_layer.py, where this machine's devices are:
#   no GPU     one process on 8 CPU devices (portable backend, float32);
#   one GPU    one process on it: a 1-device mesh on the CUDA backend (bfloat16);
#   2+ GPUs    one process per GPU under python -m jax_ep.launch (bfloat16).
# The example ends with OK, or MISMATCH (or FAILED when the kernels did not run on
# GPUs) and a non-zero exit status. Extra arguments go to the example.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_env.sh
num_gpus=0
if command -v nvidia-smi > /dev/null 2>&1; then
  num_gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
fi
if [ "$num_gpus" -ge 2 ]; then
  exec .venv/bin/python -m jax_ep.launch -n "$num_gpus" examples/moe_layer.py "$@"
fi
exec .venv/bin/python examples/moe_layer.py "$@"
