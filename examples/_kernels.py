"""What a compiled example step runs: jax_ep's custom calls, and the check that a
bfloat16 step on GPUs runs the HT kernels rather than the portable path."""

from __future__ import annotations

import collections
import re

# jax_ep.backends.cuda targets of the examples' expert-major dispatch and combine.
HT_KERNELS = ("jax_ep_ht_dispatch_expert_major", "jax_ep_ht_combine_expert_major")


STATUS_CHECK = "jax_ep_status_check"  # not a kernel: the fault check every call reads


def jax_ep_custom_calls(program_text: str) -> collections.Counter:
  """Targets of jax_ep's kernel calls in HLO text (compiled) or StableHLO
  (lowered); the status check each of them reads is left out."""
  calls = collections.Counter(re.findall(
      r'(?:custom_call_target="|stablehlo\.custom_call @)(jax_ep_\w+)', program_text))
  del calls[STATUS_CHECK]
  return calls


def missing_kernels(calls: collections.Counter, *, gpu_bf16: bool, backend: str) -> str | None:
  """The failure line when a bfloat16 step on GPUs (``gpu_bf16``) lacks an HT
  kernel among ``calls``, else None. ``backend``: jax_ep's backend name."""
  if not gpu_bf16:
    return None
  missing = [k for k in HT_KERNELS if k not in calls]
  if not missing:
    return None
  from jax_ep import _extension  # pylint: disable=import-outside-toplevel
  reason = ("the portable path ran instead" if backend == "cuda" else
            f"jax_ep's backend is {backend!r}: {_extension.cuda_module_status()}")
  return f"FAILED: on GPUs, but the compiled step lacks {missing} ({reason})"
