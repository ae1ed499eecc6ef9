"""Ranks with no tokens: T_local = 0, and ranks whose tokens all route nowhere.

Inside ``jax.shard_map`` every rank has the same per-shard shape, so T_local = 0
is the same on all ranks of one call; a rank that has no tokens this step while
others do is expressed with topk_idx = -1 for all its tokens. Both are checked
here for every op against the oracle (jax_ep.reference), with the CPU FFI local
steps and with their jax.numpy twins (the path of GPUs without the kernels and
of TPUs).

The empty arrays are made inside the shard_map body (``x[:0]``): jax 0.11.2's
Shardy partitioner rejects (or crashes on) jitted shard_maps with several
zero-size arguments, whatever the body does, so that is how a caller gets a
T_local = 0 call today.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import bits, local_steps, random_rows, ranks_routing, run_per_shard, setup

NUM_RANKS, E, K, T, H = 4, 16, 3, 6, 128
EMPTY_RANKS = (0, 2)  # "uneven": these ranks route every token to -1


def _inputs(seed: int, dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = random_rows(rng, (NUM_RANKS * T, H), dtype)
  idx = ranks_routing(rng, NUM_RANKS, T, K, E)
  w = rng.random((NUM_RANKS * T, K), np.float32)
  return x, idx, w


def _uneven(idx: np.ndarray) -> np.ndarray:
  idx = idx.reshape(NUM_RANKS, T, K).copy()
  idx[list(EMPTY_RANKS)] = -1
  return idx.reshape(NUM_RANKS * T, K)


def _tokens(case: str):
  """Per-shard slice: all tokens ("uneven": with EMPTY_RANKS routed nowhere) or none."""
  return (lambda a: a[:0]) if case == "empty" else (lambda a: a)


def _setup():
  return setup(NUM_RANKS, num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K)


def _assert_bits(a, b):
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert u.shape == v.shape and u.dtype == v.dtype, (u.shape, v.shape, u.dtype, v.dtype)
    np.testing.assert_array_equal(bits(u), bits(v))


CASES = [(case, steps) for case in ("empty", "uneven") for steps in ("ffi", "jnp")]


@pytest.mark.parametrize("case,steps", CASES)
def test_layout(case, steps):
  config, mesh = _setup()
  _, idx, _ = _inputs(0)
  take = _tokens(case)

  def fn(idx):
    idx = take(idx)
    return (jax_ep.get_dispatch_layout(idx, config=config),
            jax_ep.reference.get_dispatch_layout(idx, config=config))

  with local_steps(steps):
    ours, ref = run_per_shard(fn, mesh, _uneven(idx))
  t_local = 0 if case == "empty" else T
  assert ours[2].shape == (NUM_RANKS, t_local, NUM_RANKS)
  _assert_bits(ours, ref)
  if case == "empty":
    assert not np.any(ours[0]) and not np.any(ours[1])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case,steps", CASES)
def test_dispatch_and_combine(case, steps, fp8):
  config, mesh = _setup()
  x, idx, w = _inputs(1)
  take = _tokens(case)
  capacity = NUM_RANKS * T

  def fn(x, idx, w):
    x, idx, w = take(x), take(idx), take(w)
    payload = jax_ep.fp8.quantize(x) if fp8 else x
    d = jax_ep.dispatch(payload, idx, w, config=config)
    ref = jax_ep.reference.dispatch(payload, idx, w, config=config)
    rank = jax.lax.axis_index("ep").astype(jnp.float32)
    y = (jnp.ones_like(d.x, jnp.float32) * (rank + 1.0)).astype(jnp.bfloat16)
    y_ref = (jnp.ones_like(ref["x"], jnp.float32) * (rank + 1.0)).astype(jnp.bfloat16)
    y = jnp.where(d.topk_idx[:, :1] >= 0, y, 0)  # rows with a local expert
    y_ref = jnp.where(ref["topk_idx"][:, :1] >= 0, y_ref, 0)
    out = jax_ep.combine(y, d.handle, config=config)
    ref_out = jax_ep.reference.combine(y_ref, idx, config=config)
    return d, ref, out, ref_out

  with local_steps(steps):
    d, ref, out, ref_out = run_per_shard(fn, mesh, x, _uneven(idx), w)
  # Static shapes as with tokens: C rows of padding, [T_local, H] back.
  assert d.x.shape == (NUM_RANKS, capacity, H) and d.topk_idx.shape == (NUM_RANKS, capacity, K)
  t_local = 0 if case == "empty" else T
  assert out.shape == (NUM_RANKS, t_local, H) and out.dtype == jnp.bfloat16
  for field in ("x", "scales", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
                "num_dropped", "num_invalid"):
    if ref[field] is not None:
      _assert_bits(getattr(d, field), ref[field])
  _assert_bits(out, ref_out)
  if case == "empty":
    assert not np.any(d.num_tokens) and not np.any(d.x.view(np.uint8))
    assert np.all(d.topk_idx == -1) and np.all(d.handle.recv_src == -1)
  else:  # tokens of the empty ranks come back as zeros; the others' do not
    out = out.astype(np.float32)
    assert not np.any(out[list(EMPTY_RANKS)])
    assert np.any(out[[r for r in range(NUM_RANKS) if r not in EMPTY_RANKS]])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("case,steps", CASES)
def test_low_latency_dispatch_and_combine(case, steps, fp8):
  config, mesh = _setup()
  x, idx, w = _inputs(2)
  take = _tokens(case)
  rows = NUM_RANKS * config.ll_max_tokens

  def fn(x, idx, w):
    x, idx, w = take(x), take(idx), take(w)
    d = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=fp8)
    ref = jax_ep.reference.low_latency_dispatch(x, idx, config=config, use_fp8=fp8)
    y = jnp.ones((E // NUM_RANKS, rows, H), jnp.bfloat16)
    out = jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)
    ref_out = jax_ep.reference.low_latency_combine(y, idx, w, config=config)
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, use_fp8=fp8)
    split = jax_ep.low_latency_dispatch_recv(pending, config=config)
    sent = jax_ep.low_latency_combine_send(y, split.handle, config=config)
    split_out = jax_ep.low_latency_combine_recv(sent, idx, w, config=config)
    return d, ref, out, ref_out, split.count, split_out

  with local_steps(steps):
    d, ref, out, ref_out, split_count, split_out = run_per_shard(fn, mesh, x, _uneven(idx), w)
  assert d.x.shape == (NUM_RANKS, E // NUM_RANKS, rows, H)
  t_local = 0 if case == "empty" else T
  assert out.shape == (NUM_RANKS, t_local, H) and out.dtype == jnp.bfloat16
  _assert_bits(d.count, ref["count"])
  _assert_bits(d.handle.recv_src, ref["recv_src"])
  _assert_bits(d.num_invalid, np.zeros(NUM_RANKS, np.int32))
  valid = np.arange(rows) < d.count[..., None]
  _assert_bits(d.x[valid], ref["x"][valid])
  if fp8:
    _assert_bits(d.scales[valid], ref["scales"][valid])
  _assert_bits(out, ref_out)
  _assert_bits(split_count, d.count)
  _assert_bits(split_out, out)
  if case == "empty":
    assert not np.any(d.count)
  else:
    out = out.astype(np.float32)
    assert not np.any(out[list(EMPTY_RANKS)])
    assert np.any(out[[r for r in range(NUM_RANKS) if r not in EMPTY_RANKS]])


@pytest.mark.parametrize("steps", ["ffi", "jnp"])
def test_gradients_with_no_tokens(steps):
  """jax.grad through all four one-call ops at T_local = 0: [0, ...] gradients."""
  config, mesh = _setup()
  x, idx, w = _inputs(3, jnp.float32)

  def fn(x, idx, w):
    x, idx, w = x[:0], idx[:0], w[:0]

    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      ht = jax_ep.combine(d.x * jnp.sum(d.topk_weights, axis=1, keepdims=True), d.handle,
                          config=config)
      ll = jax_ep.low_latency_dispatch(x, idx, config=config)
      out = jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config)
      return jnp.sum(ht) + jnp.sum(out)

    return jax.grad(loss, argnums=(0, 1))(x, w)

  with local_steps(steps):
    grad_x, grad_w = run_per_shard(fn, mesh, x, idx, w)
  assert grad_x.shape == (NUM_RANKS, 0, H) and grad_w.shape == (NUM_RANKS, 0, K)


def test_debug_checks_pass_with_no_tokens():
  """No tokens means no invalid index: the run-time check passes on every rank."""
  config, mesh = setup(NUM_RANKS, num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                       debug_checks=True)
  x, idx, w = _inputs(4)

  def fn(x, idx, w):
    d = jax_ep.dispatch(x[:0], idx[:0], w[:0], config=config)
    ll = jax_ep.low_latency_dispatch(x[:0], idx[:0], config=config)
    return d.num_tokens, d.num_invalid, ll.count

  num_tokens, num_invalid, count = run_per_shard(fn, mesh, x, idx, w)
  assert not np.any(num_tokens) and not np.any(num_invalid) and not np.any(count)
