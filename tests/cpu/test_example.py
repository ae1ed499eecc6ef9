"""The README's main job: examples/moe_layer.py runs and matches the dense layer."""

import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")


def _run(name: str, args: list[str]) -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  result = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)] + args, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.strip().endswith("OK")
  return result.stdout


@pytest.mark.parametrize("args", [[], ["--dtype=bfloat16", "--tokens_per_rank=32"]])
def test_moe_layer_example(args):
  assert "routing identical to dense: True" in _run("moe_layer.py", args)


@pytest.mark.parametrize("args", [[], ["--fp8"]])
def test_overlap_example(args):
  assert "max |diff| = 0.000e+00" in _run("ll_overlap.py", args)
