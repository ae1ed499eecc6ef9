"""The expert-major HT layout (layout="expert_major") against the oracle."""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from ep_testing import (bits, check_grads_of_layer, exact_grad_problem, global_fn, local_steps,
                        place, random_rows, ranks_routing, run_per_shard, setup,
                        weight_and_row_grads)

# (R, E, K, T, T_local, H, A)
SHAPES = [
    (1, 4, 2, 8, 8, 32, 1),
    (2, 8, 2, 8, 5, 32, 4),
    (4, 16, 4, 12, 12, 64, 8),
    (4, 8, 3, 16, 9, 16, 1),
    (8, 32, 8, 6, 6, 128, 16),
    (8, 16, 1, 4, 3, 8, 3),
]


def _routing(rng, num_ranks, t_local, k, e, repeats: bool = True, **kwargs):
  idx = ranks_routing(rng, num_ranks, t_local, k, e, **kwargs)
  if repeats and k > 1:  # a few tokens choose one expert twice (one pair, weights summed)
    twice = rng.random(idx.shape[0]) < 0.15
    idx[twice, 1] = idx[twice, 0]
  return idx


def _both(config, mesh, x, idx, w, alignment, capacity=None):
  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major",
                        expert_alignment=alignment, capacity=capacity)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config, layout="expert_major",
                                    expert_alignment=alignment, capacity=capacity)
    return d, ref

  return run_per_shard(fn, mesh, x, idx, w)


def _assert_dispatch_matches(d, ref):
  for name in ("num_tokens", "num_dropped", "num_invalid", "tokens_per_expert", "group_sizes",
               "topk_idx"):
    np.testing.assert_array_equal(getattr(d, name), ref[name], err_msg=name)
  np.testing.assert_array_equal(bits(d.topk_weights), bits(ref["topk_weights"]))
  np.testing.assert_array_equal(bits(d.x), bits(ref["x"]))  # bit for bit, padding included
  if ref["scales"] is not None:
    np.testing.assert_array_equal(bits(d.scales), bits(ref["scales"]))


