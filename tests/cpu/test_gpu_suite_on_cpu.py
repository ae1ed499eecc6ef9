"""The multi-process GPU suite (tests/gpu) on CPU processes with the portable backend.

The same test logic that runs against the CUDA kernels on GPU machines runs
here under the launcher, against the host oracle: on 2 processes the whole
suite, including the 1000-call tests and the 10,000-call pressure test with
its golden hashes; on 4 processes all but those three. Each runs in two parts
of about equal time, HEAVY_FILES and every other file, one launch each (and a
Bazel shard each: the test command's two cores stay busy to its end). Each
rank must pass at least the given number of tests and skip none, so a run
cannot pass vacuously.
"""

import os
import re
import subprocess
import sys

import pytest

import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "not 1000_calls and not 10000_calls"
# About half of the suite's time on CPU processes (2026-12-07, 2 cores).
HEAVY_FILES = ("tests/gpu/test_expert_major_gpu.py", "tests/gpu/test_moe_layer_gpu.py",
               "tests/gpu/test_several_configs_gpu.py", "tests/gpu/test_pressure_gpu.py")
PARTS = {"heavy_files": list(HEAVY_FILES),
         "other_files": ["tests/gpu"] + [f"--ignore={f}" for f in HEAVY_FILES]}


# The counts of 2026-12-07 (8087f70): 21 + 92 on 2 processes, 20 + 93 on 4 (the
# EP-group tests run on 4 only, the long ones on 2 only).
@pytest.mark.parametrize("num_processes,part,select,min_tests", [
    (2, "heavy_files", None, 21), (2, "other_files", None, 92),
    (4, "heavy_files", LONG, 20), (4, "other_files", LONG, 93),
], ids=["2_processes_whole_suite_heavy_files", "2_processes_whole_suite_other_files",
        "4_processes_without_long_tests_heavy_files",
        "4_processes_without_long_tests_other_files"])
def test_gpu_suite_passes_on_cpu_processes(num_processes, part, select, min_tests):
  # CHECK_CUDA_LOWERING: every test program, lowered for the CUDA backend too, must hold
  # no XLA collective (the one-GPU mode cannot run one).
  env = dict(os.environ, JAX_EP_GPU_TESTS_ON_CPU="1", JAX_PLATFORMS="cpu",
             JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING="1")
  env["XLA_FLAGS"] = cpu_flags.FAST_COMPILE  # one CPU device per process, as on the GPU machine
  env.pop("JAX_EP_GPUS_SHARED", None)
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.launch", "-n", str(num_processes), "-m", "pytest",
       *PARTS[part], "-q", "-p", "no:cacheprovider"] + (["-k", select] if select else []),
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-6000:]
  summary = {int(rank): line for rank, line in
             re.findall(r"\[rank (\d+)\] (\d+ passed.* in [\d.]+s.*)", out)}
  assert sorted(summary) == list(range(num_processes)), out[-3000:]
  for rank, line in summary.items():
    passed = int(re.match(r"(\d+) passed", line).group(1))
    assert passed >= min_tests, (rank, line)  # the suite really ran
    assert not re.search(r"skipped|failed|error", line), (rank, line)
