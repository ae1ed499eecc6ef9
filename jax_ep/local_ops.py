"""Local steps of the portable backend: one rank's work before and after an exchange.

Each step has two implementations with identical results:
  * an XLA FFI handler of jax_ep's CPU extension (``xla_ffi/cpu/``), used when
    lowering for the CPU;
  * a jax.numpy twin, used on every other platform (GPU/TPU without the CUDA
    kernels) and as a cross-check in the tests.
``jax.lax.platform_dependent`` picks one at lowering time. Index conventions
are documented in ``xla_ffi/cpu/portable_ops.h``.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep import _extension
from jax_ep._vma import match_vma, result_type, vma_of
from jax_ep.errors import EpError

I32 = jnp.int32
F32 = jnp.float32


def _per_platform(ffi_fn: Callable, jnp_fn: Callable, *args):
  args = match_vma(*args)

  def on_cpu(*a):
    _extension.cpu_module()  # registers the CPU targets
    return ffi_fn(*a)

  def on_other(*a):
    # The FFI results vary like the inputs (result_type); so must the twin's. jnp
    # can return constants (e.g. reductions over T_local = 0 tokens), which do not.
    axes = tuple(sorted(frozenset().union(*(vma_of(x) for x in a))))
    return jax.tree.map(lambda r: match_vma(r, extra_axes=axes)[0], jnp_fn(*a))

  return jax.lax.platform_dependent(*args, cpu=on_cpu, default=on_other)


def _ffi(op: str, results, *args, has_side_effect: bool = False, **attrs):
  """The custom call of CPU handler ``op`` (xla_ffi/exports.h names its target)."""
  return jax.ffi.ffi_call(_extension.cpu_target(op), results,
                          has_side_effect=has_side_effect)(*args, **attrs)


def first_occurrence(clean_idx: jax.Array) -> jax.Array:
  """bool[T, K]: entry is a valid expert not chosen at an earlier k of its token."""
  num_topk = clean_idx.shape[1]
  same = clean_idx[:, :, None] == clean_idx[:, None, :]
  earlier = jnp.tril(jnp.ones((num_topk, num_topk), dtype=bool), k=-1)
  repeated = jnp.any(same & earlier[None], axis=2)
  return (clean_idx >= 0) & ~repeated


def _drop_negative(index: jax.Array, bound: int) -> jax.Array:
  """Maps indices outside [0, bound) to ``bound`` (dropped by mode='drop'/'fill')."""
  return jnp.where((index >= 0) & (index < bound), index, bound)


# ------------------------------------------------------------------ layout
def layout(topk_idx: jax.Array, *, num_experts: int, num_ranks: int):
  """Counts of one rank's routing.

  Args:
    topk_idx: int32[T, K], any values.
  Returns:
    clean_idx int32[T, K] (entries outside [-1, E) replaced by -1),
    num_invalid int32[], first_invalid int32[3] ((token, slot, value) of the
    first invalid entry, or (-1, -1, 0)), tokens_per_rank int32[R],
    tokens_per_expert int32[E], is_token_in_rank bool[T, R].
  """
  num_tokens, num_topk = topk_idx.shape

  def ffi_fn(idx):
    results = (result_type((num_tokens, num_topk), I32, idx), result_type((), I32, idx),
               result_type((3,), I32, idx), result_type((num_ranks,), I32, idx),
               result_type((num_experts,), I32, idx),
               result_type((num_tokens, num_ranks), jnp.bool_, idx))
    return _ffi("layout", results, idx, num_experts=np.int64(num_experts),
                num_ranks=np.int64(num_ranks))

  def jnp_fn(idx):
    valid = (idx >= -1) & (idx < num_experts)
    clean = jnp.where(valid, idx, -1)
    if idx.size == 0:  # T_local = 0 (argmax of an empty array is undefined)
      first_invalid = jnp.array([-1, -1, 0], I32)
    else:
      flat_first = jnp.argmax(~valid.reshape(-1)).astype(I32)
      first_invalid = jnp.where(
          ~jnp.all(valid),
          jnp.stack([flat_first // num_topk, flat_first % num_topk,
                     idx.reshape(-1)[flat_first]]),
          jnp.array([-1, -1, 0], I32))
    first = first_occurrence(clean)
    per_expert = jnp.any((clean[:, :, None] == jnp.arange(num_experts)) & first[:, :, None], axis=1)
    experts_per_rank = num_experts // num_ranks
    owner = jnp.where(clean >= 0, clean // experts_per_rank, -1)
    in_rank = jnp.any(owner[:, :, None] == jnp.arange(num_ranks), axis=1)
    return (clean, jnp.sum(~valid, dtype=I32), first_invalid,
            jnp.sum(in_rank, axis=0, dtype=I32), jnp.sum(per_expert, axis=0, dtype=I32), in_rank)

  return _per_platform(ffi_fn, jnp_fn, topk_idx)


def check_invalid(clean_idx: jax.Array, invalid_counts: jax.Array, first_invalid: jax.Array, *,
                  num_experts: int) -> jax.Array:
  """Fails on every rank when any rank saw an invalid index (EpConfig.debug_checks).

  Args:
    clean_idx: int32[T, K], passed through (later steps depend on the check).
    invalid_counts: int32[R]; first_invalid: int32[R, 3], gathered over the EP axis.
  """

  def ffi_fn(idx, counts, first):
    # A side effect: the check runs even where nothing consumes its result.
    return _ffi("check_invalid", result_type(idx.shape, I32, idx), idx, counts, first,
                has_side_effect=True, num_experts=np.int64(num_experts))

  def jnp_fn(idx, counts, first):
    jax.debug.callback(functools.partial(_raise_invalid, num_experts=num_experts), counts, first)
    return idx

  return _per_platform(ffi_fn, jnp_fn, clean_idx, invalid_counts, first_invalid)


def _raise_invalid(counts, first, *, num_experts: int) -> None:
  counts = np.asarray(counts)
  if counts.sum() == 0:
    return
  rank = int(np.argmax(counts > 0))
  token, slot, value = (int(v) for v in np.asarray(first)[rank])
  raise EpError(
      f"jax_ep debug_checks: {int(counts.sum())} top-k index(es) outside [-1, {num_experts}) on "
      f"the EP group (per rank: {counts.tolist()}); first on rank {rank}: "
      f"topk_idx[{token}][{slot}] = {value}. EpConfig(debug_checks=True) makes these errors; "
      "without it they are treated as -1 and counted in num_invalid.")


# ------------------------------------------------------------------ HT
def ht_route(clean_idx: jax.Array, weights: jax.Array, row_offset: jax.Array, *,
             num_experts: int, capacity: int):
  """Sender side of the HT dispatch.

  Args:
    clean_idx: int32[T, K]; weights: float32[T, K];
    row_offset: int32[R], row where this rank's tokens start on each receiver.
  Returns:
    send_idx int32[R, T, K] (receiver-local expert or -1), send_w float32[R, T, K],
    send_slot int32[T, R] (r*T + t or -1), send_row int32[T, R] (row on r, -1 if
    not sent or dropped past ``capacity``).
  """
  num_tokens, num_topk = clean_idx.shape
  num_ranks = row_offset.shape[0]
  experts_per_rank = num_experts // num_ranks

  def ffi_fn(idx, w, offset):
    results = (result_type((num_ranks, num_tokens, num_topk), I32, idx),
               result_type((num_ranks, num_tokens, num_topk), F32, idx),
               result_type((num_tokens, num_ranks), I32, idx),
               result_type((num_tokens, num_ranks), I32, idx))
    return _ffi("ht_route", results, idx, w, offset,
                num_experts=np.int64(num_experts), capacity=np.int64(capacity))

  def jnp_fn(idx, w, offset):
    ranks = jnp.arange(num_ranks, dtype=I32)
    owner = jnp.where(idx >= 0, idx // experts_per_rank, -1)
    mine = owner[None] == ranks[:, None, None]
    send_idx = jnp.where(mine, idx[None] - ranks[:, None, None] * experts_per_rank, -1)
    send_w = jnp.where(mine, w[None], 0.0).astype(F32)
    in_rank = jnp.any(mine, axis=2)
    tokens = jnp.arange(num_tokens, dtype=I32)
    send_slot = jnp.where(in_rank, ranks[:, None] * num_tokens + tokens[None], -1)
    row = jnp.cumsum(in_rank, axis=1, dtype=I32) - 1 + offset[:, None]
    send_row = jnp.where(in_rank & (row < capacity), row, -1)
    return send_idx, send_w, send_slot.T, send_row.T

  return _per_platform(ffi_fn, jnp_fn, clean_idx, weights, row_offset)


def ht_compact(recv_idx: jax.Array, recv_w: jax.Array, *, experts_per_rank: int, capacity: int):
  """Receiver side of the HT dispatch: rows in (source rank, source token) order.

  Args:
    recv_idx: int32[R, T, K]; recv_w: float32[R, T, K] (a row is present iff
      some idx >= 0).
  Returns:
    recv_src int32[C], out_idx int32[C, K], out_w float32[C, K],
    tokens_per_expert int32[E_local], num_tokens int32[], num_dropped int32[].
  """
  num_ranks, num_tokens, num_topk = recv_idx.shape

  def ffi_fn(idx, w):
    results = (result_type((capacity,), I32, idx), result_type((capacity, num_topk), I32, idx),
               result_type((capacity, num_topk), F32, idx),
               result_type((experts_per_rank,), I32, idx), result_type((), I32, idx),
               result_type((), I32, idx))
    return _ffi("ht_compact", results, idx, w,
                experts_per_rank=np.int64(experts_per_rank))

  def jnp_fn(idx, w):
    flat_idx = idx.reshape(num_ranks * num_tokens, num_topk)
    present = jnp.any(flat_idx >= 0, axis=1)
    row = jnp.cumsum(present, dtype=I32) - 1
    target = jnp.where(present & (row < capacity), row, capacity)
    received = jnp.sum(present, dtype=I32)
    num_kept = jnp.minimum(received, capacity)
    sources = jnp.arange(num_ranks * num_tokens, dtype=I32)
    recv_src = jnp.full((capacity,), -1, I32).at[target].set(sources, mode="drop")
    out_idx = jnp.full((capacity, num_topk), -1, I32).at[target].set(flat_idx, mode="drop")
    out_w = jnp.zeros((capacity, num_topk), F32).at[target].set(
        w.reshape(-1, num_topk), mode="drop")
    first = first_occurrence(out_idx)
    per_expert = (out_idx[:, :, None] == jnp.arange(experts_per_rank)) & first[:, :, None]
    tokens_per_expert = jnp.sum(jnp.any(per_expert, axis=1), axis=0, dtype=I32)
    return recv_src, out_idx, out_w, tokens_per_expert, num_kept, received - num_kept

  return _per_platform(ffi_fn, jnp_fn, recv_idx, recv_w)


# ------------------------------------------------------------------ LL
def ll_route(clean_idx: jax.Array, *, num_experts: int):
  """Sender side of the LL dispatch.

  Returns:
    send_slot int32[T, K]: e*T + t for the first k choosing expert e, else -1;
    send_mask int32[E, T]: 1 where token t chose expert e.
  """
  num_tokens, num_topk = clean_idx.shape

  def ffi_fn(idx):
    results = (result_type((num_tokens, num_topk), I32, idx),
               result_type((num_experts, num_tokens), I32, idx))
    return _ffi("ll_route", results, idx, num_experts=np.int64(num_experts))

  def jnp_fn(idx):
    first = first_occurrence(idx)
    tokens = jnp.arange(num_tokens, dtype=I32)[:, None]
    send_slot = jnp.where(first, idx * num_tokens + tokens, -1)
    chosen = jnp.any((idx[:, :, None] == jnp.arange(num_experts)) & first[:, :, None], axis=1)
    return send_slot, chosen.T.astype(I32)

  return _per_platform(ffi_fn, jnp_fn, clean_idx)


def ll_compact(recv_mask: jax.Array, *, rows_per_expert: int):
  """Receiver side of the LL dispatch.

  Args:
    recv_mask: int32[R, E_local, T], 1 where (source rank, expert, token) arrived.
  Returns:
    recv_src int32[E_local, rows] (source id s*T + t, -1 past count),
    count int32[E_local], gather_index int32[E_local, rows] (flat index into the
    [R, E_local, T] exchange buffer, -1 past count).
  """
  num_ranks, experts_per_rank, num_tokens = recv_mask.shape

  def ffi_fn(mask):
    results = (result_type((experts_per_rank, rows_per_expert), I32, mask),
               result_type((experts_per_rank,), I32, mask),
               result_type((experts_per_rank, rows_per_expert), I32, mask))
    return _ffi("ll_compact", results, mask)

  def jnp_fn(mask):
    arrived = jnp.transpose(mask, (1, 0, 2)).reshape(experts_per_rank, num_ranks * num_tokens) > 0
    row = jnp.cumsum(arrived, axis=1, dtype=I32) - 1
    keep = arrived & (row < rows_per_expert)
    target = jnp.where(keep, row, rows_per_expert)
    experts = jnp.arange(experts_per_rank, dtype=I32)[:, None]
    sources = jnp.broadcast_to(jnp.arange(num_ranks * num_tokens, dtype=I32),
                               (experts_per_rank, num_ranks * num_tokens))
    src_rank, src_token = sources // num_tokens, sources % num_tokens
    flat = (src_rank * experts_per_rank + experts) * num_tokens + src_token
    rows = jnp.broadcast_to(experts, target.shape)
    empty = jnp.full((experts_per_rank, rows_per_expert), -1, I32)
    recv_src = empty.at[rows, target].set(sources, mode="drop")
    gather_index = empty.at[rows, target].set(flat, mode="drop")
    return recv_src, jnp.sum(keep, axis=1, dtype=I32), gather_index

  return _per_platform(ffi_fn, jnp_fn, recv_mask)


# ------------------------------------------------------------------ row movement
def scatter_rows(src: jax.Array, index: jax.Array, num_out_rows: int) -> jax.Array:
  """out[index[n, m]] = src[n] (index in [0, P)); other rows zero. Any dtype.

  Args:
    src: [N, ...]; index: int32[N, M] (destinations must be distinct).
  Returns:
    [P, ...] with P = num_out_rows.
  """
  out_shape = (num_out_rows,) + src.shape[1:]

  def ffi_fn(rows, idx):
    return _ffi("scatter_rows", result_type(out_shape, src.dtype, rows), rows, idx)

  def jnp_fn(rows, idx):
    width = idx.shape[1]
    repeated = jnp.broadcast_to(rows[:, None], (rows.shape[0], width) + rows.shape[1:])
    flat = repeated.reshape((-1,) + rows.shape[1:])
    return jnp.zeros(out_shape, src.dtype).at[_drop_negative(idx.reshape(-1), num_out_rows)].set(
        flat, mode="drop")

  return _per_platform(ffi_fn, jnp_fn, src, index)


def gather_rows(src: jax.Array, index: jax.Array) -> jax.Array:
  """out[n] = src[index[n]] (index in [0, P)), zero rows elsewhere. Any dtype.

  Args:
    src: [P, ...]; index: int32[N].
  Returns:
    [N, ...].
  """
  out_shape = index.shape[:1] + src.shape[1:]

  def ffi_fn(rows, idx):
    return _ffi("gather_rows", result_type(out_shape, src.dtype, rows), rows, idx)

  def jnp_fn(rows, idx):
    if rows.shape[0] == 0:  # every index is out of range (jnp.take refuses an empty axis)
      return jnp.zeros(out_shape, src.dtype)
    return jnp.take(rows, _drop_negative(idx, rows.shape[0]), axis=0, mode="fill", fill_value=0)

  return _per_platform(ffi_fn, jnp_fn, src, index)


def gather_sum(src: jax.Array, index: jax.Array) -> jax.Array:
  """out[n] = sum_m src[index[n, m]], fp32 in order of m (from 0.0), cast to src.dtype.

  gather_reduce with unit weights, bit for bit, but with no product to keep
  apart from its sum: the jnp twin needs no optimization barrier, so XLA fuses
  its gathers and adds into one pass over the rows (the barrier materialises
  one float32 [N, ...] term per m).

  Args:
    src: float32/bfloat16/float16 [P, ...]; index: int32[N, M].
  Returns:
    [N, ...] of src.dtype; rows whose indices are all outside [0, P) are zero.
  """
  out_shape = index.shape[:1] + src.shape[1:]

  def ffi_fn(rows, idx):
    ones = jnp.ones(idx.shape, F32)  # 1.0f * x is x: the same bits as a plain sum
    return _ffi("gather_reduce", result_type(out_shape, src.dtype, rows), rows, idx,
                ones)

  def term(m, picked, trailing):
    del trailing
    # XLA folds 0.0 + x into x, which keeps a -0.0 that the sum from 0.0 makes +0.0.
    return jnp.where(picked == 0, 0.0, picked) if m == 0 else picked

  def jnp_fn(rows, idx):
    return _gathered_sum(rows, idx, out_shape, term)

  return _per_platform(ffi_fn, jnp_fn, src, index)


def _gathered_sum(rows: jax.Array, idx: jax.Array, out_shape: tuple[int, ...],
                  term: Callable) -> jax.Array:
  """The jnp twins' loop: acc = 0.0, then acc += term(m, rows[idx[:, m]] in float32,
  trailing) for each m in order, where idx[:, m] is in range; cast to rows.dtype.
  ``trailing``: the ones that broadcast a per-row value over a row."""
  if rows.shape[0] == 0:  # every index is out of range (jnp.take refuses an empty axis)
    return jnp.zeros(out_shape, rows.dtype)
  safe = _drop_negative(idx, rows.shape[0])
  trailing = (1,) * (rows.ndim - 1)
  acc = jnp.zeros(out_shape, F32)
  for m in range(idx.shape[1]):
    picked = jnp.take(rows, safe[:, m], axis=0, mode="fill", fill_value=0).astype(F32)
    valid = (safe[:, m] < rows.shape[0]).reshape((-1,) + trailing)
    acc = jnp.where(valid, acc + term(m, picked, trailing), acc)
  return acc.astype(rows.dtype)


def gather_reduce(src: jax.Array, index: jax.Array, weights: jax.Array) -> jax.Array:
  """out[n] = sum_m weights[n, m] * src[index[n, m]], fp32 in order of m, cast to src.dtype.

  Each product is rounded to float32 before it is added (no fused
  multiply-add), on both implementations.

  Args:
    src: float32/bfloat16/float16 [P, ...]; index: int32[N, M]; weights: float32[N, M].
  Returns:
    [N, ...] of src.dtype; rows whose indices are all outside [0, P) are zero.
  """
  out_shape = index.shape[:1] + src.shape[1:]

  def ffi_fn(rows, idx, w):
    return _ffi("gather_reduce", result_type(out_shape, src.dtype, rows), rows, idx, w)

  def jnp_fn(rows, idx, w):
    def term(m, picked, trailing):
      # The barrier keeps XLA from contracting the product and the sum into an FMA.
      return jax.lax.optimization_barrier(w[:, m].reshape((-1,) + trailing) * picked)

    return _gathered_sum(rows, idx, out_shape, term)

  return _per_platform(ffi_fn, jnp_fn, src, index, weights)
