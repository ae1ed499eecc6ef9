"""The expert-major HT layout on the kernels against the host oracle (run under jax_ep.launch).

On CUDA the kernels write and read the pair rows: the expert-major dispatch
kernel places each (token, local expert) pair straight into its row (and runs
again, on the forward's routing, for the combine's backward), the expert-major
combine kernel sums a token's pair rows per rank, and the weight gradient takes
the per-slot values kernel and the token-major combine; nothing is announced
(the suite's fallback="error" refuses any portable exchange). Every comparison
is bitwise: the pairs are bytes moved, the combine sums per rank in float32 in
ascending local expert and those partials in rank order, like
tests/host_reference.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference as hr
from gpu_testing import (BF16, F32, GRAD_ROUTINGS, assert_bitwise, dyadic_weights,
                         global_routing, grad_routing, mine, num_ranks, one_rank_routing, rng,
                         rows, run, setup)

SHAPES = [  # (E, K, T, T_local, H, A)
    (16, 4, 64, 48, 256, 1),
    (64, 8, 256, 256, 1024, 8),
    (256, 8, 64, 64, 7168, 128),
    # K = 12: tokens with more than 8 pairs on a rank (N = 1, 2), the combine's
    # groups of 8 one after the other (cuda/ht_pair_sum.cuh), beside tokens with 8 or less.
    (32, 12, 64, 64, 512, 8),
]
FIELDS = ("x", "scales", "topk_idx", "topk_weights", "num_tokens", "tokens_per_expert",
          "group_sizes", "num_dropped", "num_invalid")


def _setup(e, k, t, h):
  return setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
               enable_low_latency=False)


def _experts(e: int) -> int:
  r = num_ranks()
  return -(-max(e, r) // r) * r


# Routings of the dispatch tests beyond gpu_testing.GRAD_ROUTINGS: every rank's
# tokens on its own experts only (no row travels), and no expert at all (every
# entry -1: M rows of padding, empty groups).
OWN_RANK, NO_EXPERT = "all_to_own_rank", "no_expert"


def _routing(routing_name, gen, t_local, k, e):
  r = num_ranks()
  if routing_name == OWN_RANK:
    return np.stack([one_rank_routing(gen, (), t_local, k, e, r, owner) for owner in range(r)])
  if routing_name == NO_EXPERT:
    return np.full((r, t_local, k), -1, np.int32)
  return grad_routing(routing_name, gen, (r,), t_local, k, e)


def _inputs(seed, e, k, t_local, h, routing_name="random"):
  gen = rng(seed)
  r = num_ranks()
  x = rows(gen, (r, t_local, h))
  idx = _routing(routing_name, gen, t_local, k, e)
  idx[:, 1, 0] = -7                                   # invalid: counted, never used
  # One expert named twice: one pair (on the routing's own ranks).
  idx[:, 2, 1] = idx[:, 2, 0] = np.arange(r) % e if routing_name == "random" else idx[:, 2, 0]
  return gen, x, idx, dyadic_weights(gen, (r, t_local, k))


def _assert_dispatch(d, want: hr.ExpertMajorDispatch) -> None:
  for name in FIELDS:
    expected = getattr(want, name)
    if expected is None:
      assert getattr(d, name) is None, name
    else:
      assert_bitwise(getattr(d, name), expected, name)


# Every routing on the first shape, the random one on the others.
CASES = ([(SHAPES[0], name) for name in GRAD_ROUTINGS + (OWN_RANK, NO_EXPERT)] +
         [(shape, "random") for shape in SHAPES[1:]])


@pytest.mark.parametrize("shape,routing_name", CASES)
def test_expert_major_dispatch_and_combine_match_host_oracle(shape, routing_name):
  """Random routing; every token on one rank's experts
  (gpu_testing.GRAD_ROUTINGS: that rank receives every rank's pairs, its own
  included, the others none); every rank's tokens on its own experts (nothing
  travels); no expert at all (only padding rows)."""
  e, k, t, t_local, h, alignment = shape
  e = _experts(e)
  config, mesh = _setup(e, k, t, h)
  gen, x, idx, w = _inputs(800 + e, e, k, t_local, h, routing_name)
  m = hr.expert_major_rows(config, num_ranks(), alignment)
  y = rows(gen, (num_ranks(), m, h))                  # garbage on padding rows too
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment)

  def fn(x, idx, w, y):
    d = jax_ep.dispatch(x, idx, w, **kwargs)
    return d, jax_ep.combine(y, d.handle, config=config)

  d, out = run(fn, mesh, x, idx, w, y)
  layout = hr.ht_dispatch_expert_major(x, idx, w, config, alignment=alignment)
  _assert_dispatch(d, mine(layout))
  assert int(d.num_invalid) == 1
  assert_bitwise(out, mine(hr.ht_combine_expert_major(y, layout)), "combine")


def test_expert_major_float32_rows_and_capacity_drops():
  e, k, t, h, alignment = _experts(32), 8, 64, 512, 16
  config, mesh = _setup(e, k, t, h)
  gen, x, idx, w = _inputs(850, e, k, t, h)
  idx[:, :, 0] = 0                                    # every token to expert 0: rank 0 overflows
  full = hr.ht_dispatch_expert_major(x, idx, w, config, alignment=alignment)
  capacity = max(alignment, int(full.group_sizes[0].sum()) // 2 // alignment * alignment)
  y = rows(gen, (num_ranks(), capacity, h), F32)
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment,
                capacity=capacity)

  def fn(x, idx, w, y):
    d = jax_ep.dispatch(x.astype(jnp.float32), idx, w, **kwargs)
    return d, jax_ep.combine(y, d.handle, config=config)

  d, out = run(fn, mesh, x, idx, w, y)
  layout = hr.ht_dispatch_expert_major(x.astype(F32), idx, w, config, alignment=alignment,
                                       capacity=capacity)
  assert layout.num_dropped[0] > 0
  _assert_dispatch(d, mine(layout))
  assert_bitwise(out, mine(hr.ht_combine_expert_major(y, layout)), "combine")


def test_expert_major_fp8_pairs():
  e, k, t, h = _experts(64), 8, 128, 1024
  config, mesh = _setup(e, k, t, h)
  _, x, idx, w = _inputs(860, e, k, t, h)
  q, s = hr.quantize_fp8(x)
  kwargs = dict(config=config, layout="expert_major", expert_alignment=8)

  d = run(lambda q, s, i, w: jax_ep.dispatch((q, s), i, w, **kwargs), mesh, q, s, idx, w)
  _assert_dispatch(d, mine(hr.ht_dispatch_expert_major((q, s), idx, w, config, alignment=8)))


@pytest.mark.parametrize("routing_name", GRAD_ROUTINGS)
def test_expert_major_gradients_match_host_vjps(routing_name):
  """jax.vjp of both ops on random cotangents, bitwise with the host VJPs, on
  random routing and with every token on one rank's experts."""
  e, k, t, h, alignment = _experts(32), 4, 64, 512, 8
  config, mesh = _setup(e, k, t, h)
  gen, x, idx, w = _inputs(870, e, k, t, h, routing_name)
  m = hr.expert_major_rows(config, num_ranks(), alignment)
  r = num_ranks()
  g = rows(gen, (r, t, h))
  ct_x = rows(gen, (r, m, h))
  ct_w = gen.standard_normal((r, m), dtype=np.float32)
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment)

  def fn(x, i, w, g, ct_x, ct_w):
    d = jax_ep.dispatch(x, i, w, **kwargs)
    _, combine_vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle, config=config), d.x)
    _, dispatch_vjp = jax.vjp(
        lambda x, w: (lambda res: (res.x, res.topk_weights))(jax_ep.dispatch(x, i, w, **kwargs)),
        x, w)
    return combine_vjp(g)[0], dispatch_vjp((ct_x, ct_w))

  grad_y, (grad_x, grad_w) = run(fn, mesh, x, idx, w, g, ct_x, ct_w)
  layout = hr.ht_dispatch_expert_major(x, idx, w, config, alignment=alignment)
  assert_bitwise(grad_y, mine(hr.ht_combine_expert_major_vjp(g, layout)), "combine vjp")
  want_x, want_w = hr.ht_dispatch_expert_major_vjp(ct_x, ct_w, idx, config, layout)
  assert_bitwise(grad_x, mine(want_x), "dispatch vjp x")
  assert_bitwise(grad_w, mine(want_w), "dispatch vjp topk_weights")
  assert grad_x.dtype == BF16


