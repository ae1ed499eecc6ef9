"""HT layout rows: expert-grouped rows for a grouped matmul, three ways, timed alike.

  expert-major A=1, 128  jax_ep.dispatch(layout="expert_major"): pair rows grouped
                         by local expert, groups padded to A rows; combine of the
                         pair rows, weighted once before the timer (the kernel's
                         work alone; the sort's combine below applies them). Also
                         the FP8 dispatch (e4m3 pair rows and their scales).
  token-major            jax_ep.dispatch (the default): one row per token and
                         rank; nothing grouped (the floor of the other two).
  token-major + jnp sort what users write today (README, ``expert_mlp``): the
                         dispatch, then (row, expert) pairs sorted by expert and
                         their rows gathered; back: the weighted pair rows added
                         into their token rows in float32, then the combine.

Each expert-major row has its own op name per A (floors.expert_major_op) and its
floor in the same run, timed the same way: an XLA copy of the same pair bytes
(floors.layout_rows; the M pair rows of the dispatch at that A, bf16, or e4m3
plus float32 scales), paired by floors.FLOOR_OF (benchmarks/plot.py draws it at
EP1); the row's note gives its time over the floor's.

Each op returns its whole result (timing.loop_of keeps every leaf alive). The
combine rows start from pair rows and weights made once, outside the timers.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep import expert_major as expert_major_lib
from jax_ep.bench import floors, measure, timing
from jax_ep.bench.results import Row, row_of
from jax_ep.types import DispatchHandle, ExpertMajorHandle

# A=1: as many rows as the user's sort (like for like); A=128: grouped-GEMM tiles
# (TransformerEngine's JAX EP aligns groups to 128 rows), E_local*127 more rows.
ALIGNMENTS = floors.LAYOUT_ALIGNMENTS
EXPERT_MAJOR = {a: f"expert-major A={a}" for a in ALIGNMENTS}
TOKEN_MAJOR = "token-major"
SORTED = "token-major + jnp sort"
NOTES = {**{name: f"grouped pair rows, groups padded to {a}; the combine takes pair rows "
                  "weighted once outside the timer (the kernel's work alone)"
            for a, name in EXPERT_MAJOR.items()},
         TOKEN_MAJOR: "token rows, not grouped (the floor); combine without weights",
         SORTED: "grouped pair rows by a jnp sort; combine applies the weights"}
# Op names of the rows every system has (the expert-major ones: floors.expert_major_op).
DISPATCH_OP = "layout: HT dispatch BF16"
COMBINE_OP = "layout: HT combine BF16"


def sort_pairs(local_idx: jax.Array, num_local: int):
  """(order int32[C*K], pair_row int32[C*K], group_sizes int32[E_local]) of the
  user's sort: the (row, k) pairs by local expert, pairs without one last."""
  num_topk = local_idx.shape[1]
  pair_expert = jnp.where(local_idx >= 0, local_idx, num_local).reshape(-1)
  order = jnp.argsort(pair_expert, stable=True)
  sizes = jnp.bincount(pair_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
  return order, (order // num_topk).astype(jnp.int32), sizes


def _expert_major_dispatch(config: jax_ep.EpConfig, alignment: int) -> Callable:
  """The expert-major dispatch at A = alignment; x: bf16 rows, or (rows, scales)."""
  return lambda x, i, w: jax_ep.dispatch(x, i, w, config=config, layout="expert_major",
                                         expert_alignment=alignment)


def dispatch_ops(config: jax_ep.EpConfig, num_local: int) -> dict[str, Callable]:
  def sorted_dispatch(x, i, w):
    d = jax_ep.dispatch(x, i, w, config=config)
    order, pair_row, sizes = sort_pairs(d.topk_idx, num_local)
    pair_weight = jnp.where(d.topk_idx >= 0, d.topk_weights, 0.0).reshape(-1)[order]
    return d, d.x[pair_row], pair_row, pair_weight, sizes

  return {**{name: _expert_major_dispatch(config, a) for a, name in EXPERT_MAJOR.items()},
          TOKEN_MAJOR: lambda x, i, w: jax_ep.dispatch(x, i, w, config=config),
          SORTED: sorted_dispatch}


def fp8_dispatch_ops(config: jax_ep.EpConfig) -> dict[str, Callable]:
  """The expert-major FP8 dispatch, by system name; inputs (q, scales, idx, w)."""
  def fp8(alignment):
    dispatch = _expert_major_dispatch(config, alignment)
    return lambda q, sc, i, w: dispatch((q, sc), i, w)

  return {name: fp8(a) for a, name in EXPERT_MAJOR.items()}


def combine_ops(config: jax_ep.EpConfig) -> dict[str, Callable]:
  def expert_major(alignment):
    def combine(y, recv_src, send_row, kept, pair_src, rows_by_expert, slot_row, topk_idx,
                pairs):
      handle = ExpertMajorHandle(
          token_major=DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=kept[0],
                                     config=config),
          pair_src=pair_src, rows_by_expert=rows_by_expert, slot_row=slot_row,
          topk_idx=topk_idx, num_tokens=pairs[0], alignment=alignment, config=config)
      return jax_ep.combine(y, handle, config=config)
    return combine

  def sorted_combine(y, w, pair_row, recv_src, send_row, kept):
    handle = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=kept[0],
                            config=config)
    rows = jnp.zeros((recv_src.shape[0], y.shape[1]), jnp.float32).at[pair_row].add(
        y.astype(jnp.float32) * w[:, None])
    return jax_ep.combine(rows.astype(y.dtype), handle, config=config)

  def token_major(y, recv_src, send_row, kept):
    handle = DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=kept[0],
                            config=config)
    return jax_ep.combine(y, handle, config=config)

  return {**{name: expert_major(a) for a, name in EXPERT_MAJOR.items()},
          TOKEN_MAJOR: token_major, SORTED: sorted_combine}


