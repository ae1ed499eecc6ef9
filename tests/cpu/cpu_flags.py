"""XLA flags of the CPU test runs.

The tests compile hundreds of small programs once each and run them briefly,
so XLA:CPU's LLVM optimisation costs more than it saves: without it the GPU
suite on two CPU processes ran in 204 s instead of 335 s (2026-12-07, 2
cores). It changes no result: fast-math stays off, so the float arithmetic
and its order are XLA's either way, and the bitwise oracle checks hold.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(*more: str) -> str:
  """FAST_COMPILE plus ``more`` (non-empty ones), as one XLA_FLAGS value."""
  return " ".join([FAST_COMPILE, *(flag for flag in more if flag)])