def _worst_rows(num_ranks, e, k, t, alignment):
  e_local = e // num_ranks
  rows = num_ranks * t * min(k, e_local) + e_local * (alignment - 1)
  return -(-rows // alignment) * alignment


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dispatch_matches_oracle(shape, dtype):
  num_ranks, e, k, t, t_local, h, alignment = shape
  rng = np.random.default_rng(hash(shape) % 2**32)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=2.0)
  idx[0, 0] = e + 3  # invalid: counted, treated as -1
  w = rng.random((num_ranks * t_local, k), np.float32)
  d, ref = _both(config, mesh, x, idx, w, alignment)
  _assert_dispatch_matches(d, ref)
  rows = _worst_rows(num_ranks, e, k, t, alignment)
  assert d.x.shape == (num_ranks, rows, h) and d.topk_idx.shape == (num_ranks, rows)
  assert d.num_invalid[0] == 1
  e_local = e // num_ranks
  for r in range(num_ranks):
    sizes = d.group_sizes[r]
    assert np.all(sizes % alignment == 0) and sizes.sum() <= rows
    np.testing.assert_array_equal(sizes, -(-d.tokens_per_expert[r] // alignment) * alignment)
    starts = np.cumsum(sizes) - sizes
    for le in range(e_local):  # group le: its pairs first, then zero padding
      group = slice(starts[le], starts[le] + sizes[le])
      count = d.tokens_per_expert[r][le]
      assert np.all(d.topk_idx[r][group][:count] == le)
      assert np.all(d.topk_idx[r][group][count:] == -1)
      assert not np.any(d.x[r][group][count:].astype(np.float32))
    past = slice(sizes.sum(), rows)
    assert np.all(d.topk_idx[r][past] == -1) and not np.any(d.topk_weights[r][past])


def test_pairs_are_the_token_major_rows_grouped_by_expert():
  """What users build by hand today: each (row, local expert) pair of the
  token-major dispatch, sorted stably by expert, is the expert-major result."""
  rng = np.random.default_rng(3)
  num_ranks, e, k, t, h = 4, 16, 4, 8, 32
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.float32)
  idx = _routing(rng, num_ranks, t, k, e, repeats=False, skew=1.0)
  w = rng.random((num_ranks * t, k), np.float32)

  def fn(x, idx, w):
    return (jax_ep.dispatch(x, idx, w, config=config),
            jax_ep.dispatch(x, idx, w, config=config, layout="expert_major"))

  tm, em = run_per_shard(fn, mesh, x, idx, w)
  for r in range(num_ranks):
    rows, experts, weights = [], [], []
    for i in range(int(tm.num_tokens[r])):
      for kk in range(k):
        if tm.topk_idx[r][i, kk] >= 0:
          rows.append(i)
          experts.append(tm.topk_idx[r][i, kk])
          weights.append(tm.topk_weights[r][i, kk])
    order = np.argsort(experts, kind="stable")
    n = len(order)
    assert em.num_tokens[r] == n
    np.testing.assert_array_equal(em.x[r][:n], tm.x[r][np.asarray(rows)[order]])
    np.testing.assert_array_equal(em.topk_idx[r][:n], np.asarray(experts)[order])
    np.testing.assert_array_equal(em.topk_weights[r][:n], np.asarray(weights)[order])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_combine_matches_oracle_bitwise(shape, dtype):
  """Random pair rows (not derived from x), garbage on padding rows: the same
  fp32 sums in the same order as the oracle."""
  num_ranks, e, k, t, t_local, h, alignment = shape
  rng = np.random.default_rng(hash(shape) % 2**31 + 1)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), dtype)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=1.0)
  w = rng.random((num_ranks * t_local, k), np.float32)
  rows = _worst_rows(num_ranks, e, k, t, alignment)
  y = random_rows(rng, (num_ranks * rows, h), dtype)

  def fn(x, idx, w, y):
    d = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major",
                        expert_alignment=alignment)
    return (jax_ep.combine(y, d.handle, config=config),
            jax_ep.reference.combine(y, idx, config=config, layout="expert_major",
                                     expert_alignment=alignment))

  out, ref = run_per_shard(fn, mesh, x, idx, w, y)
  assert out.dtype == np.dtype(dtype) and out.shape == (num_ranks, t_local, h)
  np.testing.assert_array_equal(bits(out), bits(ref))


@pytest.mark.parametrize("capacity_fraction", [0.1, 0.5, 0.9])
def test_capacity_drops_the_last_pairs_and_counts_them(capacity_fraction):
  """capacity= a fraction of the busiest rank's rows: that rank drops pairs."""
  rng = np.random.default_rng(int(capacity_fraction * 100))
  num_ranks, e, k, t, h, alignment = 4, 16, 4, 8, 16, 4
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.float32)
  idx = _routing(rng, num_ranks, t, k, e, none_fraction=0.0, skew=3.0)
  w = rng.random((num_ranks * t, k), np.float32)
  full, _ = _both(config, mesh, x, idx, w, alignment)
  busiest = int(full.group_sizes.sum(axis=1).max())
  capacity = max(alignment, int(busiest * capacity_fraction) // alignment * alignment)
  d, ref = _both(config, mesh, x, idx, w, alignment, capacity=capacity)
  _assert_dispatch_matches(d, ref)
  assert d.x.shape == (num_ranks, capacity, h)
  np.testing.assert_array_equal(d.num_tokens + d.num_dropped, full.num_tokens)
  assert np.any(d.num_dropped)
  for r in range(num_ranks):
    assert d.group_sizes[r].sum() <= capacity
    assert np.all(d.tokens_per_expert[r] <= full.tokens_per_expert[r])
  y = random_rows(rng, (num_ranks * capacity, h), jnp.float32)

  def fn(x, idx, w, y):  # the combine skips dropped pairs
    dd = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major",
                         expert_alignment=alignment, capacity=capacity)
    return (jax_ep.combine(y, dd.handle, config=config),
            jax_ep.reference.combine(y, idx, config=config, layout="expert_major",
                                     expert_alignment=alignment, capacity=capacity))

  out, ref_out = run_per_shard(fn, mesh, x, idx, w, y)
  np.testing.assert_array_equal(bits(out), bits(ref_out))


