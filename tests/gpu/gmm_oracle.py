"""A float64 host oracle for jax_ep.moe.grouped_matmul's three products, with
error bounds derived from the arithmetic (no tuned tolerances).

Every product is a sum of K products of operands that are exact in float32
(bf16/f16/f32 inputs), accumulated in float32 in some order, then rounded
once to the output dtype. For a sum s of n such terms, any float32 order gives
|fl(s) - s| <= gamma_n * sum|terms|, gamma_n = n u / (1 - n u), u = 2^-24; the
last rounding adds u_out * |fl(s)| (u_out = 2^-8 for bfloat16, 2^-11 for
float16, 0 for float32 output, whose rounding is the accumulation's). So

  |out - exact| <= gamma_n * A + u_out * (|exact| + gamma_n * A),  A = sum|a_i b_i|.

Rows outside every group must be exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

UNIT_ROUNDOFF = {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11,
                 np.dtype(np.float32): 0.0}


def _gamma(n: int) -> float:
  u = 2.0**-24
  return n * u / (1 - n * u)


def exact_products(rows, w, d_out, group_sizes):
  """float64 (out, d_rows, d_w) and their magnitudes A (sum of |terms|)."""
  rows64, w64, d64 = (np.asarray(a, np.float64) for a in (rows, w, d_out))
  m, k = rows64.shape
  g, _, n = w64.shape
  out, out_abs = np.zeros((m, n)), np.zeros((m, n))
  d_rows, d_rows_abs = np.zeros((m, k)), np.zeros((m, k))
  d_w, d_w_abs = np.zeros((g, k, n)), np.zeros((g, k, n))
  start = 0
  for e, size in enumerate(np.asarray(group_sizes)):
    sl = slice(start, start + int(size))
    out[sl], out_abs[sl] = rows64[sl] @ w64[e], np.abs(rows64[sl]) @ np.abs(w64[e])
    d_rows[sl], d_rows_abs[sl] = d64[sl] @ w64[e].T, np.abs(d64[sl]) @ np.abs(w64[e]).T
    d_w[e], d_w_abs[e] = rows64[sl].T @ d64[sl], np.abs(rows64[sl]).T @ np.abs(d64[sl])
    start += int(size)
  return (out, out_abs), (d_rows, d_rows_abs), (d_w, d_w_abs)


def check(name: str, got, exact, magnitude, terms: int, out_dtype) -> None:
  got64 = np.asarray(np.asarray(got, np.float32), np.float64)
  gamma = _gamma(max(terms, 1))
  bound = gamma * magnitude + UNIT_ROUNDOFF[np.dtype(out_dtype)] * (np.abs(exact)
                                                                    + gamma * magnitude)
  excess = np.abs(got64 - exact) - bound
  worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else None
  assert excess.size == 0 or excess.max() <= 0, (
      f"{name}: {got64[worst]} vs exact {exact[worst]} at {worst}: error "
      f"{abs(got64[worst] - exact[worst]):.3g} over its bound {bound[worst]:.3g}")


def check_grouped_matmul(gmm, rows, w, group_sizes, d_out) -> None:
  """Runs gmm(rows, w, group_sizes) and its VJP at d_out; checks all three products
  and that rows outside every group are exactly zero in out and d_rows."""
  group_sizes = jnp.asarray(group_sizes, jnp.int32)
  out, vjp = jax.vjp(lambda r, ww: gmm(r, ww, group_sizes), rows, w)
  d_rows, d_w = vjp(d_out)
  assert out.dtype == rows.dtype and d_rows.dtype == rows.dtype and d_w.dtype == w.dtype
  (e_out, a_out), (e_dr, a_dr), (e_dw, a_dw) = exact_products(rows, w, d_out, group_sizes)
  used = int(np.sum(np.asarray(group_sizes)))
  k, n = w.shape[1], w.shape[2]
  check("forward", out, e_out, a_out, k, rows.dtype)
  check("input_grad", d_rows, e_dr, a_dr, n, rows.dtype)
  check("weight_grad", d_w, e_dw, a_dw, max(int(np.max(np.asarray(group_sizes), initial=0)), 1),
        w.dtype)
  assert not np.any(np.asarray(out[used:], np.float32)), "rows outside the groups are not 0"
  assert not np.any(np.asarray(d_rows[used:], np.float32)), "d_rows outside the groups not 0"


# (name, group sizes, rows): empty groups, all rows in one group, sizes off any
# tile, every group empty, rows past the groups.
CASES = [
    ("random_sizes_off_the_block", [37, 0, 130, 5, 0, 91], 300),
    ("all_rows_in_one_group", [0, 0, 256, 0], 256),
    ("all_in_the_last_group", [0, 0, 0, 200], 200),
    ("every_group_empty", [0, 0, 0], 64),
    ("aligned_to_128_with_rows_past", [128, 256, 0, 128], 640),
]


def operands(case_rows: int, num_groups: int, k: int, n: int, dtype, seed: int = 0):
  rng = np.random.default_rng(seed)
  rows = jnp.asarray(rng.standard_normal((case_rows, k)), dtype)
  w = jnp.asarray(rng.standard_normal((num_groups, k, n)) / np.sqrt(k), dtype)
  d_out = jnp.asarray(rng.standard_normal((case_rows, n)), dtype)
  return rows, w, d_out
