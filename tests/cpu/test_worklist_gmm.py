"""The work list of jax_ep.moe.worklist_gmm, on the CPU: every row of every group
is covered by exactly one item of its own group and every row past the groups by
exactly one tail item, no item reaches past the rows, the list fits its static
length on adversarial sizes, and a host replay of the list (each item computing
its rows as the kernel does, a tail item storing zeros) equals the ragged
product on every row. The kernel itself lowers for sm_90 here; it runs in
tests/gpu."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.moe import worklist_gmm

BLOCK = 16

SIZES = [
    ("aligned", [16, 32, 0, 16], 96),
    ("off_the_block", [5, 0, 30, 1, 17, 3], 64),
    ("every_boundary_inside_a_block", [1] * 12, 16),
    ("all_in_one_group", [0, 0, 64, 0], 64),
    ("every_group_empty", [0, 0, 0], 32),
    ("rows_past_the_groups", [7, 9], 80),
    ("sizes_past_the_rows", [40, 40, 40], 64),      # sum > M: clipped to M
    ("negative_size", [8, -5, 8], 32),
    ("rows_off_the_block", [5, 9], 40),              # the last block holds 8 rows
]


def _covering(items: worklist_gmm.WorkList, num_rows: int, num_groups: int) -> np.ndarray:
  """group of each row per the list (-1: a tail item's row), failing on a row
  covered twice or not at all."""
  owner = np.full(num_rows, -2)
  for group, block, lo, hi in zip(*(np.asarray(a) for a in items)):
    assert 0 <= lo <= hi <= BLOCK and -1 <= group < num_groups
    for row in range(block * BLOCK + lo, block * BLOCK + hi):
      assert row < num_rows, f"item reaches row {row} of {num_rows}"
      assert owner[row] == -2, f"row {row} covered twice"
      owner[row] = group
  assert np.all(owner != -2), f"rows {np.flatnonzero(owner == -2)} covered by no item"
  return owner


def _expected_owner(sizes, num_rows: int) -> np.ndarray:
  owner = np.full(num_rows, -1)
  start = 0
  for group, size in enumerate(sizes):
    size = max(size, 0)
    owner[start:min(start + size, num_rows)] = group
    start = min(start + size, num_rows)
  return owner


@pytest.mark.parametrize("name,sizes,num_rows", SIZES, ids=[s[0] for s in SIZES])
def test_each_row_of_a_group_is_covered_once_by_its_group(name, sizes, num_rows):
  del name
  items = jax.jit(worklist_gmm.work_list, static_argnums=(1, 2))(
      jnp.asarray(sizes, jnp.int32), num_rows, BLOCK)
  assert items.group.shape == (worklist_gmm.max_items(num_rows, len(sizes), BLOCK),)
  np.testing.assert_array_equal(_covering(items, num_rows, len(sizes)),
                                _expected_owner(sizes, num_rows))
  used = np.asarray(items.hi) > np.asarray(items.lo)
  groups = np.asarray(items.group)
  # The groups' items first, in (group, block) order, then the tail's, in block
  # order, then the empty ones: the kernel's snake reaches those last.
  assert not np.any(used[np.argmin(used):]) or used.all()
  kind = np.where(groups >= 0, 0, 1)[used]
  assert np.all(np.diff(kind) >= 0)
  keys = groups[used] * 10**6 + np.asarray(items.block)[used]
  assert np.all(np.diff(keys[kind == 0]) > 0) and np.all(np.diff(keys[kind == 1]) > 0)


@pytest.mark.parametrize("tail", [False, True], ids=["groups_fill_the_rows", "tail_inside_a_block"])
def test_the_static_length_holds_at_its_worst(tail):
  # Every group boundary cuts a block: one extra item per boundary; and where the
  # groups end inside a block, one more for the tail's part of it. No more.
  rng = np.random.default_rng(0)
  for _ in range(50):
    num_groups = int(rng.integers(1, 12))
    num_rows = BLOCK * int(rng.integers(1, 9))
    in_groups = num_rows - int(rng.integers(1, BLOCK)) if tail else num_rows
    cuts = np.sort(rng.integers(0, in_groups + 1, num_groups - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [in_groups]])).astype(np.int32)
    items = worklist_gmm.work_list(jnp.asarray(sizes), num_rows, BLOCK)
    np.testing.assert_array_equal(_covering(items, num_rows, num_groups),
                                  _expected_owner(sizes.tolist(), num_rows))


@pytest.mark.parametrize("name,sizes,num_rows", SIZES[:6], ids=[s[0] for s in SIZES[:6]])
def test_a_host_replay_of_the_list_is_the_ragged_product(name, sizes, num_rows):
  del name
  rng = np.random.default_rng(1)
  # Small integers: every sum is exact, so any order of the arithmetic agrees.
  lhs = rng.integers(-4, 5, (num_rows, 8)).astype(np.float32)
  rhs = rng.integers(-4, 5, (len(sizes), 8, 4)).astype(np.float32)
  items = worklist_gmm.work_list(jnp.asarray(sizes, jnp.int32), num_rows, BLOCK)
  out = np.full((num_rows, 4), np.nan, np.float32)   # every row must be stored
  for group, block, lo, hi in zip(*(np.asarray(a) for a in items)):
    if group < 0:   # a tail item: the accumulator as it starts, no K loop
      whole_block = np.zeros((BLOCK, 4), np.float32)
    else:
      whole_block = lhs[block * BLOCK:(block + 1) * BLOCK] @ rhs[group]   # the kernel's tile
    out[block * BLOCK + lo:block * BLOCK + hi] = whole_block[lo:hi]      # its stores
  want = np.asarray(jax.lax.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs),
                                       jnp.asarray(sizes, jnp.int32)))
  np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("transpose_rhs", [False, True], ids=["forward", "input_grad"])
def test_the_kernel_lowers_for_sm90(transpose_rhs):
  lhs = jax.ShapeDtypeStruct((512, 256), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 128, 256) if transpose_rhs else (4, 256, 128), jnp.bfloat16)
  kernel = functools.partial(worklist_gmm.worklist_matmul, block_m=128, block_n=128,
                             block_k=64, stages=4, grid_block_n=4, transpose_rhs=transpose_rhs)
  lowered = jax.jit(kernel).trace(lhs, rhs, jax.ShapeDtypeStruct((4,), jnp.int32)).lower(
      lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()


def test_operands_off_the_tiles_are_refused():
  with pytest.raises(ValueError, match="K = 100 is not a multiple of 64"):
    worklist_gmm.worklist_matmul(jnp.zeros((128, 100), jnp.bfloat16),
                                 jnp.zeros((2, 100, 128), jnp.bfloat16), jnp.zeros(2, jnp.int32),
                                 block_m=128, block_n=128, block_k=64, stages=4, grid_block_n=4)


@pytest.mark.parametrize("num_rows,num_groups", [(0, 3), (128, 0)], ids=["no_rows", "no_groups"])
def test_no_rows_or_no_groups_need_no_kernel(num_rows, num_groups):
  # Such a grid would be empty (no rows) or have no group to index: the result is
  # all zeros, on any device, without launching the kernel.
  out = worklist_gmm.worklist_matmul(
      jnp.ones((num_rows, 64), jnp.bfloat16), jnp.ones((num_groups, 64, 128), jnp.bfloat16),
      jnp.zeros(num_groups, jnp.int32), block_m=128, block_n=128, block_k=64, stages=4,
      grid_block_n=4)
  assert out.shape == (num_rows, 128) and out.dtype == jnp.bfloat16 and not jnp.any(out)
