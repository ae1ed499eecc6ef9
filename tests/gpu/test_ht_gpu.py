"""High-throughput kernels on GPU against the oracle (run under jax_ep.launch)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from gpu_testing import bits, call_routing, rank, routing, rows, run, setup

SHAPES = [  # (E, K, T, T_local, H)
    (16, 4, 64, 48, 256),
    (64, 8, 256, 256, 1024),
    (256, 8, 1024, 1024, 7168),
]


def _assert_same(d, ref):
  for name in ("num_tokens", "num_dropped", "num_invalid", "tokens_per_expert", "topk_idx"):
    np.testing.assert_array_equal(getattr(d, name), ref[name], err_msg=name)
  np.testing.assert_array_equal(bits(d.topk_weights), bits(ref["topk_weights"]))
  np.testing.assert_array_equal(bits(d.x), bits(ref["x"]))
  if ref["scales"] is not None:
    np.testing.assert_array_equal(bits(d.scales), bits(ref["scales"]))


def _setup(e, k, t, h, **kwargs):
  return setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
               enable_low_latency=False, **kwargs)


@pytest.mark.parametrize("shape", SHAPES)
def test_ht_dispatch_and_combine_match_oracle(shape):
  e, k, t, t_local, h = shape
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(600 * rank() + e)
  x = rows(rng, (t_local, h))
  idx = routing(rng, t_local, k, e)
  idx[1, 0] = -7  # invalid: counted, never used
  w = rng.random((t_local, k), np.float32)

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config)
    y = (d.x.astype(jnp.float32) * (1 + jnp.sum(d.topk_weights, 1, keepdims=True))).astype(
        jnp.bfloat16)
    y_ref = (ref["x"].astype(jnp.float32) * (1 + jnp.sum(ref["topk_weights"], 1, keepdims=True))
             ).astype(jnp.bfloat16)
    return (d, ref, jax_ep.combine(y, d.handle, config=config),
            jax_ep.reference.combine(y_ref, idx, config=config))

  d, ref, out, ref_out = run(fn, mesh, x, idx, w)
  _assert_same(d, ref)
  assert int(d.num_invalid) == 1
  np.testing.assert_allclose(out.astype(np.float32), ref_out.astype(np.float32), rtol=1e-2,
                             atol=1e-2)


@pytest.mark.parametrize("shape", [(16, 4, 64, 48), (256, 8, 4096, 4096), (64, 32, 128, 100)])
def test_get_dispatch_layout_matches_oracle(shape):
  """get_dispatch_layout on the GPU against the oracle, bitwise: -1 entries, invalid
  values, repeated experts within a token, fewer tokens than max_tokens_per_rank."""
  e, k, t, t_local = shape
  config, mesh = _setup(e, k, t, 256)
  rng = np.random.default_rng(650 * rank() + e + k)
  idx = routing(rng, t_local, k, e)
  idx[0, -1] = -7
  idx[2, 0] = e + 3
  idx[3, :2] = idx[3, 2]  # the same expert three times: counted once

  def fn(idx):
    return (jax_ep.get_dispatch_layout(idx, config=config),
            jax_ep.reference.get_dispatch_layout(idx, config=config))

  got, want = run(fn, mesh, idx)
  for name, a, b in zip(("tokens_per_rank", "tokens_per_expert", "is_token_in_rank"), got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("case", ["one_rank", "no_tokens", "capacity"])
def test_ht_edge_routing(case):
  e, k, t, h = 16, 4, 64, 256
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(700 + rank())
  x = rows(rng, (t, h))
  w = rng.random((t, k), np.float32)
  capacity = None
  if case == "one_rank":
    idx = np.stack([rng.choice(8, k, replace=False) for _ in range(t)]).astype(np.int32)
  elif case == "no_tokens":
    idx = np.full((t, k), -1, np.int32)
  else:
    idx = routing(rng, t, k, e, none_fraction=0.0)
    capacity = 37

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config, capacity=capacity)
    out = jax_ep.combine(d.x, d.handle, config=config)
    ref_out = jax_ep.reference.combine(ref["x"], idx, config=config, capacity=capacity)
    return d, ref, out, ref_out

  d, ref, out, ref_out = run(fn, mesh, x, idx, w)
  _assert_same(d, ref)
  np.testing.assert_allclose(out.astype(np.float32), ref_out.astype(np.float32), rtol=1e-2,
                             atol=1e-2)
  if case == "capacity":
    assert int(d.num_dropped) > 0 and int(d.num_tokens) == 37


@pytest.mark.parametrize("round_scale", [False, True])
def test_ht_fp8_dispatch(round_scale):
  e, k, t, h = 32, 8, 128, 1024
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(800 + rank())
  x = rows(rng, (t, h))
  idx = routing(rng, t, k, e)
  w = rng.random((t, k), np.float32)
  scale_dtype = jnp.float8_e8m0fnu if round_scale else jnp.float32

  def fn(x, idx, w):
    pair = jax_ep.fp8.quantize(x, round_scale=round_scale, scale_dtype=scale_dtype)
    return (jax_ep.dispatch(pair, idx, w, config=config),
            jax_ep.reference.dispatch(pair, idx, w, config=config))

  d, ref = run(fn, mesh, x, idx, w)
  assert d.x.dtype == jnp.float8_e4m3fn
  _assert_same(d, ref)


def test_ht_gradients_match_oracle():
  e, k, t, h = 16, 4, 32, 256
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(900 + rank())
  x = rows(rng, (t, h))
  idx = routing(rng, t, k, e)
  w = rng.random((t, k), np.float32)
  cot = rng.standard_normal((t, h)).astype(np.float32)

  def layer(impl, x, idx, w, cot):
    if impl == "ours":
      d = jax_ep.dispatch(x, idx, w, config=config)
      rows_, weights = d.x, d.topk_weights
    else:
      ref = jax_ep.reference.dispatch(x, idx, w, config=config)
      rows_, weights = ref["x"], ref["topk_weights"]
    y = (jnp.tanh(rows_.astype(jnp.float32)) * jnp.sum(weights, 1, keepdims=True)).astype(
        jnp.bfloat16)
    out = (jax_ep.combine(y, d.handle, config=config) if impl == "ours"
           else jax_ep.reference.combine(y, idx, config=config))
    return jnp.sum(out.astype(jnp.float32) * cot)

  def grads(impl):
    return run(lambda x, i, w, c: jax.grad(lambda x, w: layer(impl, x, i, w, c),
                                           argnums=(0, 1))(x, w), mesh, x, idx, w, cot)

  for a, b in zip(grads("ours"), grads("ref")):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2,
                               atol=5e-2)


@pytest.mark.parametrize("capacity", [None, 50])
def test_combine_backward_moves_rows_like_the_portable_cached_dispatch(capacity):
  """combine's VJP (on CUDA: the dispatch kernel along cached_routing) against the
  portable cached dispatch, bitwise; with capacity drops too."""
  from jax_ep.backends.xla import XlaBackend  # pylint: disable=import-outside-toplevel
  e, k, t, h = 16, 4, 64, 256
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(950 + rank())
  x, g = rows(rng, (t, h)), rows(rng, (t, h))
  idx = routing(rng, t, k, e)
  w = rng.random((t, k), np.float32)

  def fn(x, g, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    _, vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle, config=config), d.x)
    return vjp(g)[0], XlaBackend().ht_dispatch_cached(g, d.handle), d.num_dropped

  got, want, dropped = run(fn, mesh, x, g, idx, w)
  np.testing.assert_array_equal(bits(got), bits(want))
  if capacity is not None:
    assert int(dropped) > 0


def test_ht_1000_calls_with_changing_routing():
  e, k, t, h = 32, 4, 64, 256
  config, mesh = _setup(e, k, t, h)
  rng = np.random.default_rng(1000 + rank())
  x = rows(rng, (t, h))

  def fn(x):
    def step(i, mismatches):
      idx = call_routing(11, i, t, k, e, none_fraction=0.1)
      w = jnp.ones((t, k), jnp.float32)
      d = jax_ep.dispatch(x, idx, w, config=config)
      out = jax_ep.combine(d.x, d.handle, config=config)
      ref = jax_ep.reference.combine(jax_ep.reference.dispatch(x, idx, w, config=config)["x"],
                                     idx, config=config)
      bad = jnp.any(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)) > 5e-2)
      return mismatches + bad.astype(jnp.int32)
    return jax.lax.fori_loop(0, 1000, step, jax.lax.pcast(jnp.int32(0), "ep", to="varying"))

  assert int(run(fn, mesh, x)) == 0
