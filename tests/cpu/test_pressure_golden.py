"""The GPU pressure test's golden hashes are the contract's: recomputed here
from tests/host_reference.py (numpy), not taken from one backend's run."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))),
                                "gpu"))

import pressure_workload  # noqa: E402  (tests/gpu)
import test_pressure_gpu  # noqa: E402  (tests/gpu: GOLDEN_HASHES; collected there, not here)


def test_golden_hashes_come_from_the_host_oracle():
  assert pressure_workload.NUM_CALLS == 10_000
  for num_ranks, golden in test_pressure_gpu.GOLDEN_HASHES.items():
    hashes = pressure_workload.host_hashes(num_ranks)
    assert tuple(hashes) == golden, [f"{h:#010x}" for h in hashes]
