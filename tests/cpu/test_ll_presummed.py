"""The low-latency combine with the weights given to the dispatch: one row back
per (token, rank), against the oracle (jax_ep.reference) and the host oracle."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
import host_reference as hr
from ep_testing import (bits, check_grads_of_layer, exact_grad_problem, global_fn, place,
                        random_rows, ranks_routing, run_per_shard, setup, valid_rows_mask)

# (R, E, K, T, T_local, H)
SHAPES = [
    (1, 4, 2, 4, 4, 128),
    (2, 8, 4, 6, 4, 128),
    (4, 16, 4, 5, 5, 256),
    (4, 8, 8, 3, 2, 128),
    (8, 32, 8, 4, 3, 128),
]


@pytest.fixture(autouse=True)
def _no_masks_left_behind():
  yield
  jax_ep.unmask_all()


def _routing(rng, num_ranks, t_local, k, e, **kwargs):
  idx = ranks_routing(rng, num_ranks, t_local, k, e, **kwargs)
  if k > 2:  # a token naming one expert twice: one row, its weights summed
    idx[0, 1] = idx[0, 0] = max(idx[0, 0], 0)
  return idx


def _expert(rows):
  """Different per local expert and rank, in the rows' dtype."""
  el = jnp.arange(rows.shape[0], dtype=jnp.float32)[:, None, None]
  rank = jax.lax.axis_index("ep").astype(jnp.float32)
  return (rows.astype(jnp.float32) * (1.0 + 0.25 * el) - rank).astype(rows.dtype)


def _global(a: np.ndarray, num_ranks: int) -> np.ndarray:
  return a.reshape((num_ranks, -1) + a.shape[1:])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_presummed_combine_matches_both_oracles_bitwise(shape, dtype):
  num_ranks, e, k, t, t_local, h = shape
  rng = np.random.default_rng(hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=1.0)
  w = rng.random((num_ranks * t_local, k), np.float32)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    y = _expert(d.x)
    ref = jax_ep.reference.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    return (d, y, jax_ep.low_latency_combine(y, idx, None, d.handle, config=config),
            ref, jax_ep.reference.low_latency_combine(_expert(ref["x"]), idx, w, config=config,
                                                      presummed=True),
            jax_ep.low_latency_combine(y, idx, w, jax_ep.low_latency_dispatch(
                x, idx, config=config).handle, config=config))

  d, y, out, ref, ref_out, per_pair = run_per_shard(fn, mesh, x, idx, w)
  valid = valid_rows_mask(d.count, num_ranks * t)
  np.testing.assert_array_equal(bits(d.weights), bits(ref["weights"]))
  np.testing.assert_array_equal(bits(d.handle.row_weights), bits(d.weights))
  assert not np.any(d.weights[~valid])
  np.testing.assert_array_equal(bits(out), bits(ref_out))
  layout = hr.ll_dispatch(_global(x, num_ranks), _global(idx, num_ranks), config)
  np.testing.assert_array_equal(bits(d.weights), bits(hr.ll_pair_weights(
      _global(idx, num_ranks), _global(w, num_ranks), layout)))
  host = hr.ll_combine_presummed(np.where(valid[..., None], y, 0).astype(y.dtype),
                                 _global(idx, num_ranks), _global(w, num_ranks), layout)
  np.testing.assert_array_equal(bits(out), bits(host.reshape(out.shape)))
  # The other contract rounds once, not once per rank: on bf16 rows with tokens
  # spread over several ranks the two must differ somewhere.
  if dtype == jnp.bfloat16 and num_ranks > 1:
    assert np.any(bits(out) != bits(per_pair))


