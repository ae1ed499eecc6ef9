"""What every step of a fuzzed program has, and the protocol its kinds follow.

A step is one composite of jax_ep ops (a dispatch and its combines, a
gradient, ...) inside a program's one jitted computation. Each kind is a
frozen dataclass (fuzz_steps_ll.py, fuzz_steps_ht.py) with:

  family          "ll" or "ht": which buffers (and config) it needs
  describe()      one line, printed before the program runs
  host_inputs()   its global inputs ([R, ...] numpy, from its own seed)
  device()        the ops on this rank's slices (traced inside the program)
  check()         this rank's outputs against the host oracle; raises
                  AssertionError naming the failing comparison

Inputs come from the step's own seed, so a step's arrays do not depend on
the other steps of its program.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol

import numpy as np

import fuzz_routings
from gpu_testing import dyadic_weights, rng, rows
from jax_ep.config import EpConfig


@dataclasses.dataclass(frozen=True)
class StepCommon:
  """Fields of every step.

  Attributes:
    tokens: T_local, this step's tokens per rank (1 .. the family's cap).
    routing: the routing kind of each rank (fuzz_routings).
    extras: invalid entries and a repeated expert on top (fuzz_routings.build).
    input_seed: seed of the step's inputs.
    unused: its outputs are not returned, so not checked; its ops still run
      (they have side effects, which keep them in the program).
  """

  tokens: int
  routing: tuple[str, ...]
  extras: bool
  input_seed: int
  unused: bool

  def suffix(self) -> str:
    return (f" T={self.tokens} routing={fuzz_routings.describe(self.routing, self.extras)}"
            + (" [unused]" if self.unused else ""))

  def generator(self) -> np.random.Generator:
    return rng(self.input_seed)

  def topk_idx(self, gen: np.random.Generator, config: EpConfig) -> np.ndarray:
    """int32[R, T_local, K] of this step's routing."""
    return fuzz_routings.build(self.routing, self.extras, gen, self.tokens, config.num_topk,
                               config.num_experts)

  def grad_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    """A gradient step's global inputs: x bf16 [R, T, H], idx, dyadic weights
    f32 [R, T, K] and the loss's cotangent f32 [R, T, H] (gpu_testing's
    generators, from this step's seed)."""
    gen = self.generator()
    shape = (num_ranks, self.tokens)
    return {"x": rows(gen, shape + (config.hidden,)), "idx": self.topk_idx(gen, config),
            "w": dyadic_weights(gen, shape + (config.num_topk,)),
            "cot": gen.standard_normal(shape + (config.hidden,), dtype=np.float32)}


def dispatch_text(what: str, capacity: int | None, combines: int, y_dtype: str) -> str:
  """describe() of a dispatch step and its back-to-back combines."""
  cap = f", capacity {capacity}" if capacity else ""
  tail = f" -> {combines}x combine({y_dtype} rows after the first)" if combines else ""
  return f"dispatch({what}{cap}){tail}"


def draw_common(gen: np.random.Generator, num_ranks: int, token_cap: int,
                unused_allowed: bool = True) -> StepCommon:
  tokens = token_cap if gen.random() < 0.5 else int(gen.integers(1, token_cap + 1))
  return StepCommon(tokens=tokens, routing=fuzz_routings.draw(gen, num_ranks),
                    extras=bool(gen.random() < 0.3), input_seed=int(gen.integers(2 ** 31)),
                    unused=unused_allowed and bool(gen.random() < 0.15))


class Step(Protocol):
  common: StepCommon
  family: ClassVar[str]

  def describe(self) -> str:
    ...

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    ...

  def device(self, config: EpConfig, inputs: dict[str, Any]) -> Any:
    ...

  def check(self, config: EpConfig, inputs: dict[str, np.ndarray], outputs: Any) -> None:
    ...
