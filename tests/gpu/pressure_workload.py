"""The pressure test's workload: NUM_CALLS LL and HT calls, hashed.

Defined once for its two users: tests/gpu/test_pressure_gpu.py runs it on the
device (jnp, one graph) and tests/cpu/test_pressure_golden.py recomputes its
hashes from the host oracle (numpy), so that the golden hashes are the
contract's, not one backend's.

Each call, on every rank: a low_latency_dispatch of the rank's fixed rows
with a new routing, a low_latency_combine of the received rows, a dispatch
and a combine of the received rows. Routing changes every call (distinct
experts, 15% -1 entries, fewer live tokens on higher ranks in a 5-call
cycle). Every hashed value is a function of the contract's bits alone: rows
move unchanged, padding is zero bytes, and both combines sum values whose
every partial sum is exact in float32 (bf16 rows times dyadic weights or copy
counts), so no summation order or fused multiply-add can change them.
Inputs come from gpu_testing's counter-based generator (the same bits on
every machine).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
import host_reference as hr
from gpu_testing import (hash_fold, hash_fold_host_each, stable_dyadic_weights, stable_routing,
                         stable_rows)

NUM_CALLS = 10_000
EXPERTS, TOPK, TOKENS, HIDDEN = 32, 4, 32, 256
SEED = 1100


def config_kwargs(num_ranks: int) -> dict:
  return dict(num_experts=-(-max(EXPERTS, num_ranks) // num_ranks) * num_ranks, hidden=HIDDEN,
              max_tokens_per_rank=TOKENS, num_topk=TOPK)


def inputs(rank: int, num_ranks: int, num_calls: int = NUM_CALLS):
  """Rank ``rank``'s (x bf16[T, H], w float32[T, K], idx int32[calls, T, K])."""
  num_experts = config_kwargs(num_ranks)["num_experts"]
  seed = SEED + 101 * rank
  x = stable_rows(seed, (TOKENS, HIDDEN))
  w = stable_dyadic_weights(seed + 2, (TOKENS, TOPK))
  idx = stable_routing(seed + 3, (num_calls,), TOKENS, TOPK, num_experts, none_fraction=0.15)
  live = TOKENS - (np.arange(num_calls) % 5) * rank
  idx[np.arange(TOKENS)[None, :] >= live[:, None]] = -1
  return x, w, idx


def device_hash(x, w, idx, config: jax_ep.EpConfig):
  """Inside shard_map: the uint32 hash of every call's results, in call order."""
  def step(acc, call_idx):
    d = jax_ep.low_latency_dispatch(x, call_idx, config=config)
    valid = jnp.arange(d.x.shape[1])[None, :] < d.count[:, None]
    acc = hash_fold(acc, jnp.where(valid[..., None], d.x, 0))
    acc = hash_fold(acc, d.handle.recv_src)
    acc = hash_fold(acc, jax_ep.low_latency_combine(d.x, call_idx, w, d.handle, config=config))
    hd = jax_ep.dispatch(x, call_idx, w, config=config)
    acc = hash_fold(acc, hd.x)
    acc = hash_fold(acc, hd.topk_idx)
    acc = hash_fold(acc, hd.handle.recv_src)
    acc = hash_fold(acc, jax_ep.combine(hd.x, hd.handle, config=config))
    return acc, None

  init = jax.lax.pcast(jnp.uint32(0), config.axis_name, to="varying")
  return jax.lax.scan(step, init, idx)[0]


def host_hashes(num_ranks: int, num_calls: int = NUM_CALLS) -> list[int]:
  """Every rank's device_hash, from tests/host_reference.py."""
  config = jax_ep.EpConfig(**config_kwargs(num_ranks))
  per_rank = [inputs(r, num_ranks, num_calls) for r in range(num_ranks)]
  x = np.stack([p[0] for p in per_rank])
  w = np.stack([p[1] for p in per_rank])
  idx = np.stack([p[2] for p in per_rank])
  acc = [0] * num_ranks
  for call in range(num_calls):
    ll = hr.ll_dispatch(x, idx[:, call], config)
    ll_out = hr.ll_combine(ll.x, idx[:, call], w, ll)
    ht = hr.ht_dispatch(x, idx[:, call], w, config)
    ht_out = hr.ht_combine(ht.x, ht)
    for value in (ll.x, ll.recv_src, ll_out, ht.x, ht.topk_idx, ht.recv_src, ht_out):
      acc = hash_fold_host_each(acc, value)
  return acc