def test_rows_past_count_are_ignored_and_uneven_ranks():
  """Garbage in the rows past count; ranks 0 and 2 route every token nowhere."""
  num_ranks, e, k, t, h = 4, 16, 4, 6, 128
  rng = np.random.default_rng(5)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t, k, e).reshape(num_ranks, t, k)
  idx[[0, 2]] = -1
  idx = idx.reshape(-1, k)
  w = rng.random((num_ranks * t, k), np.float32)
  garbage = random_rows(rng, (num_ranks * (e // num_ranks), num_ranks * t, h), jnp.bfloat16)

  def fn(x, idx, w, garbage):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    valid = jnp.arange(d.x.shape[1])[None, :, None] < d.count[:, None, None]
    y = jnp.where(valid, d.x, garbage)
    return (jax_ep.low_latency_combine(y, idx, None, d.handle, config=config),
            jax_ep.reference.low_latency_combine(
                jax_ep.reference.low_latency_dispatch(x, idx, config=config)["x"], idx, w,
                config=config, presummed=True))

  out, ref = run_per_shard(fn, mesh, x, idx, w, garbage)
  np.testing.assert_array_equal(bits(out), bits(ref))
  assert not np.any(out.reshape(num_ranks, t, h)[[0, 2]].astype(np.float32))


def test_split_ops_match_the_one_call_ops():
  num_ranks, e, k, t, h = 4, 16, 4, 5, 128
  rng = np.random.default_rng(6)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t, k, e)
  w = rng.random((num_ranks * t, k), np.float32)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    one_call = jax_ep.low_latency_combine(_expert(d.x), idx, None, d.handle, config=config)
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, topk_weights=w)
    split = jax_ep.low_latency_dispatch_recv(pending, config=config)
    back = jax_ep.low_latency_combine_send(_expert(split.x), split.handle, config=config)
    return d, one_call, split, jax_ep.low_latency_combine_recv(back, idx, None, config=config)

  d, one_call, split, split_out = run_per_shard(fn, mesh, x, idx, w)
  np.testing.assert_array_equal(bits(split.weights), bits(d.weights))
  np.testing.assert_array_equal(bits(split_out), bits(one_call))


def test_masked_ranks_are_left_out():
  num_ranks, e, k, t, h = 4, 16, 4, 5, 128
  rng = np.random.default_rng(8)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t, k, e)
  w = rng.random((num_ranks * t, k), np.float32)
  masked = 2
  live_idx = idx.copy()
  live_idx[np.where(idx >= 0, idx // (e // num_ranks), -1) == masked] = -1
  live_idx[masked * t:(masked + 1) * t] = -1
  jax_ep.mask_rank(masked)

  def fn(x, idx, live_idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    out = jax_ep.low_latency_combine(_expert(d.x), idx, None, d.handle, config=config)
    ref = jax_ep.reference.low_latency_dispatch(x, live_idx, config=config)
    return out, jax_ep.reference.low_latency_combine(_expert(ref["x"]), live_idx, w,
                                                     config=config, presummed=True)

  out, ref = run_per_shard(fn, mesh, x, idx, live_idx, w)
  live = [r for r in range(num_ranks) if r != masked]
  np.testing.assert_array_equal(bits(out[live]), bits(ref[live]))


# ---------------------------------------------------------------- gradients
def _layer(x, idx, w, config, impl, nonlinear):
  if impl == "ours":
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    y = jnp.tanh(d.x) if nonlinear else d.x * 3
    return jax_ep.low_latency_combine(y, idx, None, d.handle, config=config)
  ref = jax_ep.reference.low_latency_dispatch(x, idx, config=config)
  y = jnp.tanh(ref["x"]) if nonlinear else ref["x"] * 3
  return jax_ep.reference.low_latency_combine(y, idx, w, config=config, presummed=True)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_gradients_match_the_oracle_bitwise_on_exact_sums(num_ranks):
  """float32, small integers / 4, weights k/8, integer cotangents: every sum in
  both passes is exact, so the gradients of x and topk_weights agree bit for bit."""
  rng = np.random.default_rng(num_ranks)
  e, k, t, h = 4 * num_ranks, 4, 4, 16
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x, idx, w, cot = place(mesh, *exact_grad_problem(
      rng, num_ranks * t, h, k, lambda: _routing(rng, num_ranks, t, k, e)))
  grads = {}
  for impl in ("ours", "ref"):
    f = global_fn(lambda x, i, w, impl=impl: _layer(x, i, w, config, impl, False), mesh)
    with jax.set_mesh(mesh):
      grads[impl] = jax.grad(lambda x, w: jnp.sum(f(x, idx, w) * cot), argnums=(0, 1))(x, w)
  for a, b in zip(grads["ours"], grads["ref"]):
    np.testing.assert_array_equal(bits(a), bits(b))
  chosen = np.asarray(idx) >= 0
  assert np.any(np.asarray(grads["ours"][1])[chosen])
  assert not np.any(np.asarray(grads["ours"][1])[~chosen])


def test_gradients_check_numerically():
  rng = np.random.default_rng(1)
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=3, num_topk=2)
  x = random_rows(rng, (6, 128), jnp.float32) * 0.5
  idx = _routing(rng, 2, 3, 2, 4)
  w = rng.random((6, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)
  f = global_fn(lambda x, i, w: _layer(x, i, w, config, "ours", True), mesh)
  check_grads_of_layer(f, mesh, x, idx, w, atol=2e-2, rtol=2e-2)


def test_gradient_of_the_dispatched_weights_alone():
  """The result's weights are differentiable too (a user weighting rows themselves)."""
  rng = np.random.default_rng(2)
  config, mesh = setup(4, num_experts=8, hidden=128, max_tokens_per_rank=4, num_topk=2)
  x = random_rows(rng, (16, 128), jnp.float32)
  idx = _routing(rng, 4, 4, 2, 8)
  w = rng.integers(1, 9, (16, 2)).astype(np.float32) / 8
  x, idx, w = place(mesh, x, idx, w)

  def per_shard(x, i, w):
    return jnp.sum(jax_ep.low_latency_dispatch(x, i, config=config, topk_weights=w).weights
                   ** 2)[None]

  f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  with jax.set_mesh(mesh):
    grad = np.asarray(jax.grad(lambda w: jnp.sum(f(x, idx, w)))(w))
  # d/dw[t, k] of sum over rows of W^2 = 2 W (t, e_k); distinct experts here: W = w.
  idx_np, w_np = np.asarray(idx), np.asarray(w)
  np.testing.assert_array_equal(grad, np.where(idx_np >= 0, 2 * w_np, 0))


# ---------------------------------------------------------------- errors
def test_the_weights_live_in_one_place():
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=2)
  x = np.zeros((4, 128), np.float32)
  idx = np.zeros((4, 2), np.int32)
  w = np.ones((4, 2), np.float32)

  def twice(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config)

  def nowhere(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    return jax_ep.low_latency_combine(d.x, idx, None, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError, match="pass topk_weights=None here"):
    run_per_shard(twice, mesh, x, idx, w)
  with pytest.raises(jax_ep.EpConfigError, match="pass them to one of the two"):
    run_per_shard(nowhere, mesh, x, idx, w)
