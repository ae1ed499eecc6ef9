"""Rank masking on the CUDA kernels: the survivor keeps serving without the lost rank.

Rank 1 stops making calls (a lost rank); rank 0 masks it, by hand or on a
timeout (mask_on_timeout), and its LL dispatch/combine results must equal what
rank 0 alone computes (its own tokens, its own experts; computed here with
numpy, since the oracle needs every rank). One test per launcher run.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from gpu_testing import global_array, rank, routing, rows, setup
from test_faults_gpu import MARGIN_S, TIMEOUT_S, _barrier

E, K, T, H = 16, 4, 16, 256


def _survivor_call(config, mesh):
  """One executable: LL dispatch, a per-expert scale, LL combine."""

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    scale = (1.0 + jnp.arange(d.x.shape[0], dtype=jnp.float32))[:, None, None]
    y = (d.x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    out = jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)
    return d.count[None], d.handle.recv_src[None], out[None]

  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  return lambda *a: [np.asarray(o.addressable_shards[0].data)[0]
                     for o in mapped(*[global_array(mesh, v) for v in a])]


def _expected_rank0_alone(x, idx, w):
  """Rank 0 alone: its tokens to its own experts (0 .. E/2-1), scaled by 1 + local expert."""
  experts_per_rank = E // 2
  count = np.zeros(experts_per_rank, np.int32)
  out = np.zeros((T, H), np.float32)
  xf = np.asarray(x, np.float32)
  for t in range(T):
    seen = set()
    for k in range(K):
      e = int(idx[t, k])
      if 0 <= e < experts_per_rank:
        if e not in seen:
          count[e] += 1
          seen.add(e)
        row = np.asarray(jnp.asarray(xf[t] * (1.0 + e), jnp.bfloat16), np.float32)
        out[t] += w[t, k] * row
  return count, out


def _run(mask_on_timeout: bool):
  config, mesh = setup(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                       timeout_s=TIMEOUT_S, enable_high_throughput=False,
                       mask_on_timeout=mask_on_timeout)
  rng = np.random.default_rng(1600 + rank())
  x, idx = rows(rng, (T, H)), routing(rng, T, K, E, none_fraction=0.1)
  w = rng.random((T, K), np.float32)
  call = _survivor_call(config, mesh)
  call(x, idx, w)
  call(x, idx, w)
  _barrier("warm")
  if rank() == 1:
    time.sleep(2 * TIMEOUT_S + 2 * MARGIN_S)  # lost: makes no more calls
  else:
    if not mask_on_timeout:
      jax_ep.mask_rank(1)
    start = time.perf_counter()
    count, recv_src, out = call(x, idx, w)
    first = time.perf_counter() - start
    print(f"first call without rank 1: {first:.2f} s; masked {jax_ep.masked_ranks()}")
    assert jax_ep.masked_ranks() == (1,)
    assert jax_ep.status()["ok"], jax_ep.status()
    start = time.perf_counter()
    for _ in range(20):
      count, recv_src, out = call(x, idx, w)
    print(f"then {1e3 * (time.perf_counter() - start) / 20:.2f} ms per call")
    expected_count, expected_out = _expected_rank0_alone(x, idx, w)
    np.testing.assert_array_equal(count, expected_count)
    assert np.all((recv_src < 0) | (recv_src < T))  # nothing from rank 1
    np.testing.assert_allclose(out.astype(np.float32), expected_out, rtol=2e-2, atol=2e-2)
  _barrier("after")
  jax_ep.finalize()


def test_masked_rank_is_skipped():
  _run(mask_on_timeout=False)


def test_mask_on_timeout():
  _run(mask_on_timeout=True)