def test_ragged_dot_takes_the_groups_as_they_are():
  """jax.lax.ragged_dot(d.x, w, d.group_sizes): each pair row times its expert's
  matrix, padding rows zero. Small integers: every product sum is exact."""
  rng = np.random.default_rng(8)
  num_ranks, e, k, t, h, f, alignment = 4, 16, 3, 8, 16, 8, 8
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  e_local = e // num_ranks
  x = rng.integers(-4, 5, (num_ranks * t, h)).astype(np.float32)
  idx = _routing(rng, num_ranks, t, k, e, skew=1.0)
  w = rng.random((num_ranks * t, k), np.float32)
  mats = rng.integers(-3, 4, (num_ranks * e_local, h, f)).astype(np.float32)

  def fn(x, idx, w, mats):
    d = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major",
                        expert_alignment=alignment)
    return d, jax.lax.ragged_dot(d.x, mats, d.group_sizes)

  d, out = run_per_shard(fn, mesh, x, idx, w, mats)
  mats = mats.reshape(num_ranks, e_local, h, f)
  for r in range(num_ranks):
    pair = d.topk_idx[r] >= 0
    expected = np.zeros(out[r].shape, np.float32)
    expected[pair] = np.einsum("mh,mhf->mf", d.x[r][pair], mats[r][d.topk_idx[r][pair]])
    np.testing.assert_array_equal(out[r], expected)


@pytest.mark.parametrize("scale_dtype", [jnp.float32, jnp.float8_e8m0fnu])
def test_fp8_pairs_move_rows_and_scales(scale_dtype):
  rng = np.random.default_rng(11)
  num_ranks, e, k, t, h = 4, 16, 4, 8, 256
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t, k, e)
  w = rng.random((num_ranks * t, k), np.float32)

  def fn(x, idx, w):
    pair = jax_ep.fp8.quantize(x, round_scale=scale_dtype != jnp.float32, scale_dtype=scale_dtype)
    return (jax_ep.dispatch(pair, idx, w, config=config, layout="expert_major",
                            expert_alignment=8),
            jax_ep.reference.dispatch(pair, idx, w, config=config, layout="expert_major",
                                      expert_alignment=8))

  d, ref = run_per_shard(fn, mesh, x, idx, w)
  assert d.x.dtype == jnp.float8_e4m3fn and d.scales.dtype == np.dtype(scale_dtype)
  _assert_dispatch_matches(d, ref)


def test_no_tokens_and_ranks_whose_tokens_go_nowhere():
  """T_local = 0 (made inside the body, see test_empty_ranks): static shapes,
  nothing received, [0, H] back. Ranks 0 and 2 routing every token to -1:
  the others' results still match the oracle."""
  num_ranks, e, k, t, h = 4, 8, 2, 4, 16
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  rng = np.random.default_rng(4)
  x = random_rows(rng, (num_ranks * t, h), jnp.float32)
  idx = _routing(rng, num_ranks, t, k, e).reshape(num_ranks, t, k)
  idx[[0, 2]] = -1
  idx = idx.reshape(-1, k)
  w = rng.random((num_ranks * t, k), np.float32)

  def empty(x, idx, w):
    d = jax_ep.dispatch(x[:0], idx[:0], w[:0], config=config, layout="expert_major",
                        expert_alignment=2)
    return d, jax_ep.combine(d.x, d.handle, config=config)

  d, out = run_per_shard(empty, mesh, x, idx, w)
  rows = _worst_rows(num_ranks, e, k, t, 2)
  assert d.x.shape == (num_ranks, rows, h) and out.shape == (num_ranks, 0, h)
  assert not np.any(d.num_tokens) and not np.any(d.group_sizes)
  assert np.all(d.topk_idx == -1)
  d, ref = _both(config, mesh, x, idx, w, 2)
  _assert_dispatch_matches(d, ref)
  assert np.all(d.num_tokens > 0)


