"""Gradients of all four ops against the oracle's plain autodiff."""

import functools

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import (check_grads_of_layer, global_fn, place, random_rows, setup,
                        weight_and_row_grads)
from ep_testing import ranks_routing as _routing


def _ht_layer(x, idx, w, config, impl):
  """dispatch -> nonlinear per-row expert scaled by the received weights -> combine."""
  if impl == "ours":
    d = jax_ep.dispatch(x, idx, w, config=config)
    rows, weights = d.x, d.topk_weights
  else:
    ref = jax_ep.reference.dispatch(x, idx, w, config=config)
    rows, weights = ref["x"], ref["topk_weights"]
  y = (jnp.tanh(rows.astype(jnp.float32)) * jnp.sum(weights, axis=1, keepdims=True)).astype(
      rows.dtype)
  if impl == "ours":
    return jax_ep.combine(y, d.handle, config=config)
  return jax_ep.reference.combine(y, idx, config=config)


def _ll_layer(x, idx, w, config, impl):
  if impl == "ours":
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    y = jnp.tanh(d.x.astype(jnp.float32)).astype(d.x.dtype)
    return jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)
  ref = jax_ep.reference.low_latency_dispatch(x, idx, config=config)
  y = jnp.tanh(ref["x"].astype(jnp.float32)).astype(x.dtype)
  return jax_ep.reference.low_latency_combine(y, idx, w, config=config)


@pytest.mark.parametrize("layer", [_ht_layer, _ll_layer], ids=["ht", "ll"])
@pytest.mark.parametrize("num_ranks,dtype", [(2, jnp.float32), (4, jnp.float32),
                                             (4, jnp.bfloat16), (8, jnp.float32)])
def test_grad_matches_oracle(layer, num_ranks, dtype):
  rng = np.random.default_rng(num_ranks)
  e, k, t, h = 2 * num_ranks * 2, 3, 6, 128
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  t_local = t - 1
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e)
  w = rng.random((num_ranks * t_local, k), np.float32)
  cot = random_rows(rng, (num_ranks * t_local, h), jnp.float32)
  x, idx, w, cot = place(mesh, x, idx, w, cot)

  def loss(impl, x, w):
    f = global_fn(lambda x, i, w: layer(x, i, w, config, impl), mesh)
    return jnp.sum(f(x, idx, w).astype(jnp.float32) * cot)

  with jax.set_mesh(mesh):
    ours = jax.grad(functools.partial(loss, "ours"), argnums=(0, 1))(x, w)
    ref = jax.grad(functools.partial(loss, "ref"), argnums=(0, 1))(x, w)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  for a, b in zip(ours, ref):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol,
                               atol=tol)
  assert np.any(np.asarray(ours[1]))  # the weights really receive a gradient


def test_grad_of_weights_only_and_of_rows_only():
  """Each output's cotangent path works on its own (symbolic zeros elsewhere)."""
  rng = np.random.default_rng(0)
  config, mesh = setup(4, num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)
  x = random_rows(rng, (16, 16), jnp.float32)
  idx = _routing(rng, 4, 4, 2, 8)
  w = rng.random((16, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)
  grads = weight_and_row_grads(mesh, x, idx, w, config=config)
  for a, b in zip(grads["ours"], grads["ref"]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


@pytest.mark.parametrize("layer", [_ht_layer, _ll_layer], ids=["ht", "ll"])
def test_check_grads_numerically(layer):
  rng = np.random.default_rng(1)
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=3, num_topk=2)
  x = random_rows(rng, (6, 128), jnp.float32) * 0.5
  idx = _routing(rng, 2, 3, 2, 4)
  w = rng.random((6, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)
  f = global_fn(lambda x, i, w: layer(x, i, w, config, "ours"), mesh)
  check_grads_of_layer(f, mesh, x, idx, w, atol=2e-2, rtol=2e-2)


def test_fp8_dispatch_rows_are_not_differentiable_but_weights_are():
  rng = np.random.default_rng(2)
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=3, num_topk=2)
  x = random_rows(rng, (6, 128), jnp.float32)
  idx = _routing(rng, 2, 3, 2, 4)
  w = rng.random((6, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)

  def per_shard(x, i, w, use_rows):
    d = jax_ep.dispatch(jax_ep.fp8.quantize(x), i, w, config=config)
    value = jnp.sum(d.topk_weights ** 2)
    if use_rows:
      value = value + jnp.sum(d.x.astype(jnp.float32))
    return value[None]

  weights_only = global_fn(functools.partial(per_shard, use_rows=False), mesh)
  with_rows = global_fn(functools.partial(per_shard, use_rows=True), mesh)
  with jax.set_mesh(mesh):
    assert np.any(np.asarray(jax.grad(lambda w: jnp.sum(weights_only(x, idx, w)))(w)))
    with pytest.raises(jax_ep.EpError, match="FP8"):
      jax.grad(lambda x: jnp.sum(with_rows(x, idx, w)))(x)


def test_forward_mode_gives_a_clear_error():
  config, mesh = setup(2, num_experts=4, hidden=8, max_tokens_per_rank=2, num_topk=1)
  x, idx, w = place(mesh, np.ones((4, 8), np.float32), np.zeros((4, 1), np.int32),
                     np.ones((4, 1), np.float32))
  f = global_fn(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh)
  with jax.set_mesh(mesh), pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: f(x, idx, w), (x,), (x,))
