"""The implementations behind jax_ep.moe.grouped_matmul, one function per product.

Every product takes rows grouped by expert: group g is rows
``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`` of the row operand; rows at
and past ``sum(group_sizes)`` belong to no group.

  forward       out[M, N]    = rows[M, K] @ w[g][K, N]        for each row of group g
  input_grad    d_rows[M, K] = d_out[M, N] @ w[g][K, N]^T
  weight_grad   d_w[G, K, N] = rows[group g]^T @ d_out[group g]   (0 for an empty group)

Each returns the row operand's dtype, accumulated in float32. Rows outside
every group are *unspecified* in the forward and input_grad results of JAX's
Pallas kernels (they never write them), and grouped_matmul masks them; the
work-list kernel writes zeros there itself (ZERO_OUTSIDE_GROUPS), so its
results need no mask.

- ``xla``: ``jax.lax.ragged_dot`` / ``ragged_dot_general``, on every platform.
  On NVIDIA GPUs XLA lowers the forward and input_grad to cuDNN only with
  cuDNN >= 9.22, and otherwise (and the weight_grad always) to a dense dot over
  zero-padded groups: G times the useful FLOPs and an [G, M, ...] temporary.
- ``pallas``: JAX's own Mosaic GPU kernels for Hopper (sm_90),
  ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` (forward, and input_grad
  with ``transpose_rhs``) and ``transposed_ragged_dot_mgpu`` (weight_grad). They
  need the row and weight dtypes equal (bf16 or f16) and tile-divisible K and N
  (pallas_refusal); the rows are zero-padded to a whole number of row tiles
  (rows_padded), as the kernels' tiling of M requires.
- ``worklist``: jax_ep's own Mosaic GPU kernel for the forward and input_grad
  (jax_ep/moe/worklist_gmm.py: the same tiles, but it computes only the
  (group, row block) pairs that hold rows, where ``ragged_dot_mgpu`` runs
  ``G - 1`` more row blocks, and those past the groups, through their whole K
  loop), with the Pallas weight_grad; same needs as ``pallas``.
- ``tokamax``: Google's tokamax (``pip install jax_ep[tokamax]``), its
  ``tokamax.ragged_dot`` and its VJP.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

F32 = jnp.float32
PRODUCTS = ("forward", "input_grad", "weight_grad")
# The implementations whose forward and input_grad results are zero outside
# every group as they come out of the kernel (no mask needed).
ZERO_OUTSIDE_GROUPS = frozenset({"worklist"})


@dataclasses.dataclass(frozen=True)
class PallasTiles:
  """Tile sizes of one Pallas Mosaic GPU grouped-GEMM kernel.

  Attributes:
    block_m: rows of the output tile (forward / input_grad: token rows; the
      expert-major dispatch's expert_alignment should be a multiple of it).
    block_n: columns of the output tile.
    block_k: the contraction step.
    stages: pipelined copies in flight (``max_concurrent_steps``).
    grid_block_n: output tiles along N walked together (L2 reuse of the rows).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  grid_block_n: int = 1


# ---------------------------------------------------------------- xla
def xla_forward(rows, w, group_sizes):
  return jax.lax.ragged_dot(rows, w, group_sizes,
                            preferred_element_type=F32).astype(rows.dtype)


def xla_input_grad(d_out, w, group_sizes):
  return jax.lax.ragged_dot(d_out, jnp.swapaxes(w, 1, 2), group_sizes,
                            preferred_element_type=F32).astype(d_out.dtype)


_WEIGHT_GRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def xla_weight_grad(rows, d_out, group_sizes):
  return jax.lax.ragged_dot_general(rows, d_out, group_sizes, _WEIGHT_GRAD_DIMS,
                                    preferred_element_type=F32).astype(rows.dtype)


# ---------------------------------------------------------------- pallas
def pallas_refusal(rows_shape, w_shape, rows_dtype, w_dtype, tiles: dict[str, PallasTiles]
                   ) -> str | None:
  """Why the Pallas kernels cannot run these operands (rows [M, K], w [G, K, N]), or
  None. Checked at trace time, from shapes and dtypes alone."""
  if jnp.dtype(rows_dtype) != jnp.dtype(w_dtype):
    return f"rows are {jnp.dtype(rows_dtype).name} but weights {jnp.dtype(w_dtype).name}"
  if jnp.dtype(rows_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"{jnp.dtype(rows_dtype).name} operands (the kernels take bfloat16 or float16)"
  _, k = rows_shape
  _, _, n = w_shape
  fwd, dx, dw = tiles["forward"], tiles["input_grad"], tiles["weight_grad"]
  for name, size, step in (("the contraction K", k, fwd.block_k), ("N", n, fwd.block_n),
                           ("N (input_grad's contraction)", n, dx.block_k),
                           ("K (input_grad's output columns)", k, dx.block_n),
                           ("K (weight_grad's rows)", k, dw.block_m),
                           ("N (weight_grad's columns)", n, dw.block_n)):
    if size % step:
      return f"{name} = {size} is not a multiple of the kernel's tile of {step}"
  return None


@functools.cache
def _pallas_modules():
  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
  return ragged_dot_mgpu, transposed_ragged_dot_mgpu


def _ragged_kwargs(tiles: PallasTiles) -> dict:
  return dict(block_m=tiles.block_m, block_n=tiles.block_n, block_k=tiles.block_k,
              max_concurrent_steps=tiles.stages, grid_block_n=tiles.grid_block_n)


def pallas_forward(rows, w, group_sizes, tiles: PallasTiles):
  forward, _ = _pallas_modules()
  return forward.ragged_dot(rows, w, group_sizes=group_sizes, **_ragged_kwargs(tiles))


def pallas_input_grad(d_out, w, group_sizes, tiles: PallasTiles):
  forward, _ = _pallas_modules()
  # transpose_rhs: w [G, K, N] is read as [G, N', K'] = (output columns, contraction).
  return forward.ragged_dot(d_out, w, group_sizes=group_sizes, transpose_rhs=True,
                            **_ragged_kwargs(tiles))


def pallas_weight_grad(rows, d_out, group_sizes, tiles: PallasTiles):
  _, transposed = _pallas_modules()
  # Its "lhs (K, M)" is rows [M_rows, K]: the ragged contraction runs over the rows.
  return transposed.transposed_ragged_dot(rows, d_out, group_sizes=group_sizes,
                                          **_ragged_kwargs(tiles))


# ---------------------------------------------------------------- worklist
def worklist_forward(rows, w, group_sizes, tiles: PallasTiles):
  from jax_ep.moe import worklist_gmm  # pylint: disable=import-outside-toplevel
  return worklist_gmm.worklist_matmul(rows, w, group_sizes, **_worklist_kwargs(tiles))


def worklist_input_grad(d_out, w, group_sizes, tiles: PallasTiles):
  from jax_ep.moe import worklist_gmm  # pylint: disable=import-outside-toplevel
  return worklist_gmm.worklist_matmul(d_out, w, group_sizes, transpose_rhs=True,
                                      **_worklist_kwargs(tiles))


def _worklist_kwargs(tiles: PallasTiles) -> dict:
  return dict(block_m=tiles.block_m, block_n=tiles.block_n, block_k=tiles.block_k,
              stages=tiles.stages, grid_block_n=tiles.grid_block_n)


# ---------------------------------------------------------------- tokamax
@functools.cache
def _tokamax_import() -> tuple[object | None, str | None]:
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return None, f"{type(e).__name__}: {e}"
  return tokamax, None


def tokamax_module():
  """The tokamax module, or None when it cannot be imported (tokamax_import_error)."""
  return _tokamax_import()[0]


def tokamax_import_error() -> str | None:
  """Why ``import tokamax`` failed, or None when it imported."""
  return _tokamax_import()[1]


def tokamax_forward(rows, w, group_sizes):
  return tokamax_module().ragged_dot(rows, w, group_sizes,
                                     preferred_element_type=F32).astype(rows.dtype)


def tokamax_input_grad(d_out, w, group_sizes):
  return tokamax_forward(d_out, jnp.swapaxes(w, 1, 2), group_sizes)


def tokamax_weight_grad(rows, d_out, group_sizes):
  # tokamax's own VJP of its forward, asked for the weights' cotangent alone.
  w_shape = (group_sizes.shape[0], rows.shape[1], d_out.shape[1])
  _, vjp = jax.vjp(lambda w: tokamax_module().ragged_dot(rows, w, group_sizes),
                   jnp.zeros(w_shape, rows.dtype))
  return vjp(d_out.astype(rows.dtype))[0].astype(rows.dtype)


def rows_padded(product: Callable, multiple: int, num_row_operands: int, row_result: bool
                ) -> Callable:
  """``product`` with its first ``num_row_operands`` operands (rows [M, ...])
  zero-padded to a multiple of ``multiple`` rows; a row result (``row_result``:
  [M', ...], not weight_grad's [G, K, N]) is cut back to M.

  The Mosaic GPU kernels tile M and refuse an M off their tiling (seen: "dimension
  0 must have size smaller or a multiple of its tiling 8, but got 300"). The
  padded rows lie past sum(group_sizes), so they belong to no group and change
  no product.
  """

  def padded(*operands):
    num_rows = operands[0].shape[0]
    extra = -num_rows % multiple
    if not extra:
      return product(*operands)
    grown = [jnp.pad(x, ((0, extra), (0, 0))) for x in operands[:num_row_operands]]
    out = product(*grown, *operands[num_row_operands:])
    return out[:num_rows] if row_result else out

  return padded


def products(implementation: str, tiles: dict[str, PallasTiles]) -> dict[str, Callable]:
  """The three product functions of one implementation (tiles: Pallas only)."""
  if implementation == "xla":
    return dict(forward=xla_forward, input_grad=xla_input_grad, weight_grad=xla_weight_grad)
  if implementation == "tokamax":
    return dict(forward=tokamax_forward, input_grad=tokamax_input_grad,
                weight_grad=tokamax_weight_grad)
  if implementation in ("pallas", "worklist"):
    def row_multiple(product: str) -> int:
      return math.lcm(tiles[product].block_m, tiles[product].block_k)
    forward, input_grad = ((pallas_forward, pallas_input_grad) if implementation == "pallas"
                           else (worklist_forward, worklist_input_grad))
    return dict(
        forward=rows_padded(functools.partial(forward, tiles=tiles["forward"]),
                            row_multiple("forward"), 1, True),
        input_grad=rows_padded(functools.partial(input_grad, tiles=tiles["input_grad"]),
                               row_multiple("input_grad"), 1, True),
        weight_grad=rows_padded(functools.partial(pallas_weight_grad,
                                                  tiles=tiles["weight_grad"]),
                                row_multiple("weight_grad"), 2, False))
  raise ValueError(f"unknown grouped-matmul implementation {implementation!r}")
