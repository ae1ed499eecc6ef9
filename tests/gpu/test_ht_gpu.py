"""High-throughput ops on the kernels against the host oracle (run under jax_ep.launch).

Every comparison is bitwise except the weight gradient's dot products (see
test_ht_gradients_match_host_oracle): the HT kernels move bytes, and the
combine sums a token's copies in float32 in rank order from +0.0 with one
rounding at the end, like tests/host_reference.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference as hr
from gpu_testing import (BF16, F32, GRAD_ROUTINGS, assert_bitwise, bf16_accumulated, bits,
                         dyadic_weights, global_routing, grad_routing, mine, num_ranks, rank, rng,
                         rows, run, setup, weights)

SHAPES = [  # (E, K, T, T_local, H)
    (16, 4, 64, 48, 256),
    (64, 8, 256, 256, 1024),
    (256, 8, 256, 256, 7168),
]
NUM_CALLS = 1000


def _setup(e, k, t, h, **kwargs):
  return setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
               enable_low_latency=False, **kwargs)


def _experts(e: int) -> int:
  """E for this R: the table's E, raised to a multiple of R (E_local >= 1)."""
  r = num_ranks()
  return -(-max(e, r) // r) * r


def _expert(rows_, topk_weights):
  """Device expert: y = bf16(f32(row) * (1 + sum_k received weight)). With
  dyadic weights (gpu_testing.dyadic_weights) the sum is exact in any order and
  the product is exact before the one rounding, so _host_expert is its exact twin."""
  scale = 1 + jnp.sum(topk_weights, axis=-1, keepdims=True)
  return (rows_.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def _host_expert(rows_: np.ndarray, topk_weights: np.ndarray) -> np.ndarray:
  scale = np.float32(1) + topk_weights.sum(axis=-1, keepdims=True, dtype=F32)
  return (rows_.astype(F32) * scale).astype(BF16)


def _assert_dispatch(d, want: hr.HtDispatch) -> None:
  """Every field of this rank's DispatchResult (and handle) equals the oracle's, bitwise."""
  for name in ("x", "scales", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
               "num_dropped", "num_invalid"):
    expected = getattr(want, name)
    if expected is None:
      assert getattr(d, name) is None, name
    else:
      assert_bitwise(getattr(d, name), expected[rank()], name)
  assert_bitwise(d.handle.recv_src, want.recv_src[rank()], "recv_src")
  assert_bitwise(d.handle.send_row, want.send_row[rank()], "send_row")


def _assert_combine(out, y: np.ndarray, layout: hr.HtDispatch) -> None:
  """Bitwise with the oracle, and the same comparison rejects a bf16 accumulator
  on this data where a token has three or more copies (with two, bf16
  accumulation from +0.0 rounds once, exactly like the contract)."""
  want = hr.ht_combine(y, layout)
  assert_bitwise(out, mine(want), "combine")
  mutant = bf16_accumulated(hr.ht_combine_terms(y, layout), y.dtype)
  if (layout.send_row >= 0).sum(-1).max() >= 3:
    assert np.any(bits(mutant) != bits(want)), "the comparison would accept bf16 accumulation"


@pytest.mark.parametrize("shape", SHAPES)
def test_ht_dispatch_and_combine_match_host_oracle(shape):
  e, k, t, t_local, h = shape
  e = _experts(e)
  config, mesh = _setup(e, k, t, h)
  gen = rng(600 + e)
  r = num_ranks()
  x = rows(gen, (r, t_local, h))
  idx = global_routing(gen, (r,), t_local, k, e)
  idx[:, 1, 0] = -7  # invalid on every rank: counted, never used
  idx[:, 2, 1] = idx[:, 2, 0] = np.arange(r) % e  # one expert named twice
  w = dyadic_weights(gen, (r, t_local, k))

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    return d, jax_ep.combine(_expert(d.x, d.topk_weights), d.handle, config=config)

  d, out = run(fn, mesh, x, idx, w)
  layout = hr.ht_dispatch(x, idx, w, config)
  _assert_dispatch(d, layout)
  assert int(d.num_invalid) == 1
  _assert_combine(out, _host_expert(layout.x, layout.topk_weights), layout)


@pytest.mark.parametrize("shape", [(16, 4, 64, 48), (256, 8, 4096, 4096), (64, 32, 128, 100)])
def test_get_dispatch_layout_matches_host_oracle(shape):
  """-1 entries, invalid values, repeated experts within a token, fewer tokens
  than max_tokens_per_rank; bitwise."""
  e, k, t, t_local = shape
  e = _experts(e)
  config, mesh = _setup(e, k, t, 256)
  gen = rng(650 + e + k)
  idx = global_routing(gen, (num_ranks(),), t_local, k, e)
  idx[:, 0, -1] = -7
  idx[:, 2, 0] = e + 3
  idx[:, 3, :2] = idx[:, 3, 2:3]  # the same expert three times: counted once

  got = run(lambda i: jax_ep.get_dispatch_layout(i, config=config), mesh, idx)
  want = hr.get_dispatch_layout(idx, config)
  for name, a, b in zip(("tokens_per_rank", "tokens_per_expert", "is_token_in_rank"), got, want):
    assert_bitwise(a, mine(b), name)


@pytest.mark.parametrize("case", ["one_rank", "no_tokens", "capacity"])
def test_ht_edge_routing(case):
  e, k, t, h = _experts(16), 4, 64, 256
  config, mesh = _setup(e, k, t, h)
  r = num_ranks()
  gen = rng(700)
  x = rows(gen, (r, t, h))
  w = dyadic_weights(gen, (r, t, k))
  capacity = None
  if case == "one_rank":  # every token to rank 0's experts only
    picked = np.argsort(gen.random((r, t, e // r)), axis=-1)[..., :k]
    idx = np.full((r, t, k), -1, np.int32)
    idx[..., :picked.shape[-1]] = picked
  elif case == "no_tokens":
    idx = np.full((r, t, k), -1, np.int32)
  else:
    idx = global_routing(gen, (r,), t, k, e, none_fraction=0.0)
    capacity = 37

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    return d, jax_ep.combine(_expert(d.x, d.topk_weights), d.handle, config=config)

  d, out = run(fn, mesh, x, idx, w)
  layout = hr.ht_dispatch(x, idx, w, config, capacity)
  _assert_dispatch(d, layout)
  _assert_combine(out, _host_expert(layout.x, layout.topk_weights), layout)
  if case == "capacity":
    assert int(layout.num_dropped.max()) > 0


# Hidden 384: 3 float8_e8m0fnu scales per row, not a whole 4-byte word (the
# kernel moves words; the backend pads such rows: a 2026-12-03 fuzzer finding,
# where such scales came back unwritten).
@pytest.mark.parametrize("hidden", [1024, 384])
@pytest.mark.parametrize("round_scale", [False, True])
def test_ht_fp8_dispatch(round_scale, hidden):
  e, k, t, h = _experts(32), 8, 128, hidden
  config, mesh = _setup(e, k, t, h)
  r = num_ranks()
  gen = rng(800)
  x = rows(gen, (r, t, h))
  idx = global_routing(gen, (r,), t, k, e)
  w = weights(gen, (r, t, k))
  pair = hr.quantize_fp8(x, round_scale=round_scale,
                         scale_dtype=hr.FLOAT8_E8M0 if round_scale else hr.F32)

  d = run(lambda q, s, idx, w: jax_ep.dispatch((q, s), idx, w, config=config), mesh, *pair, idx,
          w)
  assert d.x.dtype == jnp.float8_e4m3fn
  _assert_dispatch(d, hr.ht_dispatch(pair, idx, w, config))


GRAD_SHAPES = [  # (E, K, T, H): K = 1 makes combine's backward run with R > K at every R
    (16, 4, 32, 256),
    (16, 1, 32, 256),
    (256, 8, 64, 7168),
]


def host_grads(x, idx, w, cot, config):
  """d(sum_r sum(f32(out_r) * cot_r))/d(x, topk_weights) of dispatch -> _expert
  -> combine, from tests/host_reference.py's VJP formulas (global [R, ...]
  arrays): (grad_x bf16, grad_w float64, sum |terms| of grad_w for its bound)."""
  layout = hr.ht_dispatch(x, idx, w, config)
  scale = np.float32(1) + layout.topk_weights.sum(axis=-1, dtype=F32)      # [R, C], exact
  ct_y = hr.ht_combine_vjp(cot.astype(BF16), layout).astype(F32)          # [R, C, H]
  ct_rows = (ct_y * scale[..., None]).astype(BF16)
  terms = ct_y.astype(np.float64) * layout.x.astype(np.float64)
  ct_scale = np.broadcast_to(terms.sum(-1)[..., None], layout.topk_weights.shape)
  ct_scale_abs = np.broadcast_to(np.abs(terms).sum(-1)[..., None], layout.topk_weights.shape)
  want_x, want_w = hr.ht_dispatch_vjp(ct_rows, ct_scale, layout)
  _, want_abs = hr.ht_dispatch_vjp(ct_rows, ct_scale_abs, layout)
  return want_x, want_w, want_abs


# Every routing on the first shape, the random one on the others.
GRAD_CASES = ([(GRAD_SHAPES[0], name) for name in GRAD_ROUTINGS] +
              [(shape, "random") for shape in GRAD_SHAPES[1:]])


@pytest.mark.parametrize("wrt", ["x", "x_and_topk_weights"])
@pytest.mark.parametrize("shape,routing_name", GRAD_CASES)
def test_ht_gradients_match_host_oracle(shape, routing_name, wrt):
  """jax.grad of dispatch -> _expert -> combine w.r.t. x, or x and topk_weights
  (dispatch's weight cotangent takes a combine of float32 [C, K] values).

  Each rank's loss is sum(f32(out) * cot_r) with its own cotangent (no psum);
  the ops' VJPs move cotangents between ranks, so rank s receives d(sum_r
  loss_r)/d(x_s, w_s), which the host computes from the VJP formulas of
  tests/host_reference.py. Tolerances:
  * grad_x: bitwise. Its steps are a move of bf16(cot), a product by the exact
    dyadic scale (exact: 8 + 12 significant bits) rounded once to bf16, and a
    rank-order float32 sum of the copies rounded once: the same operations here.
  * grad_w: d/dw of row i is sum_h f32(ct_y[i, h]) * f32(row[i, h]), products
    of bf16 numbers (exact in float32) summed in float32 in an unspecified
    order: within hr.f32_sum_bound (gamma_{H-1} * sum |terms|); the moves
    after it are exact (one nonzero term per entry).
  With every token on one rank's experts (gpu_testing.GRAD_ROUTINGS), the
  other ranks receive no rows and that rank sends none.
  """
  e, k, t, h = shape
  e = _experts(e)
  config, mesh = _setup(e, k, t, h)
  r = num_ranks()
  gen = rng(900 + k)
  x = rows(gen, (r, t, h))
  idx = grad_routing(routing_name, gen, (r,), t, k, e)
  idx[:, 0, 0] = e + 1  # invalid: no gradient
  if k > 1:  # one expert named twice (on the routing's own ranks)
    idx[:, 1, 1] = idx[:, 1, 0] = np.arange(r) % e if routing_name == "random" else idx[:, 1, 0]
  w = dyadic_weights(gen, (r, t, k))
  cot = gen.standard_normal((r, t, h), dtype=np.float32)

  def fn(x, idx, w, cot):
    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      out = jax_ep.combine(_expert(d.x, d.topk_weights), d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) * cot)
    if wrt == "x":
      return jax.grad(loss)(x, w), jnp.zeros((), jnp.float32)
    return jax.grad(loss, argnums=(0, 1))(x, w)

  grad_x, grad_w = run(fn, mesh, x, idx, w, cot)

  want_x, want_w, want_abs = host_grads(x, idx, w, cot, config)
  assert_bitwise(grad_x, mine(want_x), "grad x")
  if wrt == "x":
    return
  assert grad_w.dtype == np.float32
  error = np.abs(grad_w.astype(np.float64) - mine(want_w))
  bound = hr.f32_sum_bound(mine(want_abs), h)
  assert np.all(error <= bound), (float(error.max()), float((error - bound).max()))
  assert np.all(grad_w[mine(idx) < 0] == 0) and np.all(grad_w[mine(idx) >= e] == 0)


@pytest.mark.parametrize("capacity", [None, 50])
@pytest.mark.parametrize("k", [4, 1])
def test_combine_backward_is_the_cached_dispatch(capacity, k):
  """combine's VJP (on CUDA: the dispatch kernel along cached_routing, or
  its R > K path; K = 1 takes that at every R) against the host's cached
  dispatch, bitwise; with capacity drops too."""
  e, t, h = _experts(16), 64, 256
  config, mesh = _setup(e, k, t, h)
  r = num_ranks()
  gen = rng(950 + k)
  x, g = rows(gen, (r, t, h)), rows(gen, (r, t, h))
  idx = global_routing(gen, (r,), t, k, e, none_fraction=0.05)
  w = weights(gen, (r, t, k))

  def fn(x, g, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, capacity=capacity)
    _, vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle, config=config), d.x)
    return vjp(g)[0]

  got = run(fn, mesh, x, g, idx, w)
  layout = hr.ht_dispatch(x, idx, w, config, capacity)
  assert_bitwise(got, mine(hr.ht_combine_vjp(g, layout)), "combine vjp")
  if capacity is not None:
    assert int(layout.num_dropped.max()) > 0


def test_ht_1000_calls_with_changing_routing():
  """NUM_CALLS back-to-back dispatch+combine calls in one graph, a new routing
  each call (host-generated, with -1 entries), every call's counts and combine
  output checked against the host oracle (bitwise)."""
  e, k, t, h = _experts(32), 4, 64, 256
  config, mesh = _setup(e, k, t, h)
  r = num_ranks()
  gen = rng(1000)
  x = rows(gen, (r, t, h))
  w = dyadic_weights(gen, (r, t, k))
  idx = np.moveaxis(global_routing(gen, (NUM_CALLS, r), t, k, e), 0, 1)   # [R, calls, T, K]

  def fn(x, w, idx):
    def step(carry, idx):
      d = jax_ep.dispatch(x, idx, w, config=config)
      out = jax_ep.combine(_expert(d.x, d.topk_weights), d.handle, config=config)
      return carry, (out, d.num_tokens, d.tokens_per_expert)
    return jax.lax.scan(step, None, idx)[1]

  outs, counts, per_expert = run(fn, mesh, x, w, idx)
  for call in range(NUM_CALLS):
    layout = hr.ht_dispatch(x, idx[:, call], w, config)
    assert_bitwise(counts[call], mine(layout.num_tokens), f"call {call}: num_tokens")
    assert_bitwise(per_expert[call], mine(layout.tokens_per_expert), f"call {call}: per expert")
    want = hr.ht_combine(_host_expert(layout.x, layout.topk_weights), layout)
    assert_bitwise(outs[call], mine(want), f"call {call}: combine")
