"""The multi-process GPU suite (tests/gpu) on CPU processes with the portable backend.

The same test logic that runs against the CUDA kernels on GPU machines runs
here under the launcher, against the host oracle: on 2 processes the whole
suite, including the 1000-call tests and the 10,000-call pressure test with
its golden hashes; on 4 processes all but those three. Each rank must pass at
least the given number of tests and skip none, so the run cannot pass vacuously.
"""

import os
import re
import subprocess
import sys

import pytest

import cpu_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = "not 1000_calls and not 10000_calls"


# The counts of 2026-12-01 (6ba071e): 58 and 58 (the pre-summed combine's tests included).
@pytest.mark.parametrize("num_processes,select,min_tests", [(2, None, 58), (4, LONG, 58)],
                         ids=["2_processes_whole_suite", "4_processes_without_long_tests"])
def test_gpu_suite_passes_on_cpu_processes(num_processes, select, min_tests):
  # CHECK_CUDA_LOWERING: every test program, lowered for the CUDA backend too, must hold
  # no XLA collective (the one-GPU mode cannot run one).
  env = dict(os.environ, JAX_EP_GPU_TESTS_ON_CPU="1", JAX_PLATFORMS="cpu",
             JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING="1")
  env["XLA_FLAGS"] = cpu_flags.FAST_COMPILE  # one CPU device per process, as on the GPU machine
  env.pop("JAX_EP_GPUS_SHARED", None)
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.launch", "-n", str(num_processes), "-m", "pytest",
       "tests/gpu", "-q", "-p", "no:cacheprovider"] + (["-k", select] if select else []),
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
