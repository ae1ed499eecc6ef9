"""int64 top-k ids without jax_enable_x64.

JAX truncates int64 arrays to int32 when they enter jit or shard_map, before
jax_ep sees them: 2**32 + 3 becomes 3, a valid expert, and is not counted in
num_invalid. jax_ep documents that (pass int32, or enable x64) and raises
EpConfigError where int64 still reaches it: a concrete array closed over by the
traced function, or an int64 value traced under jax.enable_x64.
(With x64 on, int64 ids are checked in test_ht.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import run_per_shard, setup

CONFIG = dict(num_experts=8, hidden=128, max_tokens_per_rank=4, num_topk=2)
HUGE = 2**32 + 3  # int32(HUGE) == 3


def _inputs():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 128)).astype(np.float32)
  idx = np.array([[0, 5], [HUGE, 1], [2, -1], [7, 6], [4, 3], [1, 0], [-1, -1], [6, 2]],
                 np.int64)
  w = rng.random((8, 2), np.float32)
  return x, idx, w


def _ops(config, idx_fn):
  """Every op that takes topk_idx, each with ids from idx_fn(shard's int32 ids)."""

  def layout(x, i, w):
    return jax_ep.get_dispatch_layout(idx_fn(i), config=config)[1]

  def dispatch(x, i, w):
    return jax_ep.dispatch(x, idx_fn(i), w, config=config).num_invalid

  def ll_dispatch(x, i, w):
    return jax_ep.low_latency_dispatch(x, idx_fn(i), config=config).num_invalid

  def ll_send(x, i, w):
    return jax_ep.low_latency_dispatch_send(x, idx_fn(i), config=config).sent.payload.num_invalid

  def ll_combine(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    return jax_ep.low_latency_combine(d.x, idx_fn(i), w, d.handle, config=config)

  return dict(layout=layout, dispatch=dispatch, ll_dispatch=ll_dispatch, ll_send=ll_send,
              ll_combine=ll_combine)


def test_int64_arguments_are_truncated_by_jax_before_jax_ep_sees_them():
  """The documented behaviour: HUGE routes to expert 3, exactly like int32 3."""
  assert not jax.config.jax_enable_x64
  config, mesh = setup(2, **CONFIG)
  x, idx, w = _inputs()
  truncated = np.where(idx == HUGE, 3, idx).astype(np.int32)

  def fn(x, i, w):
    assert i.dtype == jnp.int32  # what arrives inside shard_map
    d = jax_ep.dispatch(x, i, w, config=config)
    return d.num_invalid, d.topk_idx, d.x

  got = run_per_shard(fn, mesh, x, idx, w)
  want = run_per_shard(fn, mesh, x, truncated, w)
  np.testing.assert_array_equal(got[0], [0, 0])
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op", ["layout", "dispatch", "ll_dispatch", "ll_send", "ll_combine"])
def test_closed_over_int64_that_does_not_fit_int32_raises(op):
  config, mesh = setup(2, **CONFIG)
  x, idx, w = _inputs()
  shard = idx[4:]  # rank 1's ids, closed over as a numpy constant
  shard[1, 0] = HUGE
  fn = _ops(config, lambda i: shard)[op]
  with pytest.raises(jax_ep.EpConfigError,
                     match=r"topk_idx\[1\]\[0\] = 4294967299 does not fit int32.*truncate it "
                           r"to 3; pass int32 ids .* or enable x64"):
    run_per_shard(fn, mesh, x, idx.astype(np.int32), w)


def test_int64_array_made_under_x64_and_closed_over_raises():
  config, mesh = setup(2, **CONFIG)
  x, idx, w = _inputs()
  with jax.enable_x64(True):
    ids = jnp.asarray(np.where(idx[:4] == HUGE, -(2**40), idx[:4]))
  assert ids.dtype == jnp.int64
  with pytest.raises(jax_ep.EpConfigError, match=r"= -1099511627776 does not fit int32"):
    run_per_shard(_ops(config, lambda i: ids)["dispatch"], mesh, x, idx.astype(np.int32), w)


def test_closed_over_int64_that_fits_int32_is_used_as_int32():
  config, mesh = setup(2, **CONFIG)
  x, idx, w = _inputs()
  fits = np.where(idx[:4] == HUGE, 9, idx[:4])  # int64; 9 is out of range, counted invalid
  for op, fn in _ops(config, lambda i: fits).items():
    got = run_per_shard(fn, mesh, x, idx.astype(np.int32), w)
    want = run_per_shard(_ops(config, lambda i: fits.astype(np.int32))[op], mesh, x,
                         idx.astype(np.int32), w)
    np.testing.assert_array_equal(got, want)
  assert list(run_per_shard(_ops(config, lambda i: fits)["dispatch"], mesh, x,
                            idx.astype(np.int32), w)) == [1, 1]


def test_traced_int64_without_x64_raises():
  """An int64 tracer reaches jax_ep only when x64 is switched off inside a trace."""
  with jax.enable_x64(True):
    config, mesh = setup(2, **CONFIG)
    x, idx, w = _inputs()

    def fn(x, i, w):
      assert i.dtype == jnp.int64
      with jax.enable_x64(False):
        return jax_ep.dispatch(x, i, w, config=config).num_invalid

    with pytest.raises(jax_ep.EpConfigError, match="topk_idx is int64 but jax_enable_x64 is off"):
      run_per_shard(fn, mesh, x, idx, w)
