"""Several EpConfigs in one process on the kernels (jax_ep.initialize((a, b), mesh)):
each call runs with its own config's dims on buffers sized for the largest of
each, alternating configs in one program and across programs; bitwise against
the host oracle. And an executable whose config the buffers no longer serve
fails in its handler, before any kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
import host_reference as hr
from gpu_testing import (BF16, F32, SHARED_GPU_TIMEOUT_S, TIMEOUT_S, assert_bitwise,
                         dyadic_weights, ep_mesh, global_routing, gpus_shared, kernels_only, mine,
                         num_ranks, rng, rows, run)


def _configs():
  r = num_ranks()
  group = jax_ep.EpGroup(timeout_s=SHARED_GPU_TIMEOUT_S if gpus_shared() else TIMEOUT_S)
  common = dict(fallback="error", group=group)  # one EP group, two layers' sizes
  # Every size differs, neither is the larger in all of them (the buffers are
  # sized for E, T and T_ll of the first, H and K of the second). The second's
  # E is still >= its K at one rank.
  a = jax_ep.EpConfig(num_experts=16 * r, hidden=256, max_tokens_per_rank=64, num_topk=4,
                      low_latency_max_tokens_per_rank=32, **common)
  b = jax_ep.EpConfig(num_experts=8 * r, hidden=1024, max_tokens_per_rank=16, num_topk=8,
                      low_latency_max_tokens_per_rank=8, **common)
  return a, b


def _inputs(config, seed):
  r, t = num_ranks(), config.ll_max_tokens
  gen = rng(seed)
  return (rows(gen, (r, t, config.hidden)),
          global_routing(gen, (r,), t, config.num_topk, config.num_experts),
          dyadic_weights(gen, (r, t, config.num_topk)))


def _expert(y):  # exact in float32, one rounding: _host_expert is its twin
  return (y.astype(jnp.float32) * 1.5).astype(jnp.bfloat16)


def _host_expert(y: np.ndarray) -> np.ndarray:
  return (y.astype(F32) * F32(1.5)).astype(BF16)


def _round_trips(config):
  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    return (d, jax_ep.combine(_expert(d.x), d.handle, config=config), ll,
            jax_ep.low_latency_combine(_expert(ll.x), idx, w, ll.handle, config=config))
  return fn


def _check(config, got, x, idx, w):
  d, out, ll, ll_out = got
  layout = hr.ht_dispatch(x, idx, w, config)
  assert_bitwise(d.x, mine(layout.x), "HT x")
  assert_bitwise(d.handle.recv_src, mine(layout.recv_src), "HT recv_src")
  assert_bitwise(out, mine(hr.ht_combine(_host_expert(layout.x), layout)), "HT combine")
  ll_layout = hr.ll_dispatch(x, idx, config)
  assert_bitwise(ll.count, mine(ll_layout.count), "LL count")
  assert_bitwise(ll.handle.recv_src, mine(ll_layout.recv_src), "LL recv_src")
  assert_bitwise(ll_out, mine(hr.ll_combine(_host_expert(ll_layout.x), idx, w, ll_layout)),
                 "LL combine")


def test_two_configs_alternate_on_one_set_of_buffers():
  a, b = _configs()
  mesh = ep_mesh()
  jax_ep.initialize((a, b), mesh)
  ia, ib = _inputs(a, 900), _inputs(b, 901)

  def both(xa, ia_, wa, xb, ib_, wb):
    return _round_trips(a)(xa, ia_, wa), _round_trips(b)(xb, ib_, wb)

  for _ in range(3):  # in one program, then alternating programs
    got_a, got_b = run(both, mesh, *ia, *ib)
    _check(a, got_a, *ia)
    _check(b, got_b, *ib)
    _check(b, run(_round_trips(b), mesh, *ib), *ib)
    _check(a, run(_round_trips(a), mesh, *ia), *ia)


@kernels_only("the handlers' check: the portable backend has no buffers")
def test_an_executable_the_buffers_no_longer_serve_fails_in_its_handler():
  a, b = _configs()
  mesh = ep_mesh()
  jax_ep.initialize((a, b), mesh)
  x, idx, w = (np.asarray(v)[jax.process_index()][None] for v in _inputs(b, 902))
  from gpu_testing import _per_shard, global_array  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  mapped = jax.jit(jax.shard_map(_per_shard(lambda x, i, w: jax_ep.low_latency_dispatch(
      x, i, config=b).count), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  args = [global_array(mesh, v) for v in (x, idx, w)]
  compiled = mapped.lower(*args).compile()
  jax_ep.initialize(a, mesh)  # b's H and K no longer fit: the buffers shrink
  with pytest.raises(Exception, match=r"allocated for at most .*: H 1024 > 256, K 8 > 4"):
    jax.block_until_ready(compiled(*args))
