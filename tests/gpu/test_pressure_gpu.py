"""Pressure: 10,000 LL and HT calls with random routing, hashed twice (deterministic order)."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from gpu_testing import call_routing, rank, rows, run, setup

NUM_CALLS = 10_000


def _hash(acc, a):
  """Order-sensitive uint32 hash of ``a``'s bits folded into ``acc``."""
  if a.dtype == jnp.bool_:
    a = a.astype(jnp.uint8)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  bits = jax.lax.bitcast_convert_type(a, width).astype(jnp.uint32).reshape(-1)
  position = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2654435761) + 1
  return acc * jnp.uint32(1000003) + jnp.sum(bits * position, dtype=jnp.uint32)


def test_10000_calls_hash_identically_twice():
  """Every call's results (rows, sources, counts, combine) enter a running hash.

  Arrival order differs from call to call and run to run; the contract's
  (source rank, source token) order makes the hashes equal anyway. The hash
  is printed so that two separate runs can be compared too.
  """
  e, k, t, h = 32, 4, 32, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k)
  rng = np.random.default_rng(1100 + rank())
  x = rows(rng, (t, h))
  w = rng.random((t, k), np.float32)

  def fn(x, w):
    def step(i, acc):
      idx = call_routing(11, i, t, k, e, none_fraction=0.15)
      # Uneven token counts per rank, changing every call.
      live = jnp.arange(t)[:, None] < t - (i % 5) * jax.lax.axis_index("ep")
      idx = jnp.where(live, idx, -1)
      d = jax_ep.low_latency_dispatch(x, idx, config=config)
      valid = jnp.arange(d.x.shape[1])[None, :] < d.count[:, None]
      acc = _hash(acc, jnp.where(valid[..., None], d.x, 0))
      acc = _hash(acc, d.handle.recv_src)
      acc = _hash(acc, jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config))
      hd = jax_ep.dispatch(x, idx, w, config=config)
      acc = _hash(acc, hd.x)
      acc = _hash(acc, hd.topk_idx)
      acc = _hash(acc, hd.handle.recv_src)
      acc = _hash(acc, jax_ep.combine(hd.x, hd.handle, config=config))
      return acc
    init = jax.lax.pcast(jnp.uint32(0), "ep", to="varying")
    return jax.lax.fori_loop(0, NUM_CALLS, step, init)

  first = int(run(fn, mesh, x, w))
  second = int(run(fn, mesh, x, w))
  print(f"rank {rank()}: hash of {NUM_CALLS} LL+HT calls = {first:#010x}")
  assert first == second
