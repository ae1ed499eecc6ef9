"""The low-latency combine pre-summed per rank on its kernel (the weights given to
the dispatch; run under jax_ep.launch), against tests/host_reference.py, bit for bit.

Every rank holding a token's experts returns one row, p_r = bf16(the float32
sum from +0.0, in ascending local expert, of fl(W * row)); the source adds the
p_r in float32 in rank order and rounds once. The kernel evaluates exactly
these operations (no fused multiply-add), so the comparison is bitwise; the
per-pair combine rounds once per token instead, and on this data the two
differ (checked, so the comparison could tell them apart).
The suite's fallback="error" makes a portable path fail at trace time: these
tests run the kernels or fail.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference as hr
from gpu_testing import (assert_bitwise, bits, global_routing, mine, num_ranks, rng, rows, run,
                         weights)
from ll_testing import experts, expert, host_expert, ll_setup

SHAPES = [  # (E, K, T_ll, T_local, H)
    (16, 4, 32, 32, 256),
    (32, 8, 64, 40, 512),
    (64, 8, 32, 32, 7168),
    (8, 8, 16, 11, 128),  # K = E: all of a token's rows on one rank at R = 1, one per rank at 8
]


def _inputs(seed, e, k, t_local, h):
  r = num_ranks()
  gen = rng(seed)
  x = rows(gen, (r, t_local, h))
  idx = global_routing(gen, (r,), t_local, k, e)
  idx[:, 0, 0] = e + 3  # invalid: counted, never used
  if k > 2:
    idx[:, 1, 1] = idx[:, 1, 0] = np.arange(r) % e  # one expert named twice: one row, w summed
  idx[:, 2, :] = -1  # a token routed nowhere: +0.0 rows
  w = weights(gen, (r, t_local, k))
  return x, idx, w


def _host_presummed(x, idx, w, config):
  layout = hr.ll_dispatch(x, idx, config)
  y = host_expert(layout.x, layout.count)   # zeros past each expert's count
  return hr.ll_combine_presummed(y, idx, w, layout), y, layout


@pytest.mark.parametrize("shape", SHAPES)
def test_presummed_combine_matches_host_oracle(shape):
  e, k, t_ll, t_local, h = shape
  e = experts(e)
  config, mesh = ll_setup(e, k, t_ll, h)
  x, idx, w = _inputs(600 + e + k, e, k, t_local, h)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    out = jax_ep.low_latency_combine(expert(d.x), idx, None, d.handle, config=config)
    plain = jax_ep.low_latency_dispatch(x, idx, config=config)
    per_pair = jax_ep.low_latency_combine(expert(plain.x), idx, w, plain.handle, config=config)
    return d.count, d.weights, out, per_pair

  count, row_weights, out, per_pair = run(fn, mesh, x, idx, w)
  want, _, layout = _host_presummed(x, idx, w, config)
  assert_bitwise(count, mine(layout.count), "count")
  assert_bitwise(row_weights, mine(hr.ll_pair_weights(idx, w, layout)), "row weights")
  assert out.dtype == want.dtype
  assert_bitwise(out, mine(want), "pre-summed combine")
  assert not np.any(out[2].astype(np.float32)), "a token routed nowhere must get zeros"
  if num_ranks() > 1:  # one rounding per rank vs one per token
    assert np.any(bits(out) != bits(per_pair)), "the comparison would accept the per-pair combine"


def test_presummed_split_ops_match_the_one_call_ops():
  """low_latency_dispatch_send / _recv with topk_weights, then
  low_latency_combine_send / _recv: the same kernels' parts, bit for bit the
  one-call results (rows' weights and combine), around other work."""
  e, k, t_ll, h = experts(32), 8, 64, 512
  config, mesh = ll_setup(e, k, t_ll, h)
  x, idx, w = _inputs(700, e, k, t_ll, h)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    one_call = jax_ep.low_latency_combine(expert(d.x), idx, None, d.handle, config=config)
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, topk_weights=w)
    shared = jnp.tanh(x.astype(jnp.float32)) @ jnp.ones((h, h), jnp.float32)  # overlapped work
    got = jax_ep.low_latency_dispatch_recv(pending, config=config)
    sent = jax_ep.low_latency_combine_send(expert(got.x), got.handle, config=config)
    split = jax_ep.low_latency_combine_recv(sent, idx, None, config=config)
    return d.count, d.weights, one_call, got.count, got.weights, got.handle.row_weights, split, \
        shared[:1]

  count, row_weights, one_call, split_count, split_weights, handle_weights, split, _ = run(
      fn, mesh, x, idx, w)
  assert_bitwise(split_count, count, "split count vs one call")
  assert_bitwise(split_weights, row_weights, "split rows' weights vs one call")
  assert_bitwise(handle_weights, row_weights, "split handle.row_weights")
  assert_bitwise(split, one_call, "split combine vs one call")
  want, _, _ = _host_presummed(x, idx, w, config)
  assert_bitwise(split, mine(want), "split combine vs host")


def test_presummed_and_per_pair_combines_alternate():
  """Both combines share the sequence number, flags and buffers: alternating
  them over several calls with changing routing keeps every result exact."""
  e, k, t_ll, h = experts(32), 4, 32, 256
  config, mesh = ll_setup(e, k, t_ll, h)
  calls = 6
  gen = rng(800)
  r = num_ranks()
  x = rows(gen, (r, t_ll, h))
  w = weights(gen, (r, t_ll, k))
  idx = np.stack([global_routing(gen, (r,), t_ll, k, e) for _ in range(calls)], axis=1)

  def fn(x, w, idx):
    outs = []
    for call in range(calls):
      if call % 2 == 0:
        d = jax_ep.low_latency_dispatch(x, idx[call], config=config, topk_weights=w)
        outs.append(jax_ep.low_latency_combine(expert(d.x), idx[call], None, d.handle,
                                               config=config))
      else:
        d = jax_ep.low_latency_dispatch(x, idx[call], config=config)
        outs.append(jax_ep.low_latency_combine(expert(d.x), idx[call], w, d.handle,
                                               config=config))
    return tuple(outs)

  outs = run(fn, mesh, x, w, idx)
  for call in range(calls):
    if call % 2 == 0:
      want, _, _ = _host_presummed(x, idx[:, call], w, config)
    else:
      layout = hr.ll_dispatch(x, idx[:, call], config)
      want = hr.ll_combine(host_expert(layout.x, layout.count), idx[:, call], w, layout)
    assert_bitwise(outs[call], mine(want), f"call {call}")


def test_rows_past_count_do_not_leak_into_the_sum():
  """Garbage in y past each expert's count: never read."""
  e, k, t_ll, h = experts(16), 4, 32, 256
  config, mesh = ll_setup(e, k, t_ll, h)
  x, idx, w = _inputs(900, e, k, t_ll, h)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
    valid = jnp.arange(d.x.shape[1])[None, :, None] < d.count[:, None, None]
    y = jnp.where(valid, expert(d.x), jnp.bfloat16(jnp.nan))
    return jax_ep.low_latency_combine(y, idx, None, d.handle, config=config)

  out = run(fn, mesh, x, idx, w)
  want, _, _ = _host_presummed(x, idx, w, config)
  assert_bitwise(out, mine(want), "pre-summed combine")
