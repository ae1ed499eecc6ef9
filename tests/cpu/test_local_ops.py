"""The CPU FFI handlers of the portable backend against their jax.numpy twins.

local_ops picks the FFI handler on CPU and the jnp twin elsewhere; both must
give the same results, so each step is run both ways on random inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep import local_ops
from ep_testing import bits, local_steps, random_routing


def _both(op, *args, **kwargs):
  """(FFI result, jnp twin result) of one local op."""
  ffi = jax.jit(lambda *a: op(*a, **kwargs))(*args)
  twin = _jnp_twin(op, *args, **kwargs)
  return jax.tree.map(np.asarray, ffi), jax.tree.map(np.asarray, twin)


def _jnp_twin(op, *args, **kwargs):
  """Runs ``op`` with platform_dependent forced onto its default (jnp) branch."""
  with local_steps("jnp"):
    return jax.jit(lambda *a: op(*a, **kwargs))(*args)


def _assert_same(a, b, exact=True):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype
    if exact:
      np.testing.assert_array_equal(bits(x), bits(y))
    else:
      np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                 rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_layout(seed):
  rng = np.random.default_rng(seed)
  idx = random_routing(rng, 13, 4, 16)
  idx[rng.random(idx.shape) < 0.1] = 99
  idx[0, 1] = idx[0, 0]  # a repeated expert
  _assert_same(*_both(local_ops.layout, idx, num_experts=16, num_ranks=4))


def test_layout_without_invalid_reports_none():
  ffi, twin = _both(local_ops.layout, np.zeros((3, 2), np.int32), num_experts=4, num_ranks=2)
  np.testing.assert_array_equal(ffi[2], [-1, -1, 0])
  _assert_same(ffi, twin)


@pytest.mark.parametrize("capacity", [3, 10, 64])
def test_ht_route_and_compact(capacity):
  rng = np.random.default_rng(capacity)
  num_ranks, t, k, e = 4, 9, 3, 16
  idx = random_routing(rng, t, k, e)
  w = rng.random((t, k), np.float32)
  offset = np.array([0, 2, 5, 1], np.int32)
  route = _both(local_ops.ht_route, idx, w, offset, num_experts=e, capacity=capacity)
  _assert_same(*route)
  send_idx, send_w = route[0][0], route[0][1]
  _assert_same(*_both(local_ops.ht_compact, send_idx, send_w, experts_per_rank=e // num_ranks,
                      capacity=capacity))


def test_ll_route_and_compact():
  rng = np.random.default_rng(0)
  idx = random_routing(rng, 7, 4, 8)
  idx[1, 2] = idx[1, 0] = 3  # repeated expert sends one row
  route = _both(local_ops.ll_route, idx, num_experts=8)
  _assert_same(*route)
  mask = (rng.random((4, 2, 7)) < 0.5).astype(np.int32)
  _assert_same(*_both(local_ops.ll_compact, mask, rows_per_expert=4 * 9))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.int32])
def test_scatter_and_gather_rows(dtype):
  rng = np.random.default_rng(1)
  src = np.asarray(jnp.asarray(rng.standard_normal((6, 3, 4)) * 10, dtype))
  index = np.array([[0, 7], [-1, 3], [5, -1], [9, 2], [-1, -1], [1, 4]], np.int32)
  _assert_same(*_both(local_ops.scatter_rows, src, index, num_out_rows=8))
  gather = np.array([5, -1, 0, 6, 2, 2, 3], np.int32)
  _assert_same(*_both(local_ops.gather_rows, src, gather))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gather_reduce(dtype):
  rng = np.random.default_rng(2)
  src = np.asarray(jnp.asarray(rng.standard_normal((10, 33)) * 100, dtype))
  index = rng.integers(-2, 12, size=(7, 4)).astype(np.int32)
  weights = rng.random((7, 4), np.float32) * 3
  ffi, twin = _both(local_ops.gather_reduce, src, index, weights)
  # Same fp32 sums in the same order; XLA may fuse multiply-adds, so allow an ulp of fp32.
  _assert_same(ffi, twin, exact=False)
  expected = np.zeros((7, 33), np.float32)
  for n in range(7):
    for m in range(4):
      if 0 <= index[n, m] < 10:
        expected[n] += weights[n, m] * np.asarray(src[index[n, m]], np.float32)
  np.testing.assert_allclose(np.asarray(ffi, np.float32),
                             np.asarray(jnp.asarray(expected, dtype), np.float32), rtol=1e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gather_sum(dtype):
  """Bit for bit: the FFI, the jnp twin, gather_reduce with unit weights, and a
  numpy fp32 sum in index order from 0.0 (signed zeros and dropped indices too)."""
  rng = np.random.default_rng(3)
  values = rng.standard_normal((10, 33)) * 100
  values[2, :5] = -0.0
  src = np.asarray(jnp.asarray(values, dtype))
  index = rng.integers(-2, 12, size=(7, 4)).astype(np.int32)
  index[0] = [2, -1, 2, 11]  # -0.0 + -0.0 from 0.0: +0.0
  ffi, twin = _both(local_ops.gather_sum, src, index)
  _assert_same(ffi, twin)
  _assert_same(ffi, _both(local_ops.gather_reduce, src, index, np.ones((7, 4), np.float32))[0])
  expected = np.zeros((7, 33), np.float32)
  for n in range(7):
    for m in range(4):
      if 0 <= index[n, m] < 10:
        expected[n] = expected[n] + np.asarray(src[index[n, m]], np.float32)
  _assert_same(ffi, np.asarray(jnp.asarray(expected, dtype)))


def test_check_invalid_raises_on_every_path():
  counts = np.array([0, 2], np.int32)
  first = np.array([[-1, -1, 0], [3, 1, 77]], np.int32)
  idx = np.zeros((4, 2), np.int32)
  with pytest.raises(Exception, match=r"rank 1: topk_idx\[3\]\[1\] = 77"):
    jax.block_until_ready(jax.jit(
        lambda *a: local_ops.check_invalid(*a, num_experts=8))(idx, counts, first))
  with pytest.raises(Exception, match=r"rank 1: topk_idx\[3\]\[1\] = 77"):
    jax.block_until_ready(_jnp_twin(local_ops.check_invalid, idx, counts, first, num_experts=8))
  ok = jax.jit(lambda *a: local_ops.check_invalid(*a, num_experts=8))(
      idx, np.zeros(2, np.int32), first)
  np.testing.assert_array_equal(ok, idx)


def test_every_step_with_no_tokens():
  """T_local = 0: the handlers and the twins agree on the empty and padding results."""
  idx = np.zeros((0, 3), np.int32)
  w = np.zeros((0, 3), np.float32)
  layout, twin = _both(local_ops.layout, idx, num_experts=8, num_ranks=4)
  _assert_same(layout, twin)
  np.testing.assert_array_equal(layout[1], 0)
  np.testing.assert_array_equal(layout[2], [-1, -1, 0])
  assert layout[5].shape == (0, 4) and not np.any(layout[3]) and not np.any(layout[4])
  route, twin = _both(local_ops.ht_route, idx, w, np.zeros(4, np.int32), num_experts=8,
                      capacity=5)
  _assert_same(route, twin)
  assert route[0].shape == (4, 0, 3) and route[2].shape == (0, 4)
  compact, twin = _both(local_ops.ht_compact, route[0], route[1], experts_per_rank=2,
                        capacity=5)
  _assert_same(compact, twin)
  np.testing.assert_array_equal(compact[0], -1)
  assert int(compact[4]) == 0 and int(compact[5]) == 0
  _assert_same(*_both(local_ops.ll_route, idx, num_experts=8))
  ll, twin = _both(local_ops.ll_compact, np.zeros((4, 2, 0), np.int32), rows_per_expert=8)
  _assert_same(ll, twin)
  np.testing.assert_array_equal(ll[1], 0)
  rows = np.zeros((0, 16), jnp.bfloat16)
  _assert_same(*_both(local_ops.scatter_rows, rows, np.zeros((0, 2), np.int32), num_out_rows=6))
  gathered, twin = _both(local_ops.gather_rows, rows, np.array([-1, -1], np.int32))
  _assert_same(gathered, twin)
  assert gathered.shape == (2, 16) and not np.any(gathered.astype(np.float32))
  _assert_same(*_both(local_ops.gather_rows, np.ones((3, 16), np.float32),
                      np.zeros((0,), np.int32)))
  reduced, twin = _both(local_ops.gather_reduce, rows, np.full((2, 3), -1, np.int32),
                        np.ones((2, 3), np.float32))
  _assert_same(reduced, twin)
  assert reduced.shape == (2, 16) and not np.any(reduced.astype(np.float32))
  _assert_same(*_both(local_ops.gather_reduce, np.ones((3, 16), np.float32),
                      np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32)))