@pytest.mark.parametrize("steps", ["ffi", "jnp"])
def test_cpu_handlers_and_their_jnp_twins_agree_with_the_oracle(steps):
  """The jnp twins are the local steps of GPUs without the kernels and of TPUs."""
  num_ranks, e, k, t, t_local, h, alignment = SHAPES[2]
  rng = np.random.default_rng(12)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), jnp.bfloat16)
  idx = _routing(rng, num_ranks, t_local, k, e, skew=1.0)
  w = rng.random((num_ranks * t_local, k), np.float32)
  y = random_rows(rng, (num_ranks * _worst_rows(num_ranks, e, k, t, alignment), h), jnp.bfloat16)
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment)

  def fn(x, idx, w, y):
    d = jax_ep.dispatch(x, idx, w, **kwargs)
    return (d, jax_ep.reference.dispatch(x, idx, w, **kwargs),
            jax_ep.combine(y, d.handle, config=config),
            jax_ep.reference.combine(y, idx, **kwargs))

  with local_steps(steps):
    d, ref, out, ref_out = run_per_shard(fn, mesh, x, idx, w, y)
  _assert_dispatch_matches(d, ref)
  np.testing.assert_array_equal(bits(out), bits(ref_out))


# ---------------------------------------------------------------- gradients
def _layer(x, idx, w, config, alignment, impl, nonlinear):
  """dispatch -> per-pair expert (scaled by the pair weight) -> combine."""
  kwargs = dict(config=config, layout="expert_major", expert_alignment=alignment)
  if impl == "ours":
    d = jax_ep.dispatch(x, idx, w, **kwargs)
    rows, weights = d.x, d.topk_weights
  else:
    ref = jax_ep.reference.dispatch(x, idx, w, **kwargs)
    rows, weights = ref["x"], ref["topk_weights"]
  expert = jnp.tanh(rows) if nonlinear else rows * 3
  y = expert * weights[:, None]
  if impl == "ours":
    return jax_ep.combine(y, d.handle, config=config)
  return jax_ep.reference.combine(y, idx, **kwargs)


def _grads(impl, config, mesh, x, idx, w, cot, alignment, nonlinear):
  per_shard = lambda x, i, w: _layer(x, i, w, config, alignment, impl, nonlinear)  # noqa: E731
  f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  loss = lambda x, w: jnp.sum(f(x, idx, w) * cot)  # noqa: E731
  with jax.set_mesh(mesh):
    return jax.grad(loss, argnums=(0, 1))(x, w)


@pytest.mark.parametrize("num_ranks,alignment", [(2, 1), (4, 4), (8, 2)])
def test_gradients_match_the_oracle_bitwise_on_exact_sums(num_ranks, alignment):
  """Dyadic inputs (small integers / 4, weights k/8, integer cotangents): every
  sum in the forward and backward passes is exact, so both must agree bit for bit."""
  rng = np.random.default_rng(num_ranks)
  e, k, t, h = 4 * num_ranks, 3, 6, 16
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x, idx, w, cot = place(mesh, *exact_grad_problem(
      rng, num_ranks * t, h, k, lambda: _routing(rng, num_ranks, t, k, e)))
  ours = _grads("ours", config, mesh, x, idx, w, cot, alignment, nonlinear=False)
  ref = _grads("ref", config, mesh, x, idx, w, cot, alignment, nonlinear=False)
  for a, b in zip(ours, ref):
    np.testing.assert_array_equal(bits(a), bits(b))
  # Entries choosing no expert get no weight gradient; the others do.
  chosen = np.asarray(idx) >= 0
  assert not np.any(np.asarray(ours[1])[~chosen]) and np.any(np.asarray(ours[1])[chosen])


