"""High-throughput dispatch/combine and the layout, against the oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import ranks_routing as _routing
from ep_testing import bits, random_rows, run_per_shard, setup

# (R, E, K, T, T_local, H)
SHAPES = [
    (1, 4, 2, 8, 8, 32),
    (2, 8, 2, 8, 5, 32),
    (4, 16, 4, 12, 12, 64),
    (4, 8, 3, 16, 9, 16),
    (8, 32, 8, 6, 6, 128),
    (8, 16, 1, 4, 3, 8),
]




def _dispatch_and_reference(config, mesh, x, idx, w, capacity=None):
  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config, capacity=capacity)
    return d, ref

  return run_per_shard(fn, mesh, x, idx, w)


def _assert_dispatch_matches(d, ref):
  np.testing.assert_array_equal(d.num_tokens, ref["num_tokens"])
  np.testing.assert_array_equal(d.num_dropped, ref["num_dropped"])
  np.testing.assert_array_equal(d.num_invalid, ref["num_invalid"])
  np.testing.assert_array_equal(d.tokens_per_expert, ref["tokens_per_expert"])
  np.testing.assert_array_equal(d.topk_idx, ref["topk_idx"])
  np.testing.assert_array_equal(bits(d.topk_weights), bits(ref["topk_weights"]))
  np.testing.assert_array_equal(bits(d.x), bits(ref["x"]))  # bit for bit, padding included
  if ref["scales"] is not None:
    np.testing.assert_array_equal(bits(d.scales), bits(ref["scales"]))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dispatch_matches_oracle(shape, dtype):
  num_ranks, e, k, t, t_local, h = shape
  rng = np.random.default_rng(hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=2.0)
  w = rng.random((num_ranks * t_local, k), np.float32)
  d, ref = _dispatch_and_reference(config, mesh, x, idx, w)
  _assert_dispatch_matches(d, ref)
  assert d.x.shape == (num_ranks, num_ranks * t, h)
  # Rows past num_tokens are padding: zero rows, idx -1, weight 0.
  for r in range(num_ranks):
    n = int(d.num_tokens[r])
    assert not np.any(d.x[r, n:].astype(np.float32))
    assert np.all(d.topk_idx[r, n:] == -1) and not np.any(d.topk_weights[r, n:])
    assert np.all(d.handle.recv_src[r, n:] == -1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_combine_matches_oracle(shape, dtype):
  num_ranks, e, k, t, t_local, h = shape
  rng = np.random.default_rng(1 + hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e)
  w = rng.random((num_ranks * t_local, k), np.float32)

  def expert(rows, weights):  # a per-row function so every copy differs per rank
    rank = jax.lax.axis_index("ep").astype(jnp.float32)
    scale = 1.0 + jnp.sum(weights, axis=1, keepdims=True) + rank
    return (rows.astype(jnp.float32) * scale).astype(rows.dtype)

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    out = jax_ep.combine(expert(d.x, d.topk_weights), d.handle, config=config)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config)
    ref_out = jax_ep.reference.combine(expert(ref["x"], ref["topk_weights"]), idx, config=config)
    return out, ref_out

  out, ref_out = run_per_shard(fn, mesh, x, idx, w)
  assert out.dtype == np.dtype(dtype) and out.shape == (num_ranks, t_local, h)
  # Bitwise: both sum a token's copies in float32 in rank order and round once
  # (no multiply, so no fused multiply-add can differ).
  np.testing.assert_array_equal(bits(out), bits(ref_out))
  # Tokens routed nowhere come back as zeros.
  nowhere = np.all(idx.reshape(num_ranks, t_local, k) < 0, axis=2)
  assert not np.any(out[nowhere].astype(np.float32))


def test_dispatch_then_combine_of_identity_sums_copies():
  """combine(dispatch(x).x) = x times the number of ranks the token went to."""
  rng = np.random.default_rng(7)
  config, mesh = setup(4, num_experts=16, hidden=32, max_tokens_per_rank=10, num_topk=4)
  x = random_rows(rng, (40, 32), jnp.float32)
  idx = _routing(rng, 4, 10, 4, 16)

  def fn(x, idx):
    d = jax_ep.dispatch(x, idx, jnp.ones(idx.shape, jnp.float32), config=config)
    return jax_ep.combine(d.x, d.handle, config=config)

  out = run_per_shard(fn, mesh, x, idx).reshape(40, 32)
  copies = np.array([len({e // 4 for e in row if e >= 0}) for row in idx])
  np.testing.assert_allclose(out, x * copies[:, None], rtol=1e-6)


@pytest.mark.parametrize("case", ["one_rank", "no_tokens", "all_invalid_mix"])
def test_dispatch_edge_routing(case):
  rng = np.random.default_rng(3)
  num_ranks, e, k, t = 4, 16, 3, 8
  config, mesh = setup(num_ranks, num_experts=e, hidden=16, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, 16), jnp.bfloat16)
  if case == "one_rank":  # every token of every rank goes to rank 2 only
    idx = _routing(rng, num_ranks, t, k, e, none_fraction=0.0, allowed=np.arange(8, 12))
  elif case == "no_tokens":
    idx = np.full((num_ranks * t, k), -1, np.int32)
  else:
    idx = _routing(rng, num_ranks, t, k, e, none_fraction=0.9)
  w = rng.random((num_ranks * t, k), np.float32)
  d, ref = _dispatch_and_reference(config, mesh, x, idx, w)
  _assert_dispatch_matches(d, ref)
  if case == "one_rank":
    assert list(d.num_tokens) == [0, 0, num_ranks * t, 0]
  if case == "no_tokens":
    assert not np.any(d.num_tokens) and not np.any(d.x.astype(np.float32))


@pytest.mark.parametrize("capacity", [1, 5, 13, 32])
def test_capacity_drops_and_counts(capacity):
  rng = np.random.default_rng(capacity)
  num_ranks, e, k, t = 4, 8, 2, 8
  config, mesh = setup(num_ranks, num_experts=e, hidden=16, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, 16), jnp.float32)
  idx = _routing(rng, num_ranks, t, k, e, none_fraction=0.0, skew=3.0)
  w = rng.random((num_ranks * t, k), np.float32)
  d, ref = _dispatch_and_reference(config, mesh, x, idx, w, capacity=capacity)
  _assert_dispatch_matches(d, ref)
  assert d.x.shape == (num_ranks, capacity, 16)
  layout = run_per_shard(lambda i: jax_ep.reference.get_dispatch_layout(i, config=config),
                         mesh, idx)
  received = layout[0].sum(axis=0)  # tokens sent to each rank
  np.testing.assert_array_equal(d.num_tokens, np.minimum(received, capacity))
  np.testing.assert_array_equal(d.num_dropped, received - np.minimum(received, capacity))

  def fn(x, idx, w):  # combine skips dropped copies
    dd = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    out = jax_ep.combine(dd.x, dd.handle, config=config)
    ref_out = jax_ep.reference.combine(
        jax_ep.reference.dispatch(x, idx, w, config=config, capacity=capacity)["x"], idx,
        config=config, capacity=capacity)
    return out, ref_out

  out, ref_out = run_per_shard(fn, mesh, x, idx, w)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6)


def test_fp8_pair_dispatch_moves_rows_and_scales():
  rng = np.random.default_rng(11)
  num_ranks, e, k, t, h = 4, 16, 4, 8, 256
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t, k, e)
  w = rng.random((num_ranks * t, k), np.float32)

  for round_scale, scale_dtype in [(False, jnp.float32), (True, jnp.float8_e8m0fnu)]:
    def fn(x, idx, w):
      pair = jax_ep.fp8.quantize(x, round_scale=round_scale, scale_dtype=scale_dtype)
      d = jax_ep.dispatch(pair, idx, w, config=config)
      return d, jax_ep.reference.dispatch(pair, idx, w, config=config)

    d, ref = run_per_shard(fn, mesh, x, idx, w)
    assert d.x.dtype == jnp.float8_e4m3fn and d.scales.dtype == np.dtype(scale_dtype)
    _assert_dispatch_matches(d, ref)


def test_int64_indices_are_accepted_and_huge_values_counted_invalid():
  rng = np.random.default_rng(5)
  with jax.enable_x64(True):
    config, mesh = setup(2, num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)
    x = random_rows(rng, (8, 16), jnp.float32)
    idx = _routing(rng, 2, 4, 2, 8).astype(np.int64)
    idx[1, 0] = 2**32 + 3   # would alias expert 3 if truncated to int32
    idx[5, 1] = -(2**40)
    w = rng.random((8, 2), np.float32)
    d, ref = _dispatch_and_reference(config, mesh, x, idx, w)
    _assert_dispatch_matches(d, ref)
    assert list(d.num_invalid) == [1, 1]
    assert d.topk_idx.dtype == np.int32


@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_layout_matches_oracle(shape):
  num_ranks, e, k, t, t_local, _ = shape
  rng = np.random.default_rng(2)
  config, mesh = setup(num_ranks, num_experts=e, hidden=8, max_tokens_per_rank=t, num_topk=k)
  idx = _routing(rng, num_ranks, t_local, k, e)
  idx[0, 0] = e + 5  # invalid: ignored by the counts

  def fn(idx):
    return (jax_ep.get_dispatch_layout(idx, config=config),
            jax_ep.reference.get_dispatch_layout(idx, config=config))

  ours, ref = run_per_shard(fn, mesh, idx)
  for a, b in zip(ours, ref):
    np.testing.assert_array_equal(a, b)


def test_dispatch_is_deterministic_in_source_order():
  """Rows come in (source rank, source token) order: recv_src is increasing."""
  rng = np.random.default_rng(9)
  config, mesh = setup(4, num_experts=8, hidden=8, max_tokens_per_rank=16, num_topk=2)
  idx = _routing(rng, 4, 16, 2, 8)
  x = random_rows(rng, (64, 8), jnp.float32)
  d = run_per_shard(lambda x, i: jax_ep.dispatch(x, i, jnp.ones(i.shape), config=config),
                    mesh, x, idx)
  for r in range(4):
    src = d.handle.recv_src[r, :int(d.num_tokens[r])]
    assert np.all(np.diff(src) > 0)
    # each row really is the source token's row
    np.testing.assert_array_equal(d.x[r, :len(src)], x[src])  # global row = s*T_local + t


@pytest.mark.parametrize("capacity", [None, 1, 5, 13])
@pytest.mark.parametrize("k", [4, 2, 1])
def test_cached_routing_places_rows_like_the_cached_dispatch(capacity, k):
  """The CUDA combine backward dispatches along a synthetic routing
  (backends/cuda.cached_routing): checked here with the portable dispatch
  against the portable cached dispatch, capacity drops included, and for
  R = 4 > K (each token's kept ranks fill its first entries)."""
  from jax_ep.backends.cuda import cached_routing  # pylint: disable=import-outside-toplevel
  from jax_ep.backends.xla import XlaBackend  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(40 + (capacity or 0) + 100 * k)
  num_ranks, e, t = 4, 16, 8
  config, mesh = setup(num_ranks, num_experts=e, hidden=16, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, 16), jnp.float32)
  g = random_rows(rng, (num_ranks * t, 16), jnp.float32)
  idx = _routing(rng, num_ranks, t, k, e, skew=3.0)
  w = rng.random((num_ranks * t, k), np.float32)
  backend = XlaBackend()
  cap = capacity or num_ranks * t

  def fn(x, g, idx, w):
    handle = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity).handle
    cached = backend.ht_dispatch_cached(g, handle)
    routing = cached_routing(handle.send_row, config)
    zeros = jnp.zeros(routing.shape, jnp.float32)
    synthetic = backend.ht_dispatch((g,), routing, zeros, config, cap)
    return (cached, synthetic.x, handle.num_tokens, synthetic.num_tokens, handle.recv_src,
            synthetic.handle.recv_src)

  cached, rows, kept, synthetic_kept, recv_src, synthetic_recv_src = run_per_shard(
      fn, mesh, x, g, idx, w)
  np.testing.assert_array_equal(synthetic_kept, kept)
  np.testing.assert_array_equal(synthetic_recv_src, recv_src)
  np.testing.assert_array_equal(bits(rows), bits(cached))
