"""Pressure: pressure_workload.NUM_CALLS LL and HT calls with changing routing
in one graph, hashed (order-sensitive uint32 over every call's results).

Arrival order differs from call to call and run to run; the contract's
(source rank, source token) order makes the hashes equal anyway. At R = 2 and
4 they must equal GOLDEN_HASHES, which CPU and GPU share; at other R the test
runs twice and compares. The hashes are printed either way.
"""

import pressure_workload as workload
from gpu_testing import ON_CPU, num_ranks, rank, run_local, setup

# Per-rank hashes of pressure_workload with NUM_CALLS = 10,000, at R = 2 and 4.
# Produced by this test on 2 and 4 CPU processes with the portable backend
# (JAX_EP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu python -m jax_ep.launch -n R
# -m pytest tests/gpu/test_pressure_gpu.py -s prints them), 2026-12-01, on
# 28fa2f2 plus the commit that added them; tests/cpu/test_pressure_golden.py
# recomputes the same values from tests/host_reference.py. A legitimate change
# of the contract or of the workload (row order, padding, seeds, sizes,
# NUM_CALLS, what is hashed) must regenerate them both ways.
GOLDEN_HASHES = {
    2: (0xB2BA963E, 0xD7232D4F),
    4: (0x2A9A9EA5, 0xCD97D887, 0x52640F0A, 0x2617B0E5),
}

# On CPU processes the suite compiles without LLVM's optimisations
# (tests/cpu/cpu_flags.py), which costs this one program, run 10,000 times in a
# loop, more than it saves: optimised, its loop runs in less than half the time
# (2026-12-07, 2 cores: 3.3 ms a call instead of 8.3 ms, for 0.2 s more
# compiling). The hashes are bits of the contract, the same either way.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 2}


def test_10000_calls_hash_like_the_golden():
  r = num_ranks()
  config, mesh = setup(**workload.config_kwargs(r))
  x, w, idx = workload.inputs(rank(), r)

  def once() -> int:
    return int(run_local(lambda x, w, idx: workload.device_hash(x, w, idx, config), mesh, x, w,
                         idx, compiler_options=CPU_COMPILER_OPTIONS if ON_CPU else None))

  first = once()
  print(f"rank {rank()} of {r}: hash of {workload.NUM_CALLS} LL+HT calls = {first:#010x}")
  golden = GOLDEN_HASHES.get(r) if workload.NUM_CALLS == 10_000 else None
  if golden is not None:
    assert first == golden[rank()], f"{first:#010x} != golden {golden[rank()]:#010x}"
  else:
    assert once() == first
