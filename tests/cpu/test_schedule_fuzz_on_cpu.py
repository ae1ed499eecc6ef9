"""The schedule fuzzer (tests/gpu_fuzz) on 2 CPU processes with the portable backend.

The same fuzzer that runs the CUDA kernels in the one-GPU mode
(tools/gpu_check.sh one-gpu fuzz) runs here under the launcher, against the
host oracle; with JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING=1 every program is also
lowered for the CUDA backend and must hold no XLA collective. Three runs:
  * a short budget: at least MIN_PROGRAMS programs, none failed, on both ranks;
  * --replay of a seed that run printed: exactly that one program;
  * the same replay with --perturb_outputs (every output element's lowest bit
    flipped): every returned step's check fails, so the checks can fail.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZER = "tests/gpu_fuzz/schedule_fuzz.py"
BUDGET_S = 40
# About 30 programs run in 40 s on an idle 2-core machine (2026-12-02); CI
# shares its cores with other tests.
MIN_PROGRAMS = 8
SUMMARY = re.compile(r"^\[rank (\d+)\] schedule fuzz: N=2 programs run (\d+), failed (\d+)",
                     re.MULTILINE)
PROGRAM = re.compile(r"^\[rank 0\] program (\d+) seed (\d+): (.*)$", re.MULTILINE)


def _fuzz(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_EP_GPU_TESTS_ON_CPU="1", JAX_PLATFORMS="cpu",
             JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING="1")
  env.pop("XLA_FLAGS", None)  # one CPU device per process, as on the GPU machine
  env.pop("JAX_EP_GPUS_SHARED", None)
  return subprocess.run([sys.executable, "-m", "jax_ep.launch", "-n", "2", FUZZER, *args],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=BUDGET_S + 300)


def _summaries(out: str) -> dict[int, tuple[int, int]]:
  """{rank: (programs run, failed)} from each rank's last line."""
  return {int(r): (int(run), int(failed)) for r, run, failed in SUMMARY.findall(out)}


@pytest.fixture(scope="module")
def budget_run():
  result = _fuzz("--budget_s", str(BUDGET_S), "--seed", "11")
  return result, result.stdout + result.stderr


def test_fuzzer_runs_programs_within_its_budget(budget_run):
  result, out = budget_run
  assert result.returncode == 0, out[-6000:]
  summaries = _summaries(out)
  assert sorted(summaries) == [0, 1], out[-3000:]
  runs = {run for run, _ in summaries.values()}
  assert len(runs) == 1, summaries  # both ranks ran the same sequence
  (run,) = runs
  assert run >= MIN_PROGRAMS, summaries
  assert all(failed == 0 for _, failed in summaries.values()), summaries
  assert len(PROGRAM.findall(out)) == run, out[-3000:]
  assert "FAILED" not in out, out[-6000:]


def _returned_steps(description: str) -> set[str]:
  """The indices of a printed program's steps not marked [unused]."""
  steps = set(re.findall(r"\[(\d+)\] ", description))
  return steps - set(re.findall(r"\[(\d+)\] [^|]*\[unused\]", description))


def _replayed(budget_out: str) -> tuple[str, str]:
  """(seed, description) of a program the budget run printed: the first one
  after program 0 with two or more returned steps."""
  programs = PROGRAM.findall(budget_out)
  chosen = [p for p in programs[1:] if len(_returned_steps(p[2])) >= 2]
  assert chosen, budget_out[-3000:]
  _, seed, description = chosen[0]
  return seed, description


def test_replay_runs_exactly_that_program(budget_run):
  seed, description = _replayed(budget_run[1])
  result = _fuzz("--replay", seed)
  out = result.stdout + result.stderr
  assert result.returncode == 0, out[-6000:]
  assert PROGRAM.findall(out) == [("0", seed, description)], out[-3000:]
  assert _summaries(out) == {0: (1, 0), 1: (1, 0)}, out[-3000:]


def test_checks_reject_perturbed_outputs(budget_run):
  seed, description = _replayed(budget_run[1])
  result = _fuzz("--replay", seed, "--perturb_outputs")
  out = result.stdout + result.stderr
  assert result.returncode != 0, out[-6000:]
  assert _summaries(out) == {0: (1, 1), 1: (1, 1)}, out[-3000:]
  returned = _returned_steps(description)
  for rank in (0, 1):
    failed_steps = set(re.findall(rf"^\[rank {rank}\] FAILED program 0 seed {seed}: step \[(\d+)\]",
                                  out, re.MULTILINE))
    assert failed_steps == returned, (rank, failed_steps, returned, out[-3000:])
