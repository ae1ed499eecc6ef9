"""The schedule fuzzer's routings: which experts each rank's tokens choose.

A step's routing is one kind per rank (the same on every process: drawn from
the program's seeded generator, then built for all R ranks at once as the
global int32[R, T, K] that every test of tests/gpu compares against). Kinds:

  uniform        a random top-k of distinct experts, entries -1 with p = 0.1
                 (gpu_testing.global_routing)
  zipf           distinct experts drawn with probability ~ 1/(i+1)**1.2 over one
                 permutation of the experts shared by every rank of the step, so
                 a few experts (and their ranks) are hot; entries -1 with p = 0.05
  all_to_rank_j  every token on rank j's experts (gpu_testing.one_rank_routing):
                 rank j needs no peer's rows in a combine, the others send it all
  all_to_self    each rank's tokens on its own experts: nothing crosses
  none           every entry -1
  one_token      one token with valid entries, every other entry -1
  mostly_none    a random top-k with entries -1 with p = 0.9

With ``extras`` a rank of kind uniform, zipf, all_to_rank_j, all_to_self or
mostly_none also gets one entry outside [-1, E) (counted in num_invalid, never
used) and one token naming an expert twice (one row, or one pair with the sum
of both weights), as the tests of tests/gpu do.
"""

from __future__ import annotations

import numpy as np

from gpu_testing import global_routing, one_rank_routing

KINDS = ("uniform", "zipf", "all_to_rank", "all_to_self", "none", "one_token", "mostly_none")
# How often each kind is drawn: the kinds where a rank needs no peer's rows
# (issue 30's hazard) more often than the others.
KIND_SHARES = (0.15, 0.15, 0.25, 0.15, 0.1, 0.1, 0.1)
ZIPF_EXPONENT = 1.2
# The share of steps whose ranks all take one kind (else each rank draws its own).
SAME_KIND_SHARE = 0.65
_EXTRAS_KINDS = ("uniform", "zipf", "all_to_rank", "all_to_self", "mostly_none")


def draw(gen: np.random.Generator, num_ranks: int) -> tuple[str, ...]:
  """Per-rank kinds, all_to_rank resolved to all_to_rank_<j>."""

  def one() -> str:
    kind = KINDS[gen.choice(len(KINDS), p=KIND_SHARES)]
    return f"all_to_rank_{gen.integers(num_ranks)}" if kind == "all_to_rank" else kind

  if gen.random() < SAME_KIND_SHARE:
    return (one(),) * num_ranks
  return tuple(one() for _ in range(num_ranks))


def describe(kinds: tuple[str, ...], extras: bool) -> str:
  name = kinds[0] if len(set(kinds)) == 1 else "per_rank(" + ",".join(kinds) + ")"
  return name + ("+extras" if extras else "")


def _base_kind(kind: str) -> str:
  return "all_to_rank" if kind.startswith("all_to_rank_") else kind


def _zipf(gen: np.random.Generator, order: np.ndarray, num_tokens: int,
          num_topk: int) -> np.ndarray:
  """int32[T, K]: distinct experts, expert order[i] drawn with weight 1/(i+1)**a
  (weighted sampling without replacement: the top k of log(weight) + Gumbel noise)."""
  log_weight = -ZIPF_EXPONENT * np.log(np.arange(1, order.size + 1, dtype=np.float64))
  keys = log_weight[None, :] + gen.gumbel(size=(num_tokens, order.size))
  picked = order[np.argsort(-keys, axis=-1)[:, :num_topk]].astype(np.int32)
  picked[gen.random(picked.shape) < 0.05] = -1
  return picked


def build(kinds: tuple[str, ...], extras: bool, gen: np.random.Generator, num_tokens: int,
          num_topk: int, num_experts: int) -> np.ndarray:
  """int32[R, T, K], R = len(kinds): rank r's tokens routed by kinds[r]."""
  num_ranks = len(kinds)
  order = gen.permutation(num_experts)                  # zipf's hot experts, shared
  idx = np.full((num_ranks, num_tokens, num_topk), -1, np.int32)
  for r, kind in enumerate(kinds):
    base = _base_kind(kind)
    if base == "uniform":
      idx[r] = global_routing(gen, (), num_tokens, num_topk, num_experts)
    elif base == "zipf":
      idx[r] = _zipf(gen, order, num_tokens, num_topk)
    elif base == "all_to_rank":
      owner = int(kind.rsplit("_", 1)[1])
      idx[r] = one_rank_routing(gen, (), num_tokens, num_topk, num_experts, num_ranks, owner)
    elif base == "all_to_self":
      idx[r] = one_rank_routing(gen, (), num_tokens, num_topk, num_experts, num_ranks, r)
    elif base == "one_token":
      idx[r, gen.integers(num_tokens)] = global_routing(gen, (), 1, num_topk, num_experts,
                                                         none_fraction=0.0)[0]
    elif base == "mostly_none":
      idx[r] = global_routing(gen, (), num_tokens, num_topk, num_experts, none_fraction=0.9)
    elif base != "none":
      raise ValueError(f"unknown routing kind {kind!r}")
    if extras and base in _EXTRAS_KINDS:
      invalid = (num_experts, num_experts + 3, -5)[gen.integers(3)]
      idx[r, gen.integers(num_tokens), gen.integers(num_topk)] = invalid
      token = gen.integers(num_tokens)
      if num_topk > 1 and idx[r, token, 0] >= 0:
        idx[r, token, 1] = idx[r, token, 0]
  return idx
