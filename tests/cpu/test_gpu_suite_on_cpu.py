"""The multi-process GPU suite (tests/gpu) on 2 CPU processes with the portable backend.

The same test logic that runs against the CUDA kernels on the GPU machine,
including the 10,000-call pressure test with its order-sensitive hashes, runs
here against the portable backend, under the launcher. The 1000-call kernel
stress tests are left to the GPU machine (they add nothing on the portable path).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_suite_passes_on_cpu_processes():
  env = dict(os.environ, JAX_EP_GPU_TESTS_ON_CPU="1", JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # one CPU device per process, as on the GPU machine
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.launch", "-n", "2", "-m", "pytest", "tests/gpu", "-q",
       "-p", "no:cacheprovider", "-k", "not 1000_calls"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-6000:]
  summary = re.findall(r"\[rank (\d)\] (\d+) passed", out)
  assert sorted(rank for rank, _ in summary) == ["0", "1"], out[-3000:]
  assert all(int(n) >= 20 for _, n in summary), summary  # the suite really ran
  assert not re.search(r"\[rank \d\] .*\d+ (failed|error)", out), out[-3000:]
