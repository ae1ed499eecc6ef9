"""Runs one fuzzed program on this rank and checks its outputs.

The program is one gpu_testing.run call: jit(shard_map(...)) over the EP axis
of every process, its lowering checked for XLA collectives first (on CUDA
always; on CPU processes, lowered for CUDA, with
JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING=1), as every test of tests/gpu. Inputs
are global numpy arrays built on every process from the program's seeds; each
rank compares its own outputs with its part of the host oracle (no data
crosses between processes outside jax_ep's own ops).

Outcome kinds: "pass"; "fail" (a check failed, or the program could not be
traced or run, while jax_ep.status() is ok: the group is still in step);
"fault" (jax_ep.status() reports a fault: the group is out of step).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from fuzz_programs import Program, flat_inputs
from gpu_testing import bits, run
from jax_ep.config import EpConfig

MESSAGE_CHARS = 600


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What one program did on this rank.

  Attributes:
    kind: "pass", "fail" or "fault".
    failures: one line per failing check (or the error that stopped the run).
  """

  kind: str
  failures: tuple[str, ...] = ()


def _short(error: BaseException) -> str:
  text = " ".join(f"{type(error).__name__}: {error}".split())
  return text if len(text) <= MESSAGE_CHARS else text[:MESSAGE_CHARS] + " ..."


def _kept(values: list[Any]) -> jax.Array:
  """A float32 scalar that reads one element of every leaf of ``values``."""
  picked = [jnp.ravel(leaf)[:1].astype(jnp.float32).sum() for leaf in jax.tree.leaves(values)]
  return sum(picked, jnp.zeros((), jnp.float32))


def program_function(program: Program, config: EpConfig, names: list[list[str]]):
  """The per-rank body: every step's ops on its inputs; a step marked unused
  returns nothing. In a chained program each LL step's inputs first pass an
  optimization_barrier with the previous LL step's outputs (fuzz_programs).
  The body returns one output per step and, last, a scalar that reads the
  barriers' copies of those previous outputs: XLA drops a barrier operand
  whose output nothing reads, and behind an unused step that took the fence
  with it (program 28 of seed 20261204 at N = 4, 2026-12-04: the next step's
  one-call dispatch ran while the unused step's split send awaited its recv,
  a protocol fault on two ranks and timeouts on the others)."""

  def body(*flat):
    outputs, fences, previous_ll, at = [], [], None, 0
    for step, step_names in zip(program.steps, names):
      inputs = dict(zip(step_names, flat[at:at + len(step_names)]))
      at += len(step_names)
      if program.chained and step.family == "ll" and previous_ll is not None:
        inputs, fence = jax.lax.optimization_barrier((inputs, previous_ll))
        fences.append(fence)
      result = step.device(config, inputs)
      if step.family == "ll":
        previous_ll = result
      outputs.append(None if step.common.unused else result)
    return tuple(outputs) + (_kept(fences),)

  return body


def perturbed(outputs: Any) -> Any:
  """Every output element with its lowest bit flipped (a self-test of the checks)."""

  def flip(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return (bits(a) ^ np.ones((), bits(a).dtype)).view(a.dtype)

  return jax.tree.map(flip, outputs)


def _status_line() -> str | None:
  status = jax_ep.status()
  return None if status["ok"] else f"jax_ep.status() not ok: {status}"


def run_program(program: Program, config: EpConfig, mesh, perturb: bool = False) -> Outcome:
  """Runs `program` (jax_ep initialised with `config` on `mesh`) and checks
  every returned step; jax_ep.status() must be ok afterwards."""
  per_step, flat = flat_inputs(program, config)
  names = [sorted(inputs) for inputs in per_step]
  try:
    *outputs, _ = run(program_function(program, config, names), mesh, *flat)
    jax.effects_barrier()  # the unused steps' ops too, before the status is read
  except Exception as e:  # pylint: disable=broad-except
    fault = _status_line()
    return Outcome("fault" if fault else "fail",
                   tuple(line for line in (f"running: {_short(e)}", fault) if line))
  fault = _status_line()
  if fault:
    return Outcome("fault", (fault,))
  if perturb:
    outputs = perturbed(outputs)
  failures = []
  for i, (step, inputs, result) in enumerate(zip(program.steps, per_step, outputs)):
    if step.common.unused:
      continue
    try:
      step.check(config, inputs, result)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"step [{i}] {step.describe()}: {_short(e)}")
  return Outcome("fail" if failures else "pass", tuple(failures))
