"""jax_ep's contract as a numpy model of the whole EP group, for tests.

Not part of the package: the test folders' conftest.py files (and
tests/gpu_fuzz/schedule_fuzz.py) put tests/ on sys.path, and the tests import it
as ``host_reference``.

Global view: every function takes the inputs of all R ranks stacked on a
leading axis (rank r's shard is ``a[r]``) and returns every rank's results
stacked the same way. A test in which the processes cannot run an XLA
collective (several processes sharing one GPU) builds the global inputs from
one seed in every process, runs the op on its own slice, and compares with
``[r]`` of these results; no data crosses between processes.

Independent of jax_ep's implementations: numpy and ml_dtypes only, no code
shared with jax_ep.backends, jax_ep.local_ops, jax_ep.fp8 or jax_ep.reference
(the FP8 formula is restated here).

Arithmetic is the contract's, operation by operation, so that results compare
bit for bit wherever an implementation does the same operations:
  HT combine   out[t] = sum over the ranks that received t, in rank order,
               starting from +0.0, of float32(y row); one cast to y's dtype.
  LL combine   out[t] = sum over valid k, in k order, starting from +0.0, of
               float32(w[t, k]) * float32(y row of (t, e_k)) (the product
               rounded to float32, then added); one cast to y's dtype.
  FP8          per 128 channels: amax = max(max|x|, 1e-4) in float32,
               q = e4m3(x * (448 / amax)), scale = amax / 448 (each operation
               rounded to float32; e4m3 rounds to nearest even).

Shapes: R ranks, T = T_local tokens per rank (the same on every rank, as in
shard_map), K = num_topk, E experts, E_local = E / R, H = hidden, C = HT row
capacity (R * max_tokens_per_rank by default), L = R * T_ll rows per local
expert of the LL ops (T_ll = EpConfig.ll_max_tokens). A token's source id is
``src_rank * T + src_token``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import ml_dtypes
import numpy as np

from jax_ep.config import EpConfig

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

FP8_GROUP = 128
FP8_MAX = np.float32(448.0)
FP8_MIN_AMAX = np.float32(1e-4)
F32_UNIT_ROUNDOFF = 2.0 ** -24


# ====================================================================== helpers
def zero_bytes(shape: Sequence[int], dtype) -> np.ndarray:
  """An array of ``dtype`` whose every byte is 0 (padding rows; float8_e8m0fnu
  has no zero value, so "zero" means zero bytes throughout)."""
  dtype = np.dtype(dtype)
  shape = tuple(shape)
  return np.zeros(shape + (dtype.itemsize,), np.uint8).view(dtype).reshape(shape)


def clean_topk(topk_idx: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
  """Entries outside [-1, E) become -1.

  Args:
    topk_idx: integer [R, T, K] (any integer dtype; int64 values are compared
      before any narrowing).
  Returns:
    (clean int32[R, T, K], num_invalid int32[R]: entries outside [-1, E) per rank).
  """
  idx = np.asarray(topk_idx)
  valid = (idx >= -1) & (idx < num_experts)
  return np.where(valid, idx, -1).astype(I32), np.sum(~valid, axis=(-2, -1)).astype(I32)


def first_choice(clean: np.ndarray) -> np.ndarray:
  """bool[..., K]: entry k is valid and no earlier entry of its token names the
  same expert (a token choosing an expert twice is sent to it once)."""
  repeated = np.zeros(clean.shape, bool)
  for k in range(1, clean.shape[-1]):
    repeated[..., k] = np.any(clean[..., :k] == clean[..., k:k + 1], axis=-1)
  return (clean >= 0) & ~repeated


def _chooses(clean: np.ndarray, num_experts: int) -> np.ndarray:
  """bool[R, T, E]: the token's top-k names the expert."""
  return np.any(clean[..., :, None] == np.arange(num_experts, dtype=I32), axis=-2)


def _num_ranks(topk_idx: np.ndarray) -> int:
  if np.ndim(topk_idx) != 3:
    raise ValueError(f"topk_idx must be global [R, T, K], got shape {np.shape(topk_idx)}")
  return np.shape(topk_idx)[0]


# ====================================================================== layout
def get_dispatch_layout(topk_idx: np.ndarray, config: EpConfig):
  """Every rank's get_dispatch_layout.

  Args:
    topk_idx: integer [R, T, K].
  Returns:
    (tokens_per_rank int32[R, R], tokens_per_expert int32[R, E],
    is_token_in_rank bool[R, T, R]); a token counts once per rank and once per
    expert; the first axis is the calling rank.
  """
  num_ranks = _num_ranks(topk_idx)
  experts_per_rank = config.experts_per_rank(num_ranks)
  clean, _ = clean_topk(topk_idx, config.num_experts)
  per_expert = _chooses(clean, config.num_experts)
  in_rank = per_expert.reshape(per_expert.shape[:2] + (num_ranks, experts_per_rank)).any(-1)
  return (in_rank.sum(axis=1).astype(I32), per_expert.sum(axis=1).astype(I32), in_rank)


