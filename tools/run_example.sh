#!/usr/bin/env bash
# Sets up the environment (tools/setup_env.sh) and runs the main job,
# examples/moe_layer.py: on 8 CPU devices on a machine without GPUs, one process
# per GPU (python -m jax_ep.launch) on a machine with two or more.
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
