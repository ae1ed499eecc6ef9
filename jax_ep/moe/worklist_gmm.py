"""A grouped matmul for Hopper (Mosaic GPU, Pallas) that walks a work list of
(group, row block) items and computes only those that hold rows.

  out[M, N] = lhs[M, K] @ rhs[g][K, N]   for each row of group g
  (transpose_rhs: rhs [G, N, K] is read as rhs[g]^T: the input gradient's product)

Why not JAX's ``ragged_dot_mgpu`` alone: its grid has ``ceil(M / block_m) + G - 1``
row blocks, and every block runs its whole K loop, even one that finds no rows of
its group (the ``G - 1`` blocks kept for groups off the block grid, and the blocks
past ``sum(group_sizes)`` when M is a dispatch's worst case). With the
expert-major dispatch's groups aligned to the row block, those are 47 of 319
blocks at 4096 tokens, top-8 of 32 experts: 15% of the work
(docs/benchmarks.md, "MoE layer and grouped GEMMs").

The work list (``work_list``, computed by XLA from group_sizes before the kernel):
item i covers rows ``[block * block_m + lo, block * block_m + hi)`` of group
``group``. Items are in (group, block) order; a group's items are the row
blocks its rows touch, so a block on a boundary between two groups is two items
(each writes only its own rows). After them come the tail items (group -1):
the rows from ``sum(group_sizes)`` to M, which belong to no group, one item per
row block they touch; the kernel stores zeros there without a K loop. Items
past those are empty (lo = hi). There are at most ``M / block_m + G`` items,
the list's static length.

The kernel: a persistent loop over (item, column block) pairs, one per SM at a
time, in planar-snake order along N (``grid_block_n`` column blocks walked
together, so a row block is read from L2 rather than HBM); an empty item skips
its K loop and its stores, a tail item its K loop. A whole block (lo = 0, hi =
block_m) is one TMA store; a partial one is stored as power-of-two row runs
(TMA boxes are static), so rows of a neighbouring group are never overwritten.

Why the kernel writes the tail's zeros itself: the result then needs no mask.
A mask is a pass of its own over the whole [M, N] result whenever the consumer
is a custom call XLA cannot fuse it into (the layer's combine takes the down
GEMM's rows; its backward, the input gradient's): at M = 36,864 and N = 7168,
1.06 GB read and written, about 0.35 ms on an H100, against the tail's own
stores (its rows only: about 2,000 of them at 4096 tokens, top-8 of 32 experts).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

I32 = jnp.int32
# SMs of an H100 SXM / H200, when no GPU is visible (lowering on a CPU host).
DEFAULT_NUM_SMS = 132


class WorkList(NamedTuple):
  """int32 [num_items] each: an item's group (-1: a tail item, rows of no group,
  stored as zeros), row block, and its rows [lo, hi) within the block (lo = hi:
  an empty item)."""

  group: jax.Array
  block: jax.Array
  lo: jax.Array
  hi: jax.Array


def max_items(num_rows: int, num_groups: int, block_m: int) -> int:
  """The list's static length: every row block, plus one per group boundary
  that may cut a block in two, plus one where the tail starts inside a block.
  (The groups' items touch at most ceil(S / block_m) + G - 1 blocks, S the rows
  in groups; the tail's items M / block_m - floor(S / block_m).)"""
  return -(-num_rows // block_m) + max(num_groups, 1)


def work_list(group_sizes: jax.Array, num_rows: int, block_m: int) -> WorkList:
  """The (group, row block) items of groups ``group_sizes`` (int [G]) over
  ``num_rows`` rows. Negative sizes count as 0, and rows at or past num_rows
  belong to no group, so every item stays inside the operands."""
  num_groups = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(I32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), num_rows)
  starts = jnp.concatenate([jnp.zeros((1,), I32), ends[:-1]])
  first_block = starts // block_m
  end_block = (ends + block_m - 1) // block_m
  blocks_of_group = jnp.where(ends > starts, end_block - first_block, 0)
  items_end = jnp.cumsum(blocks_of_group)
  items_start = items_end - blocks_of_group
  item = jnp.arange(max_items(num_rows, num_groups, block_m), dtype=I32)
  # The group of item i: the first whose items end after i.
  group = jnp.minimum(jnp.searchsorted(items_end, item, side="right").astype(I32),
                      num_groups - 1)
  num_group_items = items_end[-1]
  used = item < num_group_items
  block = first_block[group] + item - items_start[group]
  block_first_row = block * block_m
  lo = jnp.clip(starts[group] - block_first_row, 0, block_m)
  hi = jnp.clip(ends[group] - block_first_row, 0, block_m)
  # The tail: rows [ends[-1], num_rows), one item per block they touch.
  tail_start = ends[-1]
  tail_first_block = tail_start // block_m
  tail_item = item - num_group_items
  is_tail = ~used & (tail_item < -(-num_rows // block_m) - tail_first_block)
  tail_block = tail_first_block + tail_item
  tail_lo = jnp.clip(tail_start - tail_block * block_m, 0, block_m)
  zero = jnp.zeros_like(item)
  return WorkList(
      group=jnp.where(used, group, jnp.where(is_tail, -1, zero)),
      block=jnp.where(used, block, jnp.where(is_tail, tail_block, zero)),
      lo=jnp.where(used, lo, jnp.where(is_tail, tail_lo, zero)),
      hi=jnp.where(used, hi, jnp.where(
          is_tail, jnp.minimum(num_rows - tail_block * block_m, block_m), zero)))


def _num_sms() -> int:
  gpus = [d for d in jax.devices() if d.platform == "gpu"]
  return int(getattr(gpus[0], "core_count", 0) or DEFAULT_NUM_SMS) if gpus else DEFAULT_NUM_SMS


def worklist_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, block_m: int,
                    block_n: int, block_k: int, stages: int, grid_block_n: int,
                    transpose_rhs: bool = False) -> jax.Array:
  """lhs [M, K] (bf16/f16), rhs [G, K, N] (or [G, N, K] with transpose_rhs, same
  dtype), group_sizes int [G] -> [M, N] of lhs' dtype, accumulated in float32;
  rows outside every group are zero. Needs M % block_m == 0,
  K % block_k == 0 and N % block_n == 0 (gmm_impls.pallas_refusal says why not)."""
  # pylint: disable=import-outside-toplevel
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  num_rows, k = lhs.shape
  num_groups = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  k_of_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if k != k_of_rhs or lhs.dtype != rhs.dtype:
    raise ValueError(f"worklist_matmul: lhs {lhs.dtype}{list(lhs.shape)} against rhs "
                     f"{rhs.dtype}{list(rhs.shape)} (transpose_rhs={transpose_rhs})")
  for name, size, step in (("M", num_rows, block_m), ("K", k, block_k), ("N", n, block_n)):
    if size % step:
      raise ValueError(f"worklist_matmul: {name} = {size} is not a multiple of {step}")
  if num_rows == 0 or num_groups == 0:      # no row is in a group: nothing to compute
    return jnp.zeros((num_rows, n), lhs.dtype)
  items = work_list(group_sizes, num_rows, block_m)
  num_items = items.group.shape[0]
  grid_n = n // block_n
  # The power-of-two row runs a partial block is stored in, largest first.
  run_lengths = [1 << bit for bit in reversed(range(block_m.bit_length()))
                 if (1 << bit) < block_m]

  def body(group_ref, block_ref, lo_ref, hi_ref, lhs_gmem, rhs_gmem, out_gmem):

    @plgpu.nd_loop((num_items * grid_n,), collective_axes="sm")
    def _(loop_info: plgpu.NDLoopInfo):
      item, column_block = plgpu.planar_snake(loop_info.index[0], (num_items, grid_n), 1,
                                              grid_block_n)
      group, block = group_ref[item], block_ref[item]
      lo, hi = lo_ref[item], hi_ref[item]
      # A tail item (group -1) stores the accumulator as it starts: zeros.
      has_rows = (hi > lo) & (group >= 0)

      def acc_scope(acc_ref):
        @pl.when(has_rows)
        def _():
          plgpu.emit_pipeline(
              lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                  acc_ref, lhs_smem, rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem),
              grid=(k // block_k,),
              in_specs=[
                  plgpu.BlockSpec((block_m, block_k), lambda step: (block, step),
                                  delay_release=1),
                  plgpu.BlockSpec((block_n, block_k) if transpose_rhs else (block_k, block_n),
                                  (lambda step: (column_block, step)) if transpose_rhs
                                  else (lambda step: (step, column_block)),
                                  delay_release=1),
              ],
              max_concurrent_steps=stages,
          )(lhs_gmem, rhs_gmem.at[group])

        return acc_ref[...]

      acc = pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n)))

      @functools.partial(pl.run_scoped,
                         out_smem=plgpu.SMEM((block_m, block_n), dtype=out_gmem.dtype))
      def _(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        columns = pl.ds(column_block * block_n, block_n)
        first_row = block * block_m
        whole = (lo == 0) & (hi == block_m)

        @pl.when(whole)
        def _():
          plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(first_row, block_m), columns])

        # A partial block: its rows [lo, hi) as runs of 2^j rows, for the set bits
        # j of hi - lo, from the largest down (an empty item: none).
        count = jnp.where(whole, 0, hi - lo)
        start = lo
        for length in run_lengths:
          @pl.when((count & length) != 0)
          def _(start=start, length=length):
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(start, length)],
                                    out_gmem.at[pl.ds(first_row + start, length), columns])
          start = start + (count & length)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_rows, n), lhs.dtype),
      grid=(_num_sms(),),
      grid_names=("sm",),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(items.group, items.block, items.lo, items.hi, lhs, rhs)
