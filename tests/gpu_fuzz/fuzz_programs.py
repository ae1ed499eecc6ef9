"""Random programs of jax_ep ops: their configs, their steps, and the seeds.

A program is a function of (seed, R) alone: the first draw of its generator
picks the config, then whether its LL steps are chained, then its steps
(fuzz_steps_ll.draw, fuzz_steps_ht.draw). So `--replay SEED` rebuilds exactly
the program a run printed under that seed (at the same number of processes).

All of a program's steps live in ONE jit(shard_map(...)) computation, so XLA
chooses the order of their ops, the same on every rank (one program, one
compiler). One exception is kept out of XLA's hands, because the contract
forbids it: a split LL send must reach its recv before the next send or
one-call op of its kind (a protocol fault otherwise). A program whose LL steps
use split ops is "chained": each LL step's inputs pass through an
optimization_barrier with the previous LL step's outputs, so it starts after
all of that step's ops (every op of a step feeds its outputs: a chained
gradient returns its forward result). HT steps are never chained: their op
kinds have sequence numbers of their own.

The runtime holds one EpConfig at a time and re-initialising costs a
collective allocation, so a run draws programs in blocks of one config
(program_seeds).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

import fuzz_steps_ht
import fuzz_steps_ll
from fuzz_step import Step
from gpu_testing import rng
from jax_ep.config import EpConfig


@dataclasses.dataclass(frozen=True)
class FuzzConfig:
  """One EpConfig of the fuzzer (small shapes: in the one-GPU mode the kernels
  of the processes take turns).

  Attributes:
    name: printed with each program.
    experts_per_rank: E_local (E = E_local * R).
    num_topk: K (at most E).
    hidden: H (a multiple of 128: FP8 steps).
    ht_tokens: T of the HT ops (max_tokens_per_rank), 0 without HT buffers.
    ll_tokens: T_ll of the LL ops, 0 without LL buffers.
  """

  name: str
  experts_per_rank: int
  num_topk: int
  hidden: int
  ht_tokens: int
  ll_tokens: int

  @property
  def families(self) -> tuple[str, ...]:
    return (("ll",) if self.ll_tokens else ()) + (("ht",) if self.ht_tokens else ())

  def setup_kwargs(self, num_ranks: int) -> dict:
    """gpu_testing.setup's keyword arguments for this config at R = num_ranks."""
    num_experts = self.experts_per_rank * num_ranks
    return dict(num_experts=num_experts, hidden=self.hidden,
                max_tokens_per_rank=self.ht_tokens or 4 * self.ll_tokens,
                num_topk=min(self.num_topk, num_experts),
                low_latency_max_tokens_per_rank=self.ll_tokens or None,
                enable_low_latency=bool(self.ll_tokens),
                enable_high_throughput=bool(self.ht_tokens))

  def shapes(self, num_ranks: int) -> EpConfig:
    """An EpConfig with this config's shapes (for drawing; not initialised)."""
    return EpConfig(**self.setup_kwargs(num_ranks))


CONFIGS = (
    FuzzConfig("ll_small", experts_per_rank=4, num_topk=4, hidden=256, ht_tokens=0, ll_tokens=32),
    FuzzConfig("ll_wide", experts_per_rank=8, num_topk=8, hidden=512, ht_tokens=0, ll_tokens=16),
    FuzzConfig("ht_small", experts_per_rank=4, num_topk=4, hidden=256, ht_tokens=64, ll_tokens=0),
    FuzzConfig("ht_wide", experts_per_rank=8, num_topk=8, hidden=512, ht_tokens=32, ll_tokens=0),
    FuzzConfig("mixed", experts_per_rank=4, num_topk=6, hidden=256, ht_tokens=48, ll_tokens=24),
)
MIN_STEPS, MAX_STEPS = 2, 4
CHAINED_SHARE = 0.3  # of programs with LL steps


@dataclasses.dataclass(frozen=True)
class Program:
  """One fuzzed computation.

  Attributes:
    seed: its seed (the whole description follows from it and R).
    num_ranks: R it was drawn for.
    config: its FuzzConfig.
    chained: its LL steps run in order, fenced (split ops allowed).
    steps: in program order (XLA chooses the order of their ops).
  """

  seed: int
  num_ranks: int
  config: FuzzConfig
  chained: bool
  steps: tuple[Step, ...]

  def describe(self) -> str:
    head = f"{self.config.name}" + (", LL steps chained" if self.chained else "")
    return f"{head}: " + " | ".join(
        f"[{i}] {step.describe()}" for i, step in enumerate(self.steps))


def config_index(seed: int) -> int:
  """The index in CONFIGS of program `seed`'s config (its generator's first draw)."""
  return int(rng(seed).integers(len(CONFIGS)))


def make_program(seed: int, num_ranks: int) -> Program:
  gen = rng(seed)
  config = CONFIGS[gen.integers(len(CONFIGS))]
  shapes = config.shapes(num_ranks)
  chained = "ll" in config.families and bool(gen.random() < CHAINED_SHARE)
  steps = []
  for _ in range(int(gen.integers(MIN_STEPS, MAX_STEPS + 1))):
    family = config.families[gen.integers(len(config.families))]
    if family == "ll":
      steps.append(fuzz_steps_ll.draw(gen, config.ll_tokens, num_ranks, chained))
    else:
      steps.append(fuzz_steps_ht.draw(gen, shapes, num_ranks))
  chained = chained and any(step.family == "ll" for step in steps)
  return Program(seed=seed, num_ranks=num_ranks, config=config, chained=chained,
                 steps=tuple(steps))


def program_seeds(master_seed: int, block: int) -> Iterator[int]:
  """Endless program seeds: blocks of `block` programs of one config each
  (the config of each block drawn from the master seed; seeds drawn until
  one belongs to it)."""
  gen = rng(master_seed)
  while True:
    wanted = int(gen.integers(len(CONFIGS)))
    for _ in range(block):
      seed = int(gen.integers(2 ** 31))
      while config_index(seed) != wanted:
        seed = int(gen.integers(2 ** 31))
      yield seed


def flat_inputs(program: Program, config: EpConfig) -> tuple[list[dict[str, np.ndarray]],
                                                            list[np.ndarray]]:
  """(each step's named global inputs, all of them in one list: the program's
  arguments, step by step in sorted name order)."""
  per_step = [step.host_inputs(config, program.num_ranks) for step in program.steps]
  return per_step, [inputs[name] for inputs in per_step for name in sorted(inputs)]
