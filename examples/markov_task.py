"""A synthetic language for examples/moe_transformer.py: a fixed random Markov chain.

Every token has a few likely successors (random, with random probabilities)
and a small uniform floor that keeps the chain irreducible and aperiodic.
Sequences start from the stationary distribution, so every position of every
sequence is distributed alike. Two entropies bound what a model can reach:

  entropy_rate      H(x_t+1 | x_t), the lowest expected cross-entropy (nats)
                    of any model: the next token depends only on the current one;
  unigram_entropy   H(x_t), the lowest of a model that ignores its context.

Their difference is what the previous token tells about the next: a model
that has learned anything from its context is below unigram_entropy.
Everything is made from a seed; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Probability mass spread uniformly over the whole vocabulary: every transition
# is possible, so the chain has one stationary distribution that every start
# converges to.
UNIFORM_FLOOR = 0.02


@dataclasses.dataclass(frozen=True)
class MarkovTask:
  """A Markov chain over ``vocab`` tokens.

  Attributes:
    transitions: float64 [V, V], row i: the distribution of the token after i.
    stationary: float64 [V], the chain's stationary distribution.
    entropy_rate: nats, sum_i stationary_i * H(transitions_i).
    unigram_entropy: nats, H(stationary).
  """

  transitions: np.ndarray
  stationary: np.ndarray
  entropy_rate: float
  unigram_entropy: float

  @property
  def vocab(self) -> int:
    return self.transitions.shape[0]

  def sample(self, rng: np.random.Generator, shape: tuple[int, ...], length: int) -> np.ndarray:
    """int32 [*shape, length]: independent sequences, each starting from the
    stationary distribution."""
    cumulative = np.cumsum(self.transitions, axis=1)
    cumulative[:, -1] = 1.0   # no sample falls past the last token through rounding
    out = np.empty((*shape, length), np.int32)
    uniform = rng.random((*shape, length))
    out[..., 0] = np.searchsorted(np.cumsum(self.stationary), uniform[..., 0], side="right")
    out[..., 0] = np.minimum(out[..., 0], self.vocab - 1)
    for t in range(1, length):
      rows = cumulative[out[..., t - 1]]                              # [*shape, V]
      out[..., t] = np.sum(rows <= uniform[..., t, None], axis=-1)
    return out


def _entropy(p: np.ndarray) -> np.ndarray:
  """Nats, over the last axis."""
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def make_task(vocab: int, successors: int, seed: int) -> MarkovTask:
  """Each token gets ``successors`` random successors with Dirichlet(1)
  probabilities, mixed with UNIFORM_FLOOR of uniform mass."""
  if not 1 <= successors <= vocab:
    raise ValueError(f"successors must be in [1, {vocab}], got {successors}")
  rng = np.random.default_rng(seed)
  sparse = np.zeros((vocab, vocab))
  for i in range(vocab):
    chosen = rng.choice(vocab, size=successors, replace=False)
    sparse[i, chosen] = rng.dirichlet(np.ones(successors))
  transitions = (1 - UNIFORM_FLOOR) * sparse + UNIFORM_FLOOR / vocab
  # The stationary distribution: the left eigenvector of eigenvalue 1 (the
  # floor makes it unique and positive).
  values, vectors = np.linalg.eig(transitions.T)
  stationary = np.abs(np.real(vectors[:, np.argmin(np.abs(values - 1))]))
  stationary /= stationary.sum()
  return MarkovTask(transitions=transitions, stationary=stationary,
                    entropy_rate=float(stationary @ _entropy(transitions)),
                    unigram_entropy=float(_entropy(stationary)))
