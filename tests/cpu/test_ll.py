"""Low-latency dispatch/combine against the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference
from ep_testing import ranks_routing as _routing
from ep_testing import bits, random_rows, run_per_shard, setup, valid_rows_mask

# (R, E, K, T, T_local, H)
SHAPES = [
    (1, 4, 2, 4, 4, 128),
    (2, 8, 2, 6, 4, 128),
    (4, 16, 4, 5, 5, 256),
    (4, 8, 8, 3, 2, 128),
    (8, 32, 8, 4, 3, 128),
]




@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_dispatch_matches_oracle(shape, use_fp8):
  num_ranks, e, k, t, t_local, h = shape
  rng = np.random.default_rng(hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=1.5)

  def fn(x, idx):
    return (jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8),
            jax_ep.reference.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8))

  d, ref = run_per_shard(fn, mesh, x, idx)
  el = e // num_ranks
  assert d.x.shape == (num_ranks, el, num_ranks * t, h)
  np.testing.assert_array_equal(d.count, ref["count"])
  np.testing.assert_array_equal(d.handle.recv_src, ref["recv_src"])
  valid = valid_rows_mask(d.count, num_ranks * t)
  if not use_fp8:
    assert d.scales is None and d.x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(d.x)[valid], bits(ref["x"])[valid])
  else:
    assert d.x.dtype == jnp.float8_e4m3fn and d.scales.shape == (num_ranks, el, num_ranks * t,
                                                                  h // 128)
    deq = jax_ep.fp8.dequantize(d.x, d.scales)
    ref_deq = jax_ep.fp8.dequantize(ref["x"], ref["scales"])
    # Both sides quantise the same way; beyond that, within fp8 e4m3 cast error of x.
    np.testing.assert_allclose(np.asarray(deq)[valid], np.asarray(ref_deq)[valid], rtol=0,
                               atol=0)
    x_rows = x.astype(np.float32)[np.maximum(d.handle.recv_src, 0)]
    err = np.abs(np.asarray(deq) - x_rows)[valid]
    amax = np.abs(x_rows[valid]).reshape(-1, h // 128, 128).max(axis=-1, keepdims=True)
    assert np.all(err.reshape(-1, h // 128, 128) <= amax / 448 * 16 + 1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_low_latency_combine_matches_oracle(shape, dtype):
  num_ranks, e, k, t, t_local, h = shape
  rng = np.random.default_rng(3 + hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e)
  w = rng.random((num_ranks * t_local, k), np.float32)

  def expert(rows):  # different per local expert and rank
    el = jnp.arange(rows.shape[0], dtype=jnp.float32)[:, None, None]
    rank = jax.lax.axis_index("ep").astype(jnp.float32)
    return (rows.astype(jnp.float32) * (1.0 + 0.25 * el) - rank).astype(rows.dtype)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    y = expert(d.x)
    return y, jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)

  y, out = run_per_shard(fn, mesh, x, idx, w)
  assert out.shape == (num_ranks, t_local, h) and out.dtype == np.dtype(dtype)
  # Bitwise against the host oracle on the same expert rows: the portable
  # combine rounds each w * y to float32, then adds, in k order from +0.0, and
  # rounds once (tests/cpu/test_host_reference.py checks the jnp oracle too).
  layout = host_reference.ll_dispatch(_global(x, num_ranks), _global(idx, num_ranks), config)
  want = host_reference.ll_combine(y, _global(idx, num_ranks), _global(w, num_ranks), layout)
  np.testing.assert_array_equal(bits(out), bits(want))


def _global(a: np.ndarray, num_ranks: int) -> np.ndarray:
  """[R*N, ...] (run_per_shard's input layout) -> [R, N, ...] (host_reference's)."""
  return a.reshape((num_ranks, -1) + a.shape[1:])


def test_repeated_expert_sends_one_row_and_combines_per_k():
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=3)
  idx = np.array([[1, 1, 2], [-1, 3, 3], [0, 0, 0], [2, -1, -1]], np.int32)
  x = np.arange(4 * 128, dtype=np.float32).reshape(4, 128).astype(jnp.bfloat16)
  w = np.array([[0.5, 0.25, 1.0], [1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], np.float32)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    return d, jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config)

  d, out = run_per_shard(fn, mesh, x, idx, w)
  # expert 0 (rank 0, local 0): token 2 once; expert 1: token 0; expert 2: tokens 0 and 3;
  # expert 3: token 1.
  np.testing.assert_array_equal(d.count, [[1, 1], [2, 1]])
  np.testing.assert_array_equal(d.handle.recv_src[0, 0, :1], [2])
  np.testing.assert_array_equal(d.handle.recv_src[1, 0, :2], [0, 3])
  # Every partial sum x * (w_1 + ...) is exact here: one rounding to bf16.
  valid_w = np.where(idx >= 0, w, 0.0).sum(axis=1, keepdims=True)
  expected = (np.asarray(x, np.float32) * valid_w).astype(x.dtype).reshape(2, 2, 128)
  np.testing.assert_array_equal(bits(out), bits(expected))


def test_no_tokens_and_all_to_one_expert():
  config, mesh = setup(4, num_experts=8, hidden=128, max_tokens_per_rank=4, num_topk=2)
  x = random_rows(np.random.default_rng(0), (16, 128), jnp.bfloat16)
  for idx in (np.full((16, 2), -1, np.int32),
              np.tile(np.array([[5, -1]], np.int32), (16, 1))):
    d = run_per_shard(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config), mesh, x, idx)
    if idx[0, 0] < 0:
      assert not np.any(d.count)
    else:
      np.testing.assert_array_equal(d.count, [[0, 0], [0, 0], [0, 16], [0, 0]])
      np.testing.assert_array_equal(bits(d.x[2, 1, :16]), bits(x))


def test_split_ops_match_the_one_call_ops():
  rng = np.random.default_rng(21)
  config, mesh = setup(4, num_experts=16, hidden=128, max_tokens_per_rank=6, num_topk=3)
  x = random_rows(rng, (20, 128), jnp.bfloat16)
  idx = _routing(rng, 4, 5, 3, 16)
  w = rng.random((20, 3), np.float32)

  def fn(x, idx, w):
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config)
    shared = jnp.tanh(x.astype(jnp.float32))          # work between send and recv
    d = jax_ep.low_latency_dispatch_recv(pending, config=config)
    sent = jax_ep.low_latency_combine_send(d.x, d.handle, config=config)
    out = jax_ep.low_latency_combine_recv(sent, idx, w, config=config)
    one = jax_ep.low_latency_dispatch(x, idx, config=config)
    ref = jax_ep.low_latency_combine(one.x, idx, w, one.handle, config=config)
    return d, one, out, ref, shared

  d, one, out, ref, _ = run_per_shard(fn, mesh, x, idx, w)
  np.testing.assert_array_equal(d.count, one.count)
  np.testing.assert_array_equal(bits(d.x), bits(one.x))
  np.testing.assert_array_equal(bits(out), bits(ref))


def test_split_ops_are_not_differentiable():
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=1)

  def loss(x, idx):
    d = jax_ep.low_latency_dispatch_recv(
        jax_ep.low_latency_dispatch_send(x, idx, config=config), config=config)
    return jnp.sum(d.x.astype(jnp.float32))[None]

  def per_shard(x, idx):
    return jax.grad(lambda x: loss(x, idx)[0])(x)

  with pytest.raises(jax_ep.EpError, match="not differentiable"):
    run_per_shard(per_shard, mesh, np.ones((4, 128), np.float32), np.zeros((4, 1), np.int32))
