"""Bytes each benchmarked op moves, from the routing alone (pure numpy).

Two counts per op, both per rank and averaged over the R ranks:

* ``deepep_bytes``, DeepEP's way: the bytes of every row the rank receives in
  the op, its own rows included.
* ``link_bytes``: the bytes that cross the links into the rank from the other
  ranks, as the kernels send them. Averaged over ranks this is also the mean
  per sending rank, and for R = 2 exactly one direction of the link.

GB/s = bytes / time. A row's payload is ``2H`` bytes in bf16, ``H + 4 H / 128``
in FP8 (the e4m3 row and its float32 scale per 128 channels). Metadata (source
ids, top-k ids and weights, flags) is left out of both counts.

With s the source rank of a token, r a destination rank, and over every valid
(token, expert) pair of the routing (duplicate experts of a token count once,
as the kernels keep each expert's first occurrence):

* ``pairs[s, r]``: (token, expert) pairs of s's tokens whose expert lives on r;
* ``tokens[s, r]``: s's tokens with at least one expert on r.

Per op (payload bytes P; LL_HEADER_BYTES = 16):

* HT dispatch: a token's row goes once to each rank it has experts on.
  deepep = sum_s tokens[s, r] * P; link = sum_{s != r} tokens[s, r] * P.
* HT combine: the same rows go back (bf16). deepep = sum_r tokens[s, r] * 2H at
  source s; link = sum_{r != s} tokens[s, r] * 2H.
* LL dispatch: the receiver gets one row per (token, expert), so
  deepep = sum_s pairs[s, r] * P. Over NVLink the payload crosses once per
  (token, destination rank), into the destination's token buffer, and each
  (token, expert) slot gets only a 16-byte header (cuda/ll_kernels.cu,
  protocol step 2): link = sum_{s != r} (tokens[s, r] * P + pairs[s, r] * 16).
  (Over RDMA every pair carries a whole message instead; not measured.)
* LL combine: each expert sends its output row back per (token, expert):
  deepep = sum_r pairs[s, r] * 2H at source s; link = sum_{r != s} pairs[s, r] * 2H.
* Bare all_to_all of an [R, T, row] buffer: each rank receives R*T rows, of
  which (R-1)*T cross: deepep = R*T*P, link = (R-1)*T*P.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LL_HEADER_BYTES = 16
FP8_GROUP = 128


def row_bytes(hidden: int, fp8: bool) -> int:
  """Payload bytes of one row: 2H (bf16) or H + 4 * H/128 (FP8 row + float32 scales)."""
  return hidden + 4 * (hidden // FP8_GROUP) if fp8 else 2 * hidden


@dataclasses.dataclass(frozen=True)
class RoutingCounts:
  """Per (source rank s, destination rank r) counts of one routing (module docstring).

  Attributes:
    pairs: int64[R, R]: valid (token, expert) pairs of s's tokens with the
      expert on r (a token's repeated expert counts once).
    tokens: int64[R, R]: s's tokens with at least one valid expert on r.
  """

  pairs: np.ndarray
  tokens: np.ndarray

  @property
  def num_ranks(self) -> int:
    return self.pairs.shape[0]


def routing_counts(topk_idx: np.ndarray, num_experts: int) -> RoutingCounts:
  """Counts of the global routing ``topk_idx`` int[R, T, K] (global expert ids;
  entries outside [0, E) are not routed)."""
  topk_idx = np.asarray(topk_idx)
  num_ranks, num_tokens, num_topk = topk_idx.shape
  if num_experts % num_ranks:
    raise ValueError(f"num_experts ({num_experts}) is not a multiple of R ({num_ranks})")
  experts_per_rank = num_experts // num_ranks
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  # A repeat of an earlier k's expert in the same token is not a new pair.
  earlier = np.tril(np.ones((num_topk, num_topk), dtype=bool), k=-1)
  repeat = np.any((topk_idx[..., :, None] == topk_idx[..., None, :]) & earlier, axis=-1)
  kept = valid & ~repeat
  owner = np.where(kept, topk_idx // experts_per_rank, -1)                  # [R, T, K]
  on_rank = owner[..., None] == np.arange(num_ranks)                        # [R, T, K, R]
  pairs = on_rank.sum(axis=(1, 2), dtype=np.int64)
  tokens = on_rank.any(axis=2).sum(axis=1, dtype=np.int64)
  return RoutingCounts(pairs=pairs, tokens=tokens)


@dataclasses.dataclass(frozen=True)
class Traffic:
  """Bytes of one op per rank, averaged over ranks (module docstring)."""

  deepep_bytes: float
  link_bytes: float | None

  def received_only(self) -> "Traffic":
    """The same op done by another exchange (the portable path's padded
    all_to_all): the received rows are the same, the bytes on the links are not."""
    return dataclasses.replace(self, link_bytes=None)


def _mean_into(matrix: np.ndarray, per_row: float, remote_only: bool, *, to_dest: bool) -> float:
  """Mean over ranks of sum over the other side of matrix * per_row bytes.

  to_dest: rank r receives column r (dispatch direction); else rank s receives
  row s (combine direction). Both means are equal; the two names keep the
  formulas readable."""
  m = matrix.astype(np.float64)
  if remote_only:
    m = m - np.diag(np.diag(m))
  per_rank = m.sum(axis=0) if to_dest else m.sum(axis=1)
  return float(per_rank.mean() * per_row)


def ht_dispatch(counts: RoutingCounts, hidden: int, fp8: bool) -> Traffic:
  p = row_bytes(hidden, fp8)
  return Traffic(_mean_into(counts.tokens, p, False, to_dest=True),
                 _mean_into(counts.tokens, p, True, to_dest=True))


def ht_combine(counts: RoutingCounts, hidden: int) -> Traffic:
  p = row_bytes(hidden, fp8=False)
  return Traffic(_mean_into(counts.tokens, p, False, to_dest=False),
                 _mean_into(counts.tokens, p, True, to_dest=False))


def ll_dispatch(counts: RoutingCounts, hidden: int, fp8: bool) -> Traffic:
  p = row_bytes(hidden, fp8)
  return Traffic(_mean_into(counts.pairs, p, False, to_dest=True),
                 _mean_into(counts.tokens, p, True, to_dest=True)
                 + _mean_into(counts.pairs, LL_HEADER_BYTES, True, to_dest=True))


def ll_combine(counts: RoutingCounts, hidden: int) -> Traffic:
  p = row_bytes(hidden, fp8=False)
  return Traffic(_mean_into(counts.pairs, p, False, to_dest=False),
                 _mean_into(counts.pairs, p, True, to_dest=False))


def ll_combine_presummed(counts: RoutingCounts, hidden: int) -> Traffic:
  """The LL combine with the weights at the dispatch: one row per (token, rank)
  goes back, as in the HT combine."""
  return ht_combine(counts, hidden)


def bare_all_to_all(num_ranks: int, num_tokens: int, hidden: int, fp8: bool) -> Traffic:
  p = row_bytes(hidden, fp8)
  return Traffic(float(num_ranks * num_tokens * p), float((num_ranks - 1) * num_tokens * p))


def gbps(num_bytes: float | None, us: float | None) -> float | None:
  """Bytes over a per-call time in microseconds, in GB/s (1e9 bytes per second)."""
  if num_bytes is None or us is None or not us > 0:
    return None
  return num_bytes / us / 1e3