def test_gradients_check_numerically():
  rng = np.random.default_rng(1)
  config, mesh = setup(2, num_experts=4, hidden=8, max_tokens_per_rank=3, num_topk=2)
  x = random_rows(rng, (6, 8), jnp.float32) * 0.5
  idx = _routing(rng, 2, 3, 2, 4)
  w = rng.random((6, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)
  f = global_fn(lambda x, i, w: _layer(x, i, w, config, 2, "ours", True), mesh)
  check_grads_of_layer(f, mesh, x, idx, w, atol=2e-2, rtol=2e-2, eps=1e-2)


def test_gradients_of_weights_alone_and_rows_alone():
  rng = np.random.default_rng(0)
  config, mesh = setup(4, num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)
  x = random_rows(rng, (16, 16), jnp.float32)
  idx = _routing(rng, 4, 4, 2, 8)
  w = rng.random((16, 2), np.float32)
  x, idx, w = place(mesh, x, idx, w)
  grads = weight_and_row_grads(mesh, x, idx, w, config=config, layout="expert_major",
                               expert_alignment=4)
  for a, b in zip(grads["ours"], grads["ref"]):
    # Per element: a sum over at most K pairs of 2*v*1 terms, rounded once per add.
    bound = 2 * config.num_topk * np.finfo(np.float32).eps * np.abs(np.asarray(b))
    assert np.all(np.abs(np.asarray(a) - np.asarray(b)) <= bound)


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("kwargs,message", [
    (dict(layout="sorted"), "layout must be one of"),
    (dict(expert_alignment=4), "applies to layout='expert_major'"),
    (dict(layout="expert_major", expert_alignment=0), "expert_alignment must be an int >= 1"),
    (dict(layout="expert_major", expert_alignment=4, capacity=6), "multiple of expert_alignment"),
    (dict(layout="expert_major", capacity=10**6), "pair rows M"),
])
def test_bad_layout_arguments_fail_at_trace_time(kwargs, message):
  config, mesh = setup(2, num_experts=4, hidden=8, max_tokens_per_rank=4, num_topk=2)

  def fn(x, idx, w):
    return jax_ep.dispatch(x, idx, w, config=config, **kwargs).x

  with pytest.raises(jax_ep.EpConfigError, match=message):
    run_per_shard(fn, mesh, np.zeros((8, 8), np.float32), np.zeros((8, 2), np.int32),
                  np.zeros((8, 2), np.float32))


def test_combine_checks_rows_against_the_handle():
  config, mesh = setup(2, num_experts=4, hidden=8, max_tokens_per_rank=4, num_topk=2)

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major")
    return jax_ep.combine(x, d.handle, config=config)  # token rows, not pair rows

  with pytest.raises(jax_ep.EpConfigError, match=r"y must be \[16, 8\]"):
    run_per_shard(fn, mesh, np.zeros((8, 8), np.float32), np.zeros((8, 2), np.int32),
                  np.zeros((8, 2), np.float32))


def test_combine_of_the_pair_rows_counts_each_tokens_pairs():
  """combine(d.x) = (distinct valid experts of t) * x[t]: exact for small integers."""
  rng = np.random.default_rng(2)
  num_ranks, e, k, t, h = 4, 8, 3, 4, 16
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = rng.integers(-8, 9, (num_ranks * t, h)).astype(np.float32)
  idx = _routing(rng, num_ranks, t, k, e)
  w = rng.random((num_ranks * t, k), np.float32)

  def fn(x, i, w):
    d = jax_ep.dispatch(x.astype(jnp.bfloat16), i, w, config=config, layout="expert_major",
                        expert_alignment=2)
    return jax_ep.combine(d.x, d.handle, config=config)

  out = run_per_shard(fn, mesh, x, idx, w, check_vma=True)
  distinct = np.array([len({v for v in row if v >= 0}) for row in idx])
  np.testing.assert_array_equal(out.reshape(-1, h).astype(np.float32), distinct[:, None] * x)