def _combine_inputs(mesh, config, num_local, x, idx, w) -> dict[str, Callable[[], list]]:
  """Each system's combine inputs on this rank, made by one dispatch of that system."""
  glob = functools.partial(timing.global_array, mesh)

  def made(fn):
    @functools.cache
    def inputs():
      once = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("ep"), out_specs=jax.P("ep")))
      return [timing.local_part(o) for o in once(glob(x), glob(idx), glob(w))]
    return inputs

  def expert_major(name):
    def fn(x, i, w):
      d = dispatch_ops(config, num_local)[name](x, i, w)
      h = d.handle
      weighted = (d.x.astype(jnp.float32) * d.topk_weights[:, None]).astype(d.x.dtype)
      return (weighted, h.token_major.recv_src, h.token_major.send_row,
              h.token_major.num_tokens[None], h.pair_src, h.rows_by_expert, h.slot_row,
              h.topk_idx, h.num_tokens[None])
    return fn

  def token_major(x, i, w):
    d = jax_ep.dispatch(x, i, w, config=config)
    return d.x, d.handle.recv_src, d.handle.send_row, d.num_tokens[None]

  def sorted_(x, i, w):
    d, rows, pair_row, pair_weight, _ = dispatch_ops(config, num_local)[SORTED](x, i, w)
    return (rows, pair_weight, pair_row, d.handle.recv_src, d.handle.send_row,
            d.num_tokens[None])

  return {**{name: made(expert_major(name)) for name in EXPERT_MAJOR.values()},
          TOKEN_MAJOR: made(token_major), SORTED: made(sorted_)}


def pair_rows_per_rank(config: jax_ep.EpConfig, num_ranks: int) -> dict[int, int]:
  """{A: M}: the expert-major dispatch's pair rows per rank at each alignment."""
  return {a: expert_major_lib.default_rows(num_ranks, config.max_tokens_per_rank,
                                           config.num_topk, config.experts_per_rank(num_ranks),
                                           a) for a in ALIGNMENTS}


def against_floor(note: str, outcome, floor: Row) -> str:
  """``note`` with this time over its floor's (the floor row of the same run)."""
  if outcome.us is not None and floor.us is not None:
    return f"{note}; {outcome.us / floor.us:.2f}x its floor ({floor.op}, {floor.us:.1f} us)"
  missing = "this row" if outcome.us is None else "the floor"
  return f"{note}; no ratio to its floor ({floor.op}): {missing} has no time"


def rows(runner: measure.Runner, config: jax_ep.EpConfig, x: np.ndarray, q: np.ndarray,
         scales: np.ndarray, idx: np.ndarray, w: np.ndarray, system_prefix: str,
         ranks_here: int = 1) -> list[Row]:
  """The layout rows: dispatch and combine BF16 for each of the three systems, the
  expert-major FP8 dispatch (q, scales: x quantized), and the floors of the
  expert-major rows (module docstring); inputs: this process's ranks' parts one
  after the other (timing.ranks_here = ranks_here)."""
  num_ranks = jax.device_count()
  num_local = config.experts_per_rank(num_ranks)
  alignment_of = {name: a for a, name in EXPERT_MAJOR.items()}
  timed = []  # (what, system name, outcome)
  for name, op in dispatch_ops(config, num_local).items():
    outcome = runner.time(f"dispatch BF16, {name}", op, [x, idx, w], profile=True)
    timed.append(("dispatch BF16", name, outcome))
  for name, op in fp8_dispatch_ops(config).items():
    outcome = runner.time(f"dispatch FP8, {name}", op, [q, scales, idx, w],
                          profile=True)
    timed.append(("dispatch FP8", name, outcome))
  made = _combine_inputs(runner.mesh, config, num_local, x, idx, w)
  for name, op in combine_ops(config).items():
    outcome = runner.time(f"combine BF16, {name}", op, made[name], profile=True)
    timed.append(("combine BF16", name, outcome))
  floor_rows = floors.layout_rows(runner, pair_rows_per_rank(config, num_ranks), config.hidden,
                                  scales.dtype, ranks_here)
  floor_of = {r.op: r for r in floor_rows}
  out = []
  for what, name, outcome in timed:
    system = f"{system_prefix} {name}"
    if name not in alignment_of:
      out.append(row_of(DISPATCH_OP if what.startswith("dispatch") else COMBINE_OP, system,
                        outcome, note=NOTES[name]))
      continue
    op = floors.expert_major_op(what, alignment_of[name])
    note = (f"e4m3 pair rows and their scales, grouped, groups padded to {alignment_of[name]}"
            if what.endswith("FP8") else NOTES[name])
    out.append(row_of(op, system, outcome,
                      note=against_floor(note, outcome, floor_of[floors.FLOOR_OF[op]])))
  return out + floor_rows
