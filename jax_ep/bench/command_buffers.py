"""Whether jax_ep's custom calls run inside XLA:GPU's command buffers (CUDA graphs).

XLA:GPU's CommandBufferScheduling pass moves runs of graph-compatible
instructions into computations named ``command_buffer*``, each replayed as one
CUDA graph; an instruction left outside is launched on its own by the host. A
jax_ep custom call is eligible only if its handler declares
``kCmdBufferCompatible`` (xla_ffi/cuda/*_handlers.cc) and XLA accepts it, and
a call outside a graph pays a host launch every time. The bench records, for
the executables it times, how many of their jax_ep custom calls XLA placed
inside a command buffer (the optimized HLO's text), so a per-call fixed cost
can be told apart from the kernel's own time.
"""

from __future__ import annotations

import re

_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# A computation's header line: "%name (params...) -> type {" or "ENTRY %name ...".
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")


def custom_calls_in_command_buffers(hlo_text: str, target_prefix: str = "jax_ep_") -> dict:
  """Counts the custom calls to targets starting with ``target_prefix``.

  Args:
    hlo_text: an optimized HLO module's text (``compiled.as_text()``).
    target_prefix: which custom-call targets count.
  Returns:
    {"total": calls, "in_command_buffers": those inside a computation named
    command_buffer*, "targets": sorted distinct target names}.
  """
  total = inside = 0
  targets: set[str] = set()
  computation = None
  for line in hlo_text.splitlines():
    header = _HEADER.match(line)
    if header is not None:
      computation = header.group(1)
      continue
    if line.strip() == "}":
      computation = None
      continue
    for target in _TARGET.findall(line):
      if not target.startswith(target_prefix):
        continue
      total += 1
      targets.add(target)
      if computation is not None and computation.startswith("command_buffer"):
        inside += 1
  return dict(total=total, in_command_buffers=inside, targets=sorted(targets))


def format_report(label: str, report: dict) -> str:
  return (f"command buffers: {label}: {report['in_command_buffers']} of {report['total']} "
          f"jax_ep custom calls inside XLA command buffers ({', '.join(report['targets'])})")