def test_expert_major_60_calls_with_changing_routing():
  """60 back-to-back dispatch+combine calls in one graph, each on another
  routing: random, every entry on one expert, every entry -1, skewed to the
  first experts. At one rank the dispatch's warps take work from counters
  whose words carry the call's sequence number and are never reset
  (cuda/ht_kernels.cu); every call's pairs, counts and combine are checked
  bitwise, so a word of the call before would show."""
  e, k, t, h, alignment = _experts(32), 4, 256, 256, 8
  config, mesh = _setup(e, k, t, h)
  r, num_calls = num_ranks(), 60
  gen = rng(880)
  x = rows(gen, (r, t, h))
  w = dyadic_weights(gen, (r, t, k))
  idx = np.moveaxis(global_routing(gen, (num_calls, r), t, k, e), 0, 1)  # [R, calls, T, K]
  idx[:, 1::4, :, :] = -1
  idx[:, 1::4, :, 0] = 0                               # every token's one pair on expert 0
  idx[:, 2::4] = -1                                    # no pair at all: padding only
  idx[:, 3::4] = np.minimum(idx[:, 3::4], 3)           # skewed to experts 0-3 (repeats: one pair)
  m = hr.expert_major_rows(config, r, alignment)
  y = rows(gen, (r, m, h))
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment)

  names = tuple(name for name in FIELDS if name != "scales")  # bf16 rows: no scales

  def fn(x, w, idx, y):
    def step(carry, idx):
      d = jax_ep.dispatch(x, idx, w, **kwargs)
      out = jax_ep.combine(y, d.handle, config=config)
      return carry, tuple(getattr(d, name) for name in names) + (out,)
    return jax.lax.scan(step, None, idx)[1]

  results = run(fn, mesh, x, w, idx, y)
  for call in range(num_calls):
    layout = hr.ht_dispatch_expert_major(x, idx[:, call], w, config, alignment=alignment)
    want = mine(layout)
    for name, got in zip(names, results):
      assert_bitwise(got[call], getattr(want, name), f"call {call}: {name}")
    assert_bitwise(results[-1][call], mine(hr.ht_combine_expert_major(y, layout)),
                   f"call {call}: combine")
