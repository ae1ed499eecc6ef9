"""HBM floors: plain XLA ops that move an op's bytes with no routing, timed alike.

On one GPU (EP1: every row is local) a jax_ep op cannot beat the memory traffic
of its rows, nor the harness's cost of one dependent kernel. These rows put
numbers on both, in the same run and the same loop (timing.py), so each jax_ep
row can be read against what it cannot go below:

  * "one tiny kernel": ``+1`` on the [T, K] int32 routing, the per-call floor
    of any op in this harness (its launch and the gap between two dependent
    kernels, command buffers included);
  * "copy of the rows": an elementwise pass over the op's rows (each byte read
    once and written once), bf16;
  * LL dispatch: XLA's gather of each (token, expert) pair's row out of x
    [T, H] (the LL dispatch's data movement without its routing);
  * LL combine: XLA's float32 sum of each token's K pair rows into one bf16 row
    (reads every pair row once, writes every token row once);
  * HT FP8 dispatch: jax_ep.fp8.quantize of x (reads bf16, writes e4m3 rows and
    their scales);
  * the expert-major layout (layouts.py, --layouts), per alignment A: a copy of
    its M pair rows (bf16 [M, H]; for the FP8 dispatch the e4m3 [M, H] rows and
    their float32 [M, H/128] scales), M the dispatch's row count at that A
    (jax_ep.expert_major.default_rows): the bytes a dispatch that writes each
    pair once, or a combine that reads each once, cannot avoid.

They are floors of the local path only: at EP > 1 they say nothing of links.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep.bench import measure, timing
from jax_ep.bench.results import Row, row_of

SYSTEM = "XLA (HBM floor)"

# The expert-major layout's alignments A (layouts.py times each; its rows and
# their floors are named per A, so that FLOOR_OF pairs them).
LAYOUT_ALIGNMENTS = (1, 128)


def expert_major_op(what: str, alignment: int) -> str:
  """Op name of an expert-major layout row: what = "dispatch BF16", "dispatch FP8"
  or "combine BF16"."""
  return f"layout: HT {what}, A={alignment}"


def pair_rows_floor(alignment: int, fp8: bool = False) -> str:
  """Op name of the floor of the expert-major rows at A = alignment (a copy of the
  M pair rows; ``fp8``: e4m3 rows and their scales)."""
  return f"layout: copy of the {'FP8 pairs' if fp8 else 'pair rows'}, A={alignment}"


# The floor row (op name of this system) each op's time is read against at EP1
# (benchmarks/plot.py): the plain-XLA pass that moves the op's bytes, or the
# one-kernel floor for the calls that move none.
FLOOR_OF = {
    "LL dispatch FP8": "LL dispatch: row gather",
    "LL dispatch BF16": "LL dispatch: row gather",
    "LL combine BF16": "LL combine: sum of pair rows",
    "LL combine BF16, pre-summed": "LL combine: sum of pair rows",
    "LL dispatch, no rows": "one tiny kernel",
    "LL combine, no rows": "one tiny kernel",
    "HT dispatch BF16": "HT BF16: copy of the rows",
    "HT dispatch FP8": "HT FP8: quantize of the rows",
    "HT combine BF16": "HT BF16: copy of the rows",
    "get_dispatch_layout": "one tiny kernel",
    "layout: HT dispatch BF16": "HT BF16: copy of the rows",
    "layout: HT combine BF16": "HT BF16: copy of the rows",
    **{expert_major_op(what, a): pair_rows_floor(a, fp8=what.endswith("FP8"))
       for a in LAYOUT_ALIGNMENTS for what in ("dispatch BF16", "dispatch FP8", "combine BF16")},
}


def _tiny(routing: jax.Array) -> tuple[jax.Array]:
  return (routing + 1,)


def _copy(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """Each array + 1: every byte read once and written once. 1-byte floats
  (float8) as their uint8 bytes, an integer add with no float conversion. On one
  H200 (2026-12-03, docs/benchmarks.md) this copy of the e4m3 pair rows still
  took as long as the bf16 copy of twice their bytes: a 1-byte elementwise pass
  is not bound by HBM, so it is a weak floor for FP8 rows."""
  def one(a):
    if a.dtype.itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating):
      raw = jax.lax.bitcast_convert_type(a, jnp.uint8) + jnp.uint8(1)
      return jax.lax.bitcast_convert_type(raw, a.dtype)
    return a + jnp.asarray(1, a.dtype)
  return tuple(one(a) for a in arrays)


def _gather(x: jax.Array, token_of_pair: jax.Array) -> tuple[jax.Array]:
  return (jnp.take(x, token_of_pair, axis=0),)


def _sum_pairs(pair_rows: jax.Array) -> tuple[jax.Array]:
  """pair_rows bf16 [T, K, H] -> bf16 [T, H]: the K rows of each token summed in fp32."""
  return (pair_rows.astype(jnp.float32).sum(axis=1).astype(pair_rows.dtype),)


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  return tuple(jax_ep.fp8.quantize(x))


def _mib(num_bytes: int) -> str:
  return f"{num_bytes / 2**20:.1f} MiB"


def ll_rows(runner: measure.Runner, x: np.ndarray, idx: np.ndarray,
            ranks_here: int = 1) -> list[Row]:
  """Floors of the LL ops on this process's x bf16 [ranks_here * T, H] and idx int32
  [ranks_here * T, K], its ranks' parts one after the other (timing.ranks_here);
  every valid entry is one pair (the bench's routing has no repeats and no -1)."""
  num_tokens, hidden = x.shape[0] // ranks_here, x.shape[1]
  # Each rank's pairs index its own T tokens; the bench's routing gives every rank
  # the same number of pairs (T * K), so the parts stay equal.
  token_of_pair = timing.per_rank(
      idx, lambda part: np.nonzero(part >= 0)[0].astype(np.int32), ranks_here)
  num_pairs = int(token_of_pair.size) // ranks_here
  row_bytes = 2 * hidden
  pair_rows = np.zeros((ranks_here * num_tokens, idx.shape[1], hidden), x.dtype)
  return [
      row_of("one tiny kernel", SYSTEM, runner.time("floor: one tiny kernel", _tiny, [idx]),
             note="+1 on the [T, K] routing: the harness's per-call floor"),
      row_of("LL dispatch: row gather", SYSTEM,
             runner.time("floor: LL dispatch row gather", _gather, [x, token_of_pair]),
             note=f"{num_pairs} pair rows gathered from x: reads {_mib(num_tokens * row_bytes)}"
                  f", writes {_mib(num_pairs * row_bytes)}"),
      row_of("LL dispatch: copy of the rows", SYSTEM,
             runner.time("floor: LL pair rows copy", _copy,
                         [np.zeros((ranks_here * num_pairs, hidden), x.dtype)]),
             note=f"elementwise over the {num_pairs} pair rows: "
                  f"{_mib(2 * num_pairs * row_bytes)} read + written"),
      row_of("LL combine: sum of pair rows", SYSTEM,
             runner.time("floor: LL combine pair sum", _sum_pairs, [pair_rows]),
             note=f"fp32 sum of K rows per token: reads {_mib(pair_rows.nbytes // ranks_here)}, "
                  f"writes {_mib(num_tokens * row_bytes)}"),
  ]


def ht_rows(runner: measure.Runner, x: np.ndarray, idx: np.ndarray,
            ranks_here: int = 1) -> list[Row]:
  """Floors of the HT ops at EP1 on this process's x bf16 [ranks_here * T, H] (its
  ranks' parts one after the other): each token lands once."""
  rank_bytes = x.nbytes // ranks_here
  return [
      row_of("one tiny kernel", SYSTEM, runner.time("floor: one tiny kernel", _tiny, [idx]),
             note="+1 on the [T, K] routing: the harness's per-call floor"),
      row_of("HT BF16: copy of the rows", SYSTEM,
             runner.time("floor: HT rows copy", _copy, [x]),
             note=f"elementwise over x: {_mib(2 * rank_bytes)} read + written (EP1: the "
                  "dispatch's and the combine's bytes)"),
      row_of("HT FP8: quantize of the rows", SYSTEM,
             runner.time("floor: HT FP8 quantize", _quantize, [x]),
             note="jax_ep.fp8.quantize of x: reads bf16, writes e4m3 rows and scales"),
  ]


def layout_rows(runner: measure.Runner, num_rows: dict[int, int], hidden: int, scale_dtype,
                ranks_here: int = 1) -> list[Row]:
  """Floors of the expert-major layout rows: per alignment A (``num_rows``: {A: M},
  M pair rows per rank), a copy of bf16 [M, H] and one of e4m3 [M, H] with float32
  (``scale_dtype``) [M, H/128] scales, each on this process's ranks' parts one
  after the other ([ranks_here * M, ...])."""
  out = []
  for alignment, rows in num_rows.items():
    bf16 = np.zeros((ranks_here * rows, hidden), jnp.bfloat16)
    q = np.zeros((ranks_here * rows, hidden), jnp.float8_e4m3fn)
    scales = np.zeros((ranks_here * rows, hidden // jax_ep.fp8.GROUP), scale_dtype)
    fp8_bytes = rows * (hidden + scales.shape[1] * scales.dtype.itemsize)
    out += [
        row_of(pair_rows_floor(alignment), SYSTEM,
               runner.time(f"floor: pair rows copy, A={alignment}", _copy, [bf16]),
               note=f"elementwise over the {rows} bf16 pair rows of A={alignment}: "
                    f"{_mib(2 * rows * 2 * hidden)} read + written"),
        row_of(pair_rows_floor(alignment, fp8=True), SYSTEM,
               runner.time(f"floor: FP8 pair rows copy, A={alignment}", _copy, [q, scales]),
               note=f"elementwise over the {rows} e4m3 pair rows of A={alignment} and their "
                    f"{scales.dtype} scales: {_mib(2 * fp8_bytes)} read + written"),
    ]
  return out
