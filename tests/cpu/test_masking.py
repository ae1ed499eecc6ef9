"""Rank masking (portable backend): survivors match the oracle restricted to live ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import bits, random_routing, random_rows, run_per_shard, setup, valid_rows_mask


@pytest.fixture(autouse=True)
def _no_masks_left_behind():
  yield
  jax_ep.unmask_all()


def _live_only_routing(idx: np.ndarray, masked, num_ranks: int, experts_per_rank: int):
  """The oracle's input: pairs to masked experts and all tokens of masked ranks -> -1."""
  idx = idx.copy()
  owner = np.where(idx >= 0, idx // experts_per_rank, -1)
  idx[np.isin(owner, list(masked))] = -1
  tokens_per_rank = idx.shape[0] // num_ranks
  for rank in masked:
    idx[rank * tokens_per_rank:(rank + 1) * tokens_per_rank] = -1
  return idx


@pytest.mark.parametrize("masked", [(1,), (0, 2)])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_survivors_match_the_oracle_on_live_ranks(masked, use_fp8):
  num_ranks, e, k, t, t_local, h = 4, 16, 4, 6, 5, 256
  rng = np.random.default_rng(7 + len(masked) + 2 * use_fp8)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t_local, h), jnp.bfloat16)
  idx = np.concatenate([random_routing(rng, t_local, k, e, skew=1.0) for _ in range(num_ranks)])
  idx[3, 0] = 99  # an invalid entry is still counted, masked or not
  w = rng.random((num_ranks * t_local, k), np.float32)
  live_idx = _live_only_routing(idx, masked, num_ranks, e // num_ranks)
  for rank in masked:
    jax_ep.mask_rank(rank)
  assert jax_ep.masked_ranks() == tuple(sorted(masked))

  def expert(rows):
    rank = jax.lax.axis_index("ep").astype(jnp.float32)
    return (rows.astype(jnp.float32) * 1.5 - rank).astype(rows.dtype)

  def fn(x, idx, live_idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8)
    rows = jax_ep.fp8.dequantize(d.x, d.scales).astype(jnp.bfloat16) if use_fp8 else d.x
    out = jax_ep.low_latency_combine(expert(rows), idx, w, d.handle, config=config)
    ref = jax_ep.reference.low_latency_dispatch(x, live_idx, config=config, use_fp8=use_fp8)
    ref_rows = (jax_ep.fp8.dequantize(ref["x"], ref["scales"]).astype(jnp.bfloat16) if use_fp8
                else ref["x"])
    ref_out = jax_ep.reference.low_latency_combine(expert(ref_rows), live_idx, w, config=config)
    return d, out, ref, ref_out

  d, out, ref, ref_out = run_per_shard(fn, mesh, x, idx, live_idx, w)
  live = [r for r in range(num_ranks) if r not in masked]
  assert np.all(d.num_invalid[3 // t_local] == 1)
  np.testing.assert_array_equal(d.count[live], ref["count"][live])
  np.testing.assert_array_equal(d.handle.recv_src[live], ref["recv_src"][live])
  valid = valid_rows_mask(d.count[live], num_ranks * t)
  np.testing.assert_array_equal(bits(d.x[live])[valid], bits(ref["x"][live])[valid])
  # Nothing from a masked source arrived anywhere that is alive.
  sources = np.where(d.handle.recv_src[live] >= 0, d.handle.recv_src[live] // t_local, -1)
  assert not np.isin(sources, list(masked)).any()
  np.testing.assert_allclose(out[live].astype(np.float32), ref_out[live].astype(np.float32),
                             rtol=2e-2, atol=2e-2)


def test_split_ops_and_gradients_follow_the_mask():
  num_ranks, e, k, t, h = 4, 8, 3, 4, 128
  rng = np.random.default_rng(11)
  config, mesh = setup(num_ranks, num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  x = random_rows(rng, (num_ranks * t, h), jnp.float32)
  idx = np.concatenate([random_routing(rng, t, k, e) for _ in range(num_ranks)])
  w = rng.random((num_ranks * t, k), np.float32)
  live_idx = _live_only_routing(idx, (2,), num_ranks, e // num_ranks)

  def loss_and_grads(idx):
    def loss(x, w):
      d = jax_ep.low_latency_dispatch(x, idx, config=config)
      return jnp.sum(jax_ep.low_latency_combine(jnp.sin(d.x), idx, w, d.handle,
                                                config=config) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))

  def split(x, idx, w):  # not differentiable, but must follow the mask too
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config)
    d = jax_ep.low_latency_dispatch_recv(pending, config=config)
    sent = jax_ep.low_latency_combine_send(jnp.sin(d.x), d.handle, config=config)
    return jax_ep.low_latency_combine_recv(sent, idx, w, config=config)

  # Unmasked on the live-only routing: what the survivors must reproduce.
  expected = run_per_shard(lambda x, i, w: (loss_and_grads(i)(x, w), split(x, i, w)), mesh, x,
                           live_idx, w)
  jax_ep.mask_rank(2)
  got = run_per_shard(lambda x, i, w: (loss_and_grads(i)(x, w), split(x, i, w)), mesh, x, idx,
                      w)
  live = [0, 1, 3]
  (value, grads), out = got
  (ref_value, ref_grads), ref_out = expected
  np.testing.assert_allclose(value[live], ref_value[live], rtol=1e-5)
  for g, ref in zip(grads, ref_grads):
    np.testing.assert_allclose(g[live], ref[live], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out[live], ref_out[live], rtol=1e-5, atol=1e-6)


def test_a_new_mask_retraces_jitted_functions():
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=2)
  x = random_rows(np.random.default_rng(0), (4, 128), jnp.bfloat16)
  idx = np.array([[0, 3], [1, 2], [2, 3], [0, -1]], np.int32)
  # One jitted function, traced once before the mask: the mask must still apply.
  counts = jax.jit(jax.shard_map(
      lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count[None], mesh=mesh,
      in_specs=jax.P("ep"), out_specs=jax.P("ep")))
  place = lambda a: jax.device_put(a, jax.NamedSharding(mesh, jax.P("ep")))  # noqa: E731
  np.testing.assert_array_equal(counts(place(x), place(idx)), [[2, 1], [2, 2]])
  jax_ep.mask_rank(1)
  # Rank 0 no longer sends to experts 2, 3 and no longer receives from rank 1.
  np.testing.assert_array_equal(np.asarray(counts(place(x), place(idx)))[0], [1, 1])
  jax_ep.unmask_all()
  np.testing.assert_array_equal(counts(place(x), place(idx)), [[2, 1], [2, 2]])


def test_mask_api_errors():
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=2)
  with pytest.raises(jax_ep.EpConfigError, match="not an EP rank"):
    jax_ep.mask_rank(2)
  with pytest.raises(jax_ep.EpConfigError, match="must be an int"):
    jax_ep.mask_rank(True)
  jax_ep.mask_rank(1)
  jax_ep.mask_rank(1)
  assert jax_ep.masked_ranks() == (1,)
  x = np.zeros((4, 128), jnp.bfloat16)
  idx = np.zeros((4, 2), np.int32)
  w = np.ones((4, 2), np.float32)
  with pytest.raises(jax_ep.EpError, match="low-latency ops only"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh, x, idx, w)
  jax_ep.finalize()
  assert jax_ep.masked_ranks() == ()
  with pytest.raises(jax_ep.EpError, match="initialize"):
    jax_ep.mask_rank(0)


def test_ht_ops_refuse_a_rank_masked_by_a_kernel(monkeypatch):
  """On CUDA, mask_on_timeout masks a rank in device memory, not through
  mask_rank; the HT ops must refuse that too (simulated here: the kernels'
  mask is what the runtime state's merged view, masked_ranks(), reads on CUDA)."""
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  config, mesh = setup(2, num_experts=4, hidden=128, max_tokens_per_rank=2, num_topk=2)
  monkeypatch.setattr(runtime.RuntimeState, "masked_ranks", lambda self: (1,))
  x = np.zeros((4, 128), jnp.bfloat16)
  idx = np.zeros((4, 2), np.int32)
  w = np.ones((4, 2), np.float32)
  with pytest.raises(jax_ep.EpError, match=r"ranks \(1,\) are masked"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh, x, idx, w)