# ====================================================================== FP8
def quantize_fp8(x: np.ndarray, *, round_scale: bool = False,
                 scale_dtype=F32) -> tuple[np.ndarray, np.ndarray]:
  """Per-128-channel e4m3 quantisation.

  Args:
    x: float [..., H] (H a multiple of 128), read as float32.
    round_scale: scale = the least power of two >= amax / 448 (computed
      exactly), q = e4m3(x * (1 / scale)) (an exact multiply by a power of two).
    scale_dtype: float32 or float8_e8m0fnu (power-of-two scales only).
  Returns:
    (float8_e4m3fn[..., H], scales[..., H/128] of scale_dtype).
  """
  x = np.asarray(x).astype(F32)
  hidden = x.shape[-1]
  if hidden % FP8_GROUP:
    raise ValueError(f"FP8 needs H to be a multiple of {FP8_GROUP}, got {hidden}")
  if np.dtype(scale_dtype) == FLOAT8_E8M0 and not round_scale:
    raise ValueError("float8_e8m0fnu scales need round_scale=True")
  groups = x.reshape(x.shape[:-1] + (hidden // FP8_GROUP, FP8_GROUP))
  amax = np.maximum(np.max(np.abs(groups), axis=-1), FP8_MIN_AMAX)
  if round_scale:
    # The least 2**k with amax <= 448 * 2**k = 0.875 * 2**(k + 9), from amax's
    # own exponent (amax = m * 2**e, m in [0.5, 1)): no rounded division or log.
    mantissa, exponent = np.frexp(amax)
    exponent = np.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    scale = np.ldexp(np.float32(1.0), exponent).astype(F32)
    scale_inv = np.ldexp(np.float32(1.0), -exponent).astype(F32)
  else:
    scale = (amax / FP8_MAX).astype(F32)
    scale_inv = (FP8_MAX / amax).astype(F32)
  q = (groups * scale_inv[..., None]).astype(FLOAT8_E4M3).reshape(x.shape)
  return q, scale.astype(scale_dtype)


def dequantize_fp8(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32(q) * float32(scale) per 128-channel group -> float32 [..., H]."""
  hidden = q.shape[-1]
  groups = q.astype(F32).reshape(q.shape[:-1] + (hidden // FP8_GROUP, FP8_GROUP))
  return (groups * scales.astype(F32)[..., None]).reshape(q.shape)


# ====================================================================== HT
@dataclasses.dataclass(frozen=True)
class HtDispatch:
  """Every rank's DispatchResult (and handle) of one HT dispatch.

  Attributes (first axis: the receiving rank, except send_row's):
    x: [R, C, H] rows in (source rank, source token) order, zero bytes past
      num_tokens; dtype of the dispatched rows.
    scales: [R, C, H/128] for an FP8 dispatch, else None.
    topk_idx: int32[R, C, K]: local expert ids, -1 where the choice lives on
      another rank (and on padding rows).
    topk_weights: float32[R, C, K], 0 where topk_idx is -1.
    num_tokens: int32[R]; tokens_per_expert: int32[R, E_local] (a token counts
      once per expert); num_dropped: int32[R]; num_invalid: int32[R] (the
      sending rank's entries outside [-1, E)).
    recv_src: int32[R, C]: source id per row, -1 on padding rows.
    send_row: int32[R, T, R]: [src rank, token, dst rank] -> row on dst, -1
      where not sent there or dropped past the capacity.
  """

  x: np.ndarray
  scales: Optional[np.ndarray]
  topk_idx: np.ndarray
  topk_weights: np.ndarray
  num_tokens: np.ndarray
  tokens_per_expert: np.ndarray
  num_dropped: np.ndarray
  num_invalid: np.ndarray
  recv_src: np.ndarray
  send_row: np.ndarray


Payload = Union[np.ndarray, tuple[np.ndarray, np.ndarray]]


def ht_dispatch(x: Payload, topk_idx: np.ndarray, topk_weights: np.ndarray, config: EpConfig,
                capacity: int | None = None) -> HtDispatch:
  """Every rank's HT dispatch.

  Args:
    x: [R, T, H] rows of any dtype, or an FP8 pair (float8_e4m3fn[R, T, H],
      scales[R, T, H/128]); the bytes are moved unchanged.
    topk_idx: integer [R, T, K]; topk_weights: float [R, T, K] (read as float32).
    capacity: rows per receiver (default R * max_tokens_per_rank); rows past it,
      in (source rank, source token) order, are dropped and counted.
  Returns:
    HtDispatch.
  """
  payloads = [np.asarray(p) for p in (x if isinstance(x, (tuple, list)) else (x,))]
  num_ranks = _num_ranks(topk_idx)
  experts_per_rank = config.experts_per_rank(num_ranks)
  capacity = capacity or config.capacity(num_ranks)
  clean, num_invalid = clean_topk(topk_idx, config.num_experts)
  _, num_tokens, num_topk = clean.shape
  weights = np.asarray(topk_weights).astype(F32)

  owner = np.where(clean >= 0, clean // experts_per_rank, -1)            # [src, T, K]
  flat_owner = owner.reshape(-1, num_topk)                               # sources in order
  goes = np.any(flat_owner[:, :, None] == np.arange(num_ranks), axis=1)  # [src id, dst]
  row = np.cumsum(goes, axis=0) - 1
  kept = goes & (row < capacity)
  received = goes.sum(axis=0).astype(I32)
  send_row = np.where(kept, row, -1).astype(I32).reshape(num_ranks, num_tokens, num_ranks)

  src, dst = np.nonzero(kept)
  dst_row = row[src, dst]
  recv_src = np.full((num_ranks, capacity), -1, I32)
  recv_src[dst, dst_row] = src

  def place(values: np.ndarray, empty: np.ndarray) -> np.ndarray:
    empty[dst, dst_row] = values.reshape((-1,) + values.shape[2:])[src]
    return empty

  outs = [place(p, zero_bytes((num_ranks, capacity) + p.shape[2:], p.dtype)) for p in payloads]
  mine = flat_owner[src] == dst[:, None]                                 # [pairs, K]
  flat_clean = clean.reshape(-1, num_topk)[src]
  out_idx = np.full((num_ranks, capacity, num_topk), -1, I32)
  out_idx[dst, dst_row] = np.where(mine, flat_clean - dst[:, None] * experts_per_rank, -1)
  out_w = np.zeros((num_ranks, capacity, num_topk), F32)
  out_w[dst, dst_row] = np.where(mine, weights.reshape(-1, num_topk)[src], np.float32(0))
  per_expert = np.any(out_idx[..., None] == np.arange(experts_per_rank), axis=2)
  kept_count = np.minimum(received, capacity).astype(I32)
  return HtDispatch(x=outs[0], scales=outs[1] if len(outs) > 1 else None, topk_idx=out_idx,
                    topk_weights=out_w, num_tokens=kept_count,
                    tokens_per_expert=per_expert.sum(axis=1).astype(I32),
                    num_dropped=(received - kept_count).astype(I32), num_invalid=num_invalid,
                    recv_src=recv_src, send_row=send_row)


def ht_combine_terms(y: np.ndarray, layout: HtDispatch):
  """The terms of every rank's HT combine, in summation order.

  Returns:
    [(valid bool[R, T, 1...], value float32 (float64 for float64 y)
    [R, T, ...]) for d = 0..R-1]: the copy of token (s, t) on rank d.
  """
  y = np.asarray(y)
  acc_dtype = np.float64 if y.dtype == np.float64 else F32
  send_row = layout.send_row
  trailing = (1,) * (y.ndim - 2)
  return [((send_row[:, :, d] >= 0).reshape(send_row.shape[:2] + trailing),
           y[d][np.maximum(send_row[:, :, d], 0)].astype(acc_dtype))
          for d in range(send_row.shape[0])]


def ht_combine(y: np.ndarray, layout: HtDispatch) -> np.ndarray:
  """Every rank's HT combine.

  Args:
    y: [R, C, ...] float (bf16/f16/f32), row i of rank d computed from that
      rank's dispatched row i; padding rows are ignored. float64 (exact
      host-side values, e.g. for bounds) accumulates in float64.
  Returns:
    [R, T, ...] of y's dtype: out[s, t] = sum over d = 0..R-1 with
    send_row[s, t, d] >= 0 of float32(y[d, send_row[s, t, d]]), accumulated
    in float32 from +0.0 in that order, cast once; zeros for tokens sent nowhere.
  """
  y = np.asarray(y)
  terms = ht_combine_terms(y, layout)
  acc = np.zeros(terms[0][1].shape, terms[0][1].dtype)
  for valid, value in terms:
    acc = np.where(valid, acc + value, acc)
  return acc.astype(y.dtype)


def ht_dispatch_cached(g: np.ndarray, layout: HtDispatch) -> np.ndarray:
  """Rows of ``g`` placed where ``layout``'s dispatch placed its tokens.

  This is combine's VJP: d out[s, t] / d y[d, row] is the identity exactly
  where row is the row of (s, t) on d.

  Args:
    g: [R, T, ...] any dtype.
  Returns:
    [R, C, ...] of g's dtype: out[d, i] = g[src // T, src % T] with
    src = recv_src[d, i]; zero bytes where recv_src is -1.
  """
  g = np.asarray(g)
  recv_src = layout.recv_src
  flat = g.reshape((-1,) + g.shape[2:])
  out = zero_bytes(recv_src.shape + g.shape[2:], g.dtype)
  valid = recv_src >= 0
  out[valid] = flat[recv_src[valid]]
  return out


# ====================================================================== HT, expert-major
@dataclasses.dataclass(frozen=True)
class ExpertMajorDispatch:
  """Every rank's DispatchResult of one expert-major HT dispatch.

  Attributes (first axis: the receiving rank, except pair_row's):
    x: [R, M, H]: one row per (token, local expert) pair, grouped by local
      expert (group e at sum(group_sizes[:e])), a group's rows in (source rank,
      source token) order; zero bytes on rows holding no pair.
    scales: [R, M, H/128] for an FP8 dispatch, else None.
    topk_idx: int32[R, M]: the pair's local expert, -1 on padding.
    topk_weights: float32[R, M]: the sum, in k order from +0.0, of the token's
      weights for that expert; 0 on padding.
    num_tokens: int32[R] (pairs kept); tokens_per_expert, group_sizes:
      int32[R, E_local]; num_dropped: int32[R] (pairs past M); num_invalid: int32[R].
    pair_row: int32[R, T, R, E_local]: [src rank, token, dst rank, local
      expert] -> pair row on dst, -1 where the token did not choose that
      expert or the pair was dropped.
  """

  x: np.ndarray
  scales: Optional[np.ndarray]
  topk_idx: np.ndarray
  topk_weights: np.ndarray
  num_tokens: np.ndarray
  tokens_per_expert: np.ndarray
  group_sizes: np.ndarray
  num_dropped: np.ndarray
  num_invalid: np.ndarray
  pair_row: np.ndarray


def expert_major_rows(config: EpConfig, num_ranks: int, alignment: int) -> int:
  """M by default: R*T*min(K, E_local) + E_local*(A-1), rounded up to A."""
  experts_per_rank = config.experts_per_rank(num_ranks)
  rows = (num_ranks * config.max_tokens_per_rank * min(config.num_topk, experts_per_rank)
          + experts_per_rank * (alignment - 1))
  return -(-rows // alignment) * alignment


def ht_dispatch_expert_major(x: Payload, topk_idx: np.ndarray, topk_weights: np.ndarray,
                             config: EpConfig, *, alignment: int = 1,
                             capacity: int | None = None) -> ExpertMajorDispatch:
  """Every rank's expert-major HT dispatch (capacity: M, a multiple of alignment)."""
  payloads = [np.asarray(p) for p in (x if isinstance(x, (tuple, list)) else (x,))]
  num_ranks = _num_ranks(topk_idx)
  experts_per_rank = config.experts_per_rank(num_ranks)
  num_rows = capacity or expert_major_rows(config, num_ranks, alignment)
  clean, num_invalid = clean_topk(topk_idx, config.num_experts)
  _, num_tokens, num_topk = clean.shape
  flat = clean.reshape(-1, num_topk)                                     # sources in order
  flat_w = np.asarray(topk_weights).astype(F32).reshape(-1, num_topk)
  outs = [zero_bytes((num_ranks, num_rows) + p.shape[2:], p.dtype) for p in payloads]
  out_idx = np.full((num_ranks, num_rows), -1, I32)
  out_w = np.zeros((num_ranks, num_rows), F32)
  kept_per_expert = np.zeros((num_ranks, experts_per_rank), I32)
  sizes = np.zeros((num_ranks, experts_per_rank), I32)
  dropped = np.zeros(num_ranks, I32)
  pair_row = np.full((num_ranks * num_tokens, num_ranks, experts_per_rank), -1, I32)
  for dst in range(num_ranks):
    start = 0
    for e in range(experts_per_rank):
      expert = dst * experts_per_rank + e
      sources = np.nonzero(np.any(flat == expert, axis=1))[0]            # in (rank, token) order
      padded = -(-len(sources) // alignment) * alignment
      kept = sources[:max(0, min(len(sources), num_rows - start))]
      rows_ = start + np.arange(len(kept))
      for p, out in zip(payloads, outs):
        out[dst, rows_] = p.reshape((-1,) + p.shape[2:])[kept]
      out_idx[dst, rows_] = e
      weight = np.zeros(len(kept), F32)
      for k in range(num_topk):
        weight = weight + np.where(flat[kept, k] == expert, flat_w[kept, k], np.float32(0))
      out_w[dst, rows_] = weight
      pair_row[kept, dst, e] = rows_
      kept_per_expert[dst, e] = len(kept)
      sizes[dst, e] = max(0, min(padded, num_rows - start))
      dropped[dst] += len(sources) - len(kept)
      start += padded
  return ExpertMajorDispatch(
      x=outs[0], scales=outs[1] if len(outs) > 1 else None, topk_idx=out_idx, topk_weights=out_w,
      num_tokens=kept_per_expert.sum(axis=1).astype(I32), tokens_per_expert=kept_per_expert,
      group_sizes=sizes, num_dropped=dropped, num_invalid=num_invalid,
      pair_row=pair_row.reshape(num_ranks, num_tokens, num_ranks, experts_per_rank))


def ht_combine_expert_major(y: np.ndarray, layout: ExpertMajorDispatch) -> np.ndarray:
  """Every rank's expert-major combine: y [R, M, ...] -> [R, T, ...] of y's dtype.

  out[s, t] = sum over d = 0..R-1 (from +0.0) of partial_d, partial_d = sum
  over t's pairs on d in ascending local expert (from +0.0) of float32(y row);
  float32 throughout (float64 for float64 y), one cast at the end.
  """
  y = np.asarray(y)
  acc_dtype = np.float64 if y.dtype == np.float64 else F32
  pair_row = layout.pair_row
  num_src, num_tokens, num_ranks, experts_per_rank = pair_row.shape
  trailing = (1,) * (y.ndim - 2)
  total = np.zeros((num_src, num_tokens) + y.shape[2:], acc_dtype)
  for d in range(num_ranks):
    partial = np.zeros_like(total)
    for e in range(experts_per_rank):
      row = pair_row[:, :, d, e]
      value = y[d][np.maximum(row, 0)].astype(acc_dtype)
      partial = np.where((row >= 0).reshape(row.shape + trailing), partial + value, partial)
    total = total + partial
  return total.astype(y.dtype)


def ht_combine_expert_major_vjp(ct_out: np.ndarray, layout: ExpertMajorDispatch) -> np.ndarray:
  """d/dy of the expert-major combine: ct_y[d, row of (s, t, e)] = ct_out[s, t];
  zero bytes on padding rows. [R, T, ...] -> [R, M, ...]."""
  ct_out = np.asarray(ct_out)
  pair_row = layout.pair_row
  out = zero_bytes(layout.topk_idx.shape + ct_out.shape[2:], ct_out.dtype)
  src, token, dst, _ = np.nonzero(pair_row >= 0)
  out[dst, pair_row[pair_row >= 0]] = ct_out[src, token]
  return out


def ht_dispatch_expert_major_vjp(ct_x: np.ndarray, ct_topk_weights: np.ndarray,
                                 topk_idx: np.ndarray, config: EpConfig,
                                 layout: ExpertMajorDispatch) -> tuple[np.ndarray, np.ndarray]:
  """d/dx and d/dtopk_weights of the expert-major dispatch: x[s, t] is copied to
  each of its pair rows (grad_x: the expert-major combine of ct_x), and each
  pair weight is a sum of w[s, t, k] over the k naming that expert
  (grad_w[s, t, k] = ct_w[owner of e_k, row of the pair], 0 for -1 entries).
  Returns (grad_x [R, T, H] of ct_x's dtype, grad_w float32 [R, T, K])."""
  clean, _ = clean_topk(topk_idx, config.num_experts)
  num_ranks = clean.shape[0]
  experts_per_rank = config.experts_per_rank(num_ranks)
  ct_w = np.asarray(ct_topk_weights).astype(F32)
  src, token = np.indices(clean.shape[:2])
  grad_w = np.zeros(clean.shape, F32)
  for k in range(clean.shape[2]):
    expert = clean[:, :, k]
    owner, local = np.divmod(np.maximum(expert, 0), experts_per_rank)
    row = layout.pair_row[src, token, owner, local]
    valid = (expert >= 0) & (row >= 0)
    grad_w[:, :, k] = np.where(valid, ct_w[owner, np.maximum(row, 0)], np.float32(0))
  return ht_combine_expert_major(ct_x, layout), grad_w


# ====================================================================== LL
@dataclasses.dataclass(frozen=True)
class LlDispatch:
  """Every rank's LowLatencyDispatchResult of one LL dispatch.

  Attributes (first axis: the receiving rank, except row_of's):
    x: [R, E_local, L, H]: per local expert, one row per token choosing it, in
      (source rank, source token) order; zero bytes at and past count (the
      contract leaves those rows unspecified). bf16 (the input dtype) or
      float8_e4m3fn with use_fp8.
    scales: float32[R, E_local, L, H/128] with use_fp8, else None.
    count: int32[R, E_local]; num_invalid: int32[R] (the sending rank's).
    recv_src: int32[R, E_local, L]: source id per row, -1 at and past count.
    row_of: int32[R, T, E]: [src rank, token, global expert] -> row in that
      expert's block, -1 where the token did not choose it.
  """

  x: np.ndarray
  scales: Optional[np.ndarray]
  count: np.ndarray
  num_invalid: np.ndarray
  recv_src: np.ndarray
  row_of: np.ndarray


def ll_dispatch(x: np.ndarray, topk_idx: np.ndarray, config: EpConfig, *,
                use_fp8: bool = False) -> LlDispatch:
  """Every rank's LL dispatch.

  Args:
    x: [R, T, H] rows (T <= T_ll), moved unchanged, or quantised by
      quantize_fp8 (float32 scales) with use_fp8.
    topk_idx: integer [R, T, K].
  Returns:
    LlDispatch.
  """
  x = np.asarray(x)
  num_ranks = _num_ranks(topk_idx)
  experts_per_rank = config.experts_per_rank(num_ranks)
  num_experts = config.num_experts
  rows = num_ranks * config.ll_max_tokens
  clean, num_invalid = clean_topk(topk_idx, num_experts)
  num_tokens = clean.shape[1]
  if num_tokens > config.ll_max_tokens:
    raise ValueError(f"{num_tokens} tokens exceed T_ll = {config.ll_max_tokens}")
  chooses = _chooses(clean, num_experts).reshape(-1, num_experts)        # [src id, E]
  row = np.cumsum(chooses, axis=0) - 1
  src, expert = np.nonzero(chooses)
  expert_row = row[src, expert]
  recv_src = np.full((num_experts, rows), -1, I32)
  recv_src[expert, expert_row] = src
  payloads = quantize_fp8(x) if use_fp8 else (x,)
  outs = []
  for p in payloads:
    out = zero_bytes((num_experts, rows) + p.shape[2:], p.dtype)
    out[expert, expert_row] = p.reshape((-1,) + p.shape[2:])[src]
    outs.append(out.reshape((num_ranks, experts_per_rank, rows) + p.shape[2:]))
  return LlDispatch(
      x=outs[0], scales=outs[1] if use_fp8 else None,
      count=chooses.sum(axis=0).astype(I32).reshape(num_ranks, experts_per_rank),
      num_invalid=num_invalid,
      recv_src=recv_src.reshape(num_ranks, experts_per_rank, rows),
      row_of=np.where(chooses, row, -1).astype(I32).reshape(num_ranks, num_tokens, num_experts))


def _ll_pick(y: np.ndarray, layout: LlDispatch, clean_k: np.ndarray) -> np.ndarray:
  """float32[R, T, ...]: the row of (s, t, clean_k[s, t]) in y (row 0 where -1)."""
  num_ranks, num_tokens, num_experts = layout.row_of.shape
  blocks = y.reshape((num_experts,) + y.shape[2:])
  expert = np.maximum(clean_k, 0)
  src_rank, token = np.indices(clean_k.shape)
  row = np.maximum(layout.row_of[src_rank, token, expert], 0)
  return blocks[expert, row].astype(F32)


def ll_combine_terms(y: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                     layout: LlDispatch):
  """The terms of every rank's LL combine, in summation order.

  Returns:
    [(valid bool[R, T, 1...], value float32[R, T, ...]) for k = 0..K-1]:
    float32(w[s, t, k]) * float32(row of (t, e_k)), the product rounded to
    float32; valid where entry k is in [0, E).
  """
  y = np.asarray(y)
  clean, _ = clean_topk(topk_idx, layout.row_of.shape[2])
  weights = np.asarray(topk_weights).astype(F32)
  trailing = (1,) * (y.ndim - 3)
  shape = clean.shape[:2] + trailing
  return [((clean[:, :, k] >= 0).reshape(shape),
           weights[:, :, k].reshape(shape) * _ll_pick(y, layout, clean[:, :, k]))
          for k in range(clean.shape[2])]


def ll_combine(y: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
               layout: LlDispatch) -> np.ndarray:
  """Every rank's LL combine.

  Args:
    y: [R, E_local, L, ...] float rows in layout's row order.
    topk_idx: integer [R, T, K] (the dispatch's); topk_weights: float [R, T, K]
      (read as float32).
  Returns:
    [R, T, ...] of y's dtype: out[s, t] = sum over valid k, in k order, from
    +0.0, of float32(w[s, t, k]) * float32(y row of (t, e_k)), each product
    rounded to float32 before it is added; one cast. A repeated expert adds
    its row once per k naming it.
  """
  y = np.asarray(y)
  terms = ll_combine_terms(y, topk_idx, topk_weights, layout)
  acc = np.zeros(terms[0][1].shape, F32)
  for valid, value in terms:
    acc = np.where(valid, acc + value, acc)
  return acc.astype(y.dtype)


def ll_pair_weights(topk_idx: np.ndarray, topk_weights: np.ndarray,
                    layout: LlDispatch) -> np.ndarray:
  """The rows' weights of an LL dispatch given topk_weights: float32[R, E_local,
  L], row (t, e) = the sum, in k order from +0.0, of w[s, t, k] over the k
  naming e; 0 at and past count."""
  num_ranks, num_tokens, num_experts = layout.row_of.shape
  clean, _ = clean_topk(topk_idx, num_experts)
  weights = np.asarray(topk_weights).astype(F32)
  summed = np.zeros((num_ranks, num_tokens, num_experts), F32)
  src, token = np.indices(clean.shape[:2])
  for k in range(clean.shape[2]):
    valid = clean[:, :, k] >= 0
    e = np.maximum(clean[:, :, k], 0)
    summed[src, token, e] = np.where(valid, summed[src, token, e] + weights[:, :, k],
                                     summed[src, token, e])
  out = np.zeros((num_experts, layout.recv_src.shape[-1]), F32)
  s_rank, s_token, expert = np.nonzero(layout.row_of >= 0)
  out[expert, layout.row_of[s_rank, s_token, expert]] = summed[s_rank, s_token, expert]
  return out.reshape(layout.recv_src.shape)


def ll_combine_presummed(y: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray,
                         layout: LlDispatch) -> np.ndarray:
  """Every rank's LL combine with the weights given to the dispatch.

  Each rank d holding experts of token (s, t) returns one row p_d = y.dtype(the
  float32 sum, from +0.0, over t's experts on d in ascending local expert, of
  W * float32(y row), each product rounded to float32), W = ll_pair_weights;
  out[s, t] = the float32 sum, from +0.0, of float32(p_d) in rank order; one
  cast to y's dtype.

  Args:
    y: [R, E_local, L, ...]; topk_idx, topk_weights: [R, T, K] (the dispatch's).
  Returns:
    [R, T, ...] of y's dtype.
  """
  y = np.asarray(y)
  pair_weight = ll_pair_weights(topk_idx, topk_weights, layout)
  num_ranks, num_tokens, num_experts = layout.row_of.shape
  experts_per_rank = num_experts // num_ranks
  trailing = (1,) * (y.ndim - 3)
  total = np.zeros((num_ranks, num_tokens) + y.shape[3:], F32)
  for d in range(num_ranks):
    partial = np.zeros_like(total)
    for e in range(experts_per_rank):
      row = layout.row_of[:, :, d * experts_per_rank + e]                # [src, T]
      safe = np.maximum(row, 0)
      value = (pair_weight[d, e][safe].reshape(row.shape + trailing)
               * y[d, e][safe].astype(F32))
      partial = np.where((row >= 0).reshape(row.shape + trailing), partial + value, partial)
    total = total + partial.astype(y.dtype).astype(F32)
  return total.astype(y.dtype)


# ====================================================================== gradients
# The VJPs of the four ops, as jax_ep defines them (jax_ep/ht_ops.py, ll_ops.py), derived
# from the forward formulas above. ct_* are cotangents of the outputs, in the
# outputs' dtypes.
def ht_combine_vjp(ct_out: np.ndarray, layout: HtDispatch) -> np.ndarray:
  """d/dy of combine: out[s, t] = sum_d y[d, row_d(s, t)] is linear with
  coefficient 1 at exactly those rows, so ct_y[d, i] = ct_out[source of row i]
  (zero on padding rows): ht_dispatch_cached. [R, T, H] -> [R, C, H]."""
  return ht_dispatch_cached(ct_out, layout)


def ht_dispatch_vjp(ct_x: np.ndarray, ct_topk_weights: np.ndarray,
                    layout: HtDispatch) -> tuple[np.ndarray, np.ndarray]:
  """d/dx and d/dtopk_weights of the HT dispatch.

  Row i of rank d is a copy of x[s, t] (its source), so
  grad_x[s, t] = sum over the ranks d holding (s, t) of ct_x[d, row] -- a
  combine of ct_x (rank order, float32, one cast to ct_x's dtype).
  topk_weights[d, i, k] is w[s, t, k] where k's expert lives on d, else the
  constant 0, so grad_w[s, t, k] = ct_topk_weights[owner of k, row, k] (a
  combine of ct with entries of other ranks' experts zeroed: one nonzero term).

  Args:
    ct_x: [R, C, H]; ct_topk_weights: float [R, C, K] (float64 stays float64:
      exact values for a bound).
  Returns:
    (grad_x [R, T, H] of ct_x's dtype, grad_w float32 (or float64) [R, T, K]).
  """
  ct_w = np.asarray(ct_topk_weights)
  ct_w = ct_w if ct_w.dtype == np.float64 else ct_w.astype(F32)
  kept = np.where(layout.topk_idx >= 0, ct_w, ct_w.dtype.type(0))
  return ht_combine(ct_x, layout), ht_combine(kept, layout)


def ll_dispatch_vjp(ct_x: np.ndarray, topk_idx: np.ndarray, layout: LlDispatch) -> np.ndarray:
  """d/dx of the LL dispatch: each distinct expert of token (s, t) holds one
  copy of x[s, t], so grad_x[s, t] = sum over its distinct valid experts, in
  order of first choice, of float32(ct_x row of (t, e)), from +0.0, one cast
  to ct_x's dtype (rows at and past count never enter).

  Args:
    ct_x: [R, E_local, L, H]; topk_idx: integer [R, T, K].
  Returns:
    [R, T, H] of ct_x's dtype.
  """
  clean, _ = clean_topk(topk_idx, layout.row_of.shape[2])
  distinct = np.where(first_choice(clean), clean, -1)
  return ll_combine(ct_x, distinct, np.ones(clean.shape, F32), layout)


@dataclasses.dataclass(frozen=True)
class LlCombineVjp:
  """Cotangents of low_latency_combine's inputs.

  Attributes:
    grad_y: [R, E_local, L, H] of y's dtype; zero bytes at and past count.
    grad_weights: float64[R, T, K]: the exact dot products (0 for invalid k).
    grad_weights_abs: float64[R, T, K]: sum of |terms| of each dot product
      (see f32_sum_bound).
    terms: H, the number of terms of each dot product.
  """

  grad_y: np.ndarray
  grad_weights: np.ndarray
  grad_weights_abs: np.ndarray
  terms: int


def ll_combine_vjp(ct_out: np.ndarray, y: np.ndarray, topk_idx: np.ndarray,
                   topk_weights: np.ndarray, layout: LlDispatch) -> LlCombineVjp:
  """d/dy and d/dtopk_weights of the LL combine (out[s, t] = sum_k w_k * y_k).

  grad_y at the row of (s, t, e) = float32(ct_out[s, t]) * W, W = the float32
  sum, in k order, of w[s, t, k] over the k naming e; one cast to y's dtype.
  grad_w[s, t, k] = sum_h float32(ct_out[s, t, h]) * float32(y row of
  (t, e_k))[h] for valid k, else 0 (returned exactly, in float64, with the
  sum of |terms|: an implementation's float32 sum is compared within
  f32_sum_bound).

  Args:
    ct_out: [R, T, H]; y: [R, E_local, L, H]; topk_idx: integer [R, T, K];
    topk_weights: float [R, T, K].
  """
  y = np.asarray(y)
  num_ranks, num_tokens, num_experts = layout.row_of.shape
  clean, _ = clean_topk(topk_idx, num_experts)
  weights = np.asarray(topk_weights).astype(F32)
  ct = np.asarray(ct_out).astype(F32)
  pair_weight = np.zeros((num_ranks, num_tokens, num_experts), F32)
  src_rank, token = np.indices(clean.shape[:2])
  for k in range(clean.shape[2]):
    valid = clean[:, :, k] >= 0
    e = np.maximum(clean[:, :, k], 0)
    pair_weight[src_rank, token, e] = np.where(
        valid, pair_weight[src_rank, token, e] + weights[:, :, k], pair_weight[src_rank, token, e])
  blocks = zero_bytes((num_experts,) + y.shape[2:], y.dtype)
  s_rank, s_token, expert = np.nonzero(layout.row_of >= 0)
  rows = layout.row_of[s_rank, s_token, expert]
  blocks[expert, rows] = (ct[s_rank, s_token] * pair_weight[s_rank, s_token, expert][:, None]
                          ).astype(y.dtype)
  grad_w = np.zeros(clean.shape, np.float64)
  grad_abs = np.zeros(clean.shape, np.float64)
  for k in range(clean.shape[2]):
    terms = ct.astype(np.float64) * _ll_pick(y, layout, clean[:, :, k]).astype(np.float64)
    valid = clean[:, :, k] >= 0
    grad_w[:, :, k] = np.where(valid, terms.sum(-1), 0.0)
    grad_abs[:, :, k] = np.where(valid, np.abs(terms).sum(-1), 0.0)
  return LlCombineVjp(grad_y=blocks.reshape(y.shape), grad_weights=grad_w,
                      grad_weights_abs=grad_abs, terms=y.shape[-1])


def f32_sum_bound(abs_sum: np.ndarray, terms: int) -> np.ndarray:
  """Bound on |float32 sum - exact sum| of ``terms`` values that are exact in
  float32 (e.g. products of two bf16 numbers), added in ANY order or tree
  (an implementation's reduction order is unspecified): gamma_{n-1} * sum|x_i|,
  gamma_m = m u / (1 - m u), u = 2**-24 (Higham, Accuracy and Stability of
  Numerical Algorithms, eq. 4.4). Fused multiply-adds of exact products add no
  error. A float64 evaluation of the exact sum adds at most n * 2**-53 * sum|x_i|,
  included."""
  m = max(terms - 1, 1) * F32_UNIT_ROUNDOFF
  return np.asarray(abs_sum) * (m / (1 - m) + terms * 2.0 ** -53)


def ulp_distance(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
  """int64 distance in units in the last place between same-dtype floats
  (bfloat16, float16, float32): the number of representable values between
  them, +0 and -0 being the same point; 2**32 where either is NaN."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  if actual.dtype != expected.dtype or actual.shape != expected.shape:
    raise ValueError(f"ulp_distance needs equal dtypes and shapes, got {actual.dtype}"
                     f"{actual.shape} and {expected.dtype}{expected.shape}")
  width = actual.dtype.itemsize * 8
  unsigned = {16: np.uint16, 32: np.uint32}[width]

  def ordered(a: np.ndarray) -> np.ndarray:
    raw = a.view(unsigned).astype(np.int64)
    magnitude = raw & ((1 << (width - 1)) - 1)
    return np.where(raw >> (width - 1), -magnitude, magnitude)

  distance = np.abs(ordered(actual) - ordered(expected))
  nan = np.isnan(actual.astype(F32)) | np.isnan(expected.astype(F32))
  return np.where(nan, np.int64(1) << 32, distance)
