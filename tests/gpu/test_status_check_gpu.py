"""The fault check every jax_ep CUDA call reads (xla_ffi/cuda/handler_common.h
StatusToken): after XLA's CSE one is left per computation, however many calls,
and the calls give the same results as calls compiled one by one. On CPU
processes (the portable backend) there is no check; the results still agree."""

import collections
import re

import jax
import pytest

import jax_ep
from gpu_testing import (ON_CPU, assert_bitwise, compiled_text, global_routing, num_ranks, rank,
                         rng, rows, run_local, weights)
from ll_testing import experts, ll_setup


def _compiled_targets(fn, mesh, *local_args) -> collections.Counter:
  text = compiled_text(fn, mesh, *local_args)
  return collections.Counter(re.findall(r'custom_call_target="(jax_ep_\w+)"', text))


@pytest.mark.parametrize("looped", [False, True], ids=["unrolled", "fori_loop"])
def test_one_status_check_per_computation(looped):
  e, k, t, h = experts(16), 4, 16, 256
  config, mesh = ll_setup(e, k, t, h)
  gen = rng(900)
  r = num_ranks()
  x = rows(gen, (r, t, h))[rank()]
  idx = global_routing(gen, (r,), t, k, e)[rank()]
  w = weights(gen, (r, t, k))[rank()]

  def pair(y, idx, w):
    d = jax_ep.low_latency_dispatch(y, idx, config=config)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config)

  def three(y, idx, w):
    if looped:
      return jax.lax.fori_loop(0, 3, lambda _, carry: pair(carry, idx, w), y)
    for _ in range(3):
      y = pair(y, idx, w)
    return y

  calls = _compiled_targets(three, mesh, x, idx, w)
  if ON_CPU:
    # The portable backend: its CPU handlers, no kernel and no check.
    assert calls["jax_ep_status_check"] == calls["jax_ep_ll_dispatch"] == 0, calls
  else:
    assert calls["jax_ep_status_check"] == 1, calls
    assert calls["jax_ep_ll_dispatch"] == calls["jax_ep_ll_combine"] >= 1, calls
    assert jax_ep.status()["fails_next_execution"]
  out = run_local(three, mesh, x, idx, w)
  want = x
  for _ in range(3):
    want = run_local(pair, mesh, want, idx, w)
  assert_bitwise(out, want, "three calls in one executable")
