"""Low-latency ops on the kernels against the host oracle (run under jax_ep.launch).

Dispatched rows, counts and sources compare bitwise (FP8 rows within one e4m3
step, see test_ll_dispatch_matches_host_oracle). The combine is compared
within LL_COMBINE_ULPS of the host's float32 evaluation in the contract's
order (why: _assert_combine).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference as hr
from gpu_testing import (BF16, F32, GRAD_ROUTINGS, ON_CPU, assert_bitwise, assert_within_ulp,
                         bf16_accumulated, bits, dyadic_weights, global_routing, grad_routing,
                         mine, num_ranks, rng, rows, run, weights)
from ll_testing import experts, expert, host_expert, host_scale, ll_setup, valid_rows

SHAPES = [  # (E, K, T_ll, T_local, H)
    (16, 4, 32, 32, 256),
    (32, 8, 64, 40, 512),
    (64, 8, 32, 32, 7168),
    # At one rank on a GPU of 132 SMs, the one-rank dispatch's two ways
    # (cuda/ll_kernels.cu): by per-block questions with two experts per block
    # and K not a multiple of 4, and (K > 8, more tokens than blocks) by the
    # routing table.
    (256, 6, 128, 100, 256),
    (32, 12, 160, 150, 256),
]
NUM_CALLS = 1000

# The LL combine evaluates the contract's operations exactly: in k order,
# acc = fl(acc + fl(w * y)), on the kernel (no fused multiply-add,
# cuda/ll_kernels.cu) and on the portable backend alike: bitwise.
LL_COMBINE_ULPS = 0
# FP8 scales: the kernel divides amax / 448 like the host (bitwise); XLA's
# portable path multiplies by fl(1/448), which moves the quotient by less than
# one float32 ulp (see tests/cpu/test_host_reference.py).
FP8_SCALE_ULPS = 1 if ON_CPU else 0


def _assert_combine(out, y, idx, w, layout: hr.LlDispatch, name: str = "combine") -> None:
  """Within LL_COMBINE_ULPS of the host oracle, and the same comparison
  rejects a bf16 accumulator on this data."""
  want = hr.ll_combine(y, idx, w, layout)
  assert out.dtype == want.dtype == BF16
  assert_within_ulp(out, mine(want), LL_COMBINE_ULPS, name)
  mutant = bf16_accumulated(hr.ll_combine_terms(y, idx, w, layout), want.dtype)
  assert hr.ulp_distance(mine(mutant), mine(want)).max() > LL_COMBINE_ULPS, (
      "the comparison would accept bf16 accumulation here")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_ll_dispatch_matches_host_oracle(shape, use_fp8):
  e, k, t_ll, t_local, h = shape
  e = experts(e)
  config, mesh = ll_setup(e, k, t_ll, h)
  r = num_ranks()
  gen = rng(100 + e)
  x = rows(gen, (r, t_local, h))
  idx = global_routing(gen, (r,), t_local, k, e)
  idx[:, 0, 0] = e + 3  # invalid: counted, never used
  idx[:, 1, 1] = idx[:, 1, 0] = np.arange(r) % e  # one expert named twice: one row

  d = run(lambda x, idx: jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8),
          mesh, x, idx)
  want = mine(hr.ll_dispatch(x, idx, config, use_fp8=use_fp8))
  assert d.x.shape == (e // r, r * t_ll, h)
  assert_bitwise(d.count, want.count, "count")
  assert_bitwise(d.handle.recv_src, want.recv_src, "recv_src")
  assert int(d.num_invalid) == 1
  valid = valid_rows(d.count, d.x.shape[1])
  if not use_fp8:
    assert_bitwise(d.x[valid], want.x[valid], "rows")
    return
  assert_fp8_rows(d, want, valid)


def assert_fp8_rows(d, want: hr.LlDispatch, valid: np.ndarray) -> None:
  """An FP8 LL dispatch's rows ``d.x[valid]`` and scales against this rank's
  host result ``want``: scales within FP8_SCALE_ULPS, each value within one
  e4m3 step, at least 99% of the bytes bitwise (all of them on CPU)."""
  assert_within_ulp(d.scales[valid], want.scales[valid], FP8_SCALE_ULPS, "scales")
  deq = hr.dequantize_fp8(d.x[valid], want.scales[valid])
  want_deq = hr.dequantize_fp8(want.x[valid], want.scales[valid])
  # Same formula; the hardware cast may round a rare tie differently: at most
  # one e4m3 step, which is 32 (the spacing of e4m3 in [256, 448]) times the
  # group's scale at the top of the range.
  step = np.repeat(want.scales[valid].astype(F32), hr.FP8_GROUP, axis=-1) * 32
  assert np.all(np.abs(deq - want_deq) <= step), (
      f"FP8 rows: more than one e4m3 step away ({float(np.abs(deq - want_deq).max())})")
  same = np.mean(bits(d.x[valid]) == bits(want.x[valid]))
  assert same >= (1.0 if ON_CPU else 0.99), f"FP8 rows: only {same:.4f} of the bytes bitwise"


@pytest.mark.parametrize("shape", SHAPES)
def test_ll_combine_matches_host_oracle(shape):
  e, k, t_ll, t_local, h = shape
  e = experts(e)
  config, mesh = ll_setup(e, k, t_ll, h)
  r = num_ranks()
  gen = rng(200 + e)
  x = rows(gen, (r, t_local, h))
  idx = global_routing(gen, (r,), t_local, k, e)
  idx[:, 1, 1] = idx[:, 1, 0] = np.arange(r) % e  # its row is added once per k naming it
  w = weights(gen, (r, t_local, k))

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    return jax_ep.low_latency_combine(expert(d.x), idx, w, d.handle, config=config)

  out = run(fn, mesh, x, idx, w)
  layout = hr.ll_dispatch(x, idx, config)
  _assert_combine(out, host_expert(layout.x, layout.count), idx, w, layout)


GRAD_SHAPES = [  # (E, K, T_ll, T_local, H)
    (16, 4, 16, 13, 256),
    (64, 8, 32, 32, 7168),
]
# Every routing on the small shape, the random one on the large.
GRAD_CASES = ([(GRAD_SHAPES[0], name) for name in GRAD_ROUTINGS] +
              [(GRAD_SHAPES[1], "random")])


@pytest.mark.parametrize("weights_at", ["combine", "dispatch"])
@pytest.mark.parametrize("shape,routing_name", GRAD_CASES)
def test_ll_gradients_match_host_oracle(shape, routing_name, weights_at):
  """jax.grad of low_latency_dispatch -> expert -> low_latency_combine w.r.t.
  x and topk_weights, the weights given to the combine or to the dispatch
  (the pre-summed combine: the same derivatives, its roundings taken as
  exact, so the same host formulas and tolerances).

  Each rank's loss is sum(f32(out) * cot_r) with its own cotangent (no psum);
  rank s receives d(sum_r loss_r)/d(x_s, w_s), computed on the host from the
  VJP formulas of tests/host_reference.py. Tolerances:
  * grad_x: bitwise. grad_y = bf16(f32(ct) * W) with W the sum of the dyadic
    weights naming the expert (exact in any order; the product is exact:
    8 + 10 significant bits), then bf16(f32(grad_y) * c) (exact product), then
    a float32 sum over the token's distinct experts with weight 1 (an FMA with
    weight 1 rounds like an add), rounded once: the same operations here.
  * grad_w[t, k] = sum_h f32(ct[t, h]) * f32(y row of (t, e_k))[h]: products of
    bf16 numbers (exact in float32) summed in float32 in an unspecified order,
    within hr.f32_sum_bound (gamma_{H-1} * sum |terms|).
  With every token on one rank's experts (gpu_testing.GRAD_ROUTINGS), that
  rank needs no peer's rows in any combine, and XLA may run the three
  combines of the gradient back to back (the forward's result is unused).
  """
  e, k, t_ll, t_local, h = shape
  e = experts(e)
  config, mesh = ll_setup(e, k, t_ll, h)
  r = num_ranks()
  gen = rng(300 + e)
  x = rows(gen, (r, t_local, h))
  idx = grad_routing(routing_name, gen, (r,), t_local, k, e)
  idx[:, 0, 0] = -5  # invalid: no gradient
  # One expert named twice: one row (on the routing's own ranks).
  idx[:, 1, 1] = idx[:, 1, 0] = np.arange(r) % e if routing_name == "random" else idx[:, 1, 0]
  w = dyadic_weights(gen, (r, t_local, k))
  cot = gen.standard_normal((r, t_local, h), dtype=np.float32)

  def fn(x, idx, w, cot):
    def loss(x, w):
      if weights_at == "dispatch":
        d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
        out = jax_ep.low_latency_combine(expert(d.x), idx, None, d.handle, config=config)
      else:
        d = jax_ep.low_latency_dispatch(x, idx, config=config)
        out = jax_ep.low_latency_combine(expert(d.x), idx, w, d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) * cot)
    return jax.grad(loss, argnums=(0, 1))(x, w)

  grad_x, grad_w = run(fn, mesh, x, idx, w, cot)

  layout = hr.ll_dispatch(x, idx, config)
  y = host_expert(layout.x, layout.count)
  vjp = hr.ll_combine_vjp(cot.astype(BF16), y, idx, w, layout)
  c = host_scale(y.shape[1])[:, :, None, None]
  ct_rows = (vjp.grad_y.astype(F32) * c).astype(BF16)
  assert_bitwise(grad_x, mine(hr.ll_dispatch_vjp(ct_rows, idx, layout)), "grad x")
  assert grad_w.dtype == np.float32
  error = np.abs(grad_w.astype(np.float64) - mine(vjp.grad_weights))
  bound = hr.f32_sum_bound(mine(vjp.grad_weights_abs), vjp.terms)
  assert np.all(error <= bound), (float(error.max()), float((error - bound).max()))
  assert np.all(grad_w[mine(idx) < 0] == 0) and np.all(grad_w[mine(idx) >= e] == 0)


def test_ll_1000_calls_with_changing_routing():
  """Sequence numbers and buffer parity over NUM_CALLS back-to-back calls in one
  graph: a new host-generated routing each call (with -1 entries), every
  call's counts and combine output checked against the host oracle."""
  e, k, t, h = experts(32), 4, 32, 256
  config, mesh = ll_setup(e, k, t, h)
  r = num_ranks()
  gen = rng(400)
  x = rows(gen, (r, t, h))
  w = weights(gen, (r, t, k))
  idx = np.moveaxis(global_routing(gen, (NUM_CALLS, r), t, k, e), 0, 1)   # [R, calls, T, K]

  def fn(x, w, idx):
    def step(carry, idx):
      d = jax_ep.low_latency_dispatch(x, idx, config=config)
      out = jax_ep.low_latency_combine(expert(d.x), idx, w, d.handle, config=config)
      return carry, (out, d.count)
    return jax.lax.scan(step, None, idx)[1]

  outs, counts = run(fn, mesh, x, w, idx)
  for call in range(NUM_CALLS):
    layout = hr.ll_dispatch(x, idx[:, call], config)
    assert_bitwise(counts[call], mine(layout.count), f"call {call}: count")
    want = hr.ll_combine(host_expert(layout.x, layout.count), idx[:, call], w, layout)
    assert_within_ulp(outs[call], mine(want), LL_COMBINE_ULPS, f"call {call}: combine")


@pytest.mark.parametrize("use_fp8", [False, True])
def test_ll_split_ops_match_one_call_ops(use_fp8):
  e, k, t, h = experts(32), 8, 64, 512
  config, mesh = ll_setup(e, k, t, h)
  r = num_ranks()
  gen = rng(500)
  x = rows(gen, (r, t, h))
  idx = global_routing(gen, (r,), t, k, e)
  w = weights(gen, (r, t, k))

  def fn(x, idx, w):
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, use_fp8=use_fp8)
    shared = jnp.tanh(x.astype(jnp.float32)) @ jnp.ones((h, h), jnp.float32)  # overlapped work
    d = jax_ep.low_latency_dispatch_recv(pending, config=config)
    y = expert(d.x.astype(jnp.bfloat16))
    sent = jax_ep.low_latency_combine_send(y, d.handle, config=config)
    out = jax_ep.low_latency_combine_recv(sent, idx, w, config=config)
    one = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8)
    ref = jax_ep.low_latency_combine(expert(one.x.astype(jnp.bfloat16)), idx, w, one.handle,
                                     config=config)
    return d.count, d.x, one.count, one.x, out, ref, shared[:1]

  count, x_split, count_one, x_one, out, ref, _ = run(fn, mesh, x, idx, w)
  assert_bitwise(count, mine(hr.ll_dispatch(x, idx, config).count), "count")
  assert_bitwise(count, count_one, "count vs one call")
  valid = valid_rows(count, x_split.shape[1])
  assert_bitwise(x_split[valid], x_one[valid], "rows vs one call")
  assert_bitwise(out, ref, "combine vs one call")
  if not use_fp8:
    layout = hr.ll_dispatch(x, idx, config)
    _assert_combine(out, host_expert(layout.x, layout.count), idx, w, layout)


