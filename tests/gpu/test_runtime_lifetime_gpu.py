"""The runtime's lifetime: finalize() ends it and a later initialize() starts a
new one in the same processes (on CUDA a new C++ Runtime object, cuda/runtime.h:
Runtime::Start / Runtime::Stop), on which the same program gives the same bits.
On CPU processes the portable backend goes through the same two calls."""

import numpy as np

import jax_ep
from gpu_testing import (ON_CPU, assert_bitwise, global_routing, num_ranks, rank, rng, rows,
                         run_local, weights)
from ll_testing import experts, ll_setup


def test_finalize_then_initialize_runs_on_a_new_runtime():
  e, k, t, h = experts(16), 4, 16, 256
  gen = rng(950)
  r = num_ranks()
  x = rows(gen, (r, t, h))[rank()]
  idx = global_routing(gen, (r,), t, k, e)[rank()]
  w = weights(gen, (r, t, k))[rank()]

  def pair(config):
    def fn(x, idx, w):
      d = jax_ep.low_latency_dispatch(x, idx, config=config)
      return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config), d.count
    return fn

  config, mesh = ll_setup(e, k, t, h)
  first = run_local(pair(config), mesh, x, idx, w)
  jax_ep.finalize()
  assert jax_ep.runtime_state() is None
  if not ON_CPU:
    from jax_ep import _extension  # pylint: disable=import-outside-toplevel
    assert not _extension.cuda_module().initialized()
  config, mesh = ll_setup(e, k, t, h)
  second = run_local(pair(config), mesh, x, idx, w)
  assert_bitwise(second[1], first[1], "count")
  assert_bitwise(second[0], first[0], "combine")
  assert np.all(first[1] >= 0)  # the calls ran (a void call has count -1)