@pytest.mark.parametrize("use_fp8", [False, True])
def test_ll_dispatch_with_weights_carries_each_rows_weight(use_fp8):
  """topk_weights given to the dispatch: each row's weight (the sum in k order
  of the token's weights naming that expert) arrives with it, bitwise; the rows
  are the same as without weights."""
  e, k, t_ll, h = experts(32), 8, 64, 512
  config, mesh = ll_setup(e, k, t_ll, h)
  gen = rng(9100 + use_fp8)
  r = num_ranks()
  x = rows(gen, (r, t_ll, h))
  idx = global_routing(gen, (r,), t_ll, k, e)
  idx[:, 3, 1] = idx[:, 3, 0] = np.arange(r) % e  # one expert named twice: one row, w summed
  w = weights(gen, (r, t_ll, k))

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8, topk_weights=w)
    plain = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8)
    return d, plain

  d, plain = run(fn, mesh, x, idx, w)
  layout = hr.ll_dispatch(x, idx, config, use_fp8=use_fp8)
  assert_bitwise(d.weights, mine(hr.ll_pair_weights(idx, w, layout)), "weights")
  assert_bitwise(d.handle.row_weights, d.weights, "handle.row_weights")
  assert_bitwise(d.count, plain.count, "count")
  valid = valid_rows(d.count, d.x.shape[1])
  assert_bitwise(d.x[valid], plain.x[valid], "rows")
