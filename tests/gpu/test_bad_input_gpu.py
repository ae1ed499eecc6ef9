"""Bad input on the GPU path: the same guarantees as on CPU."""

import numpy as np
import pytest

import jax_ep
from gpu_testing import global_routing, needs_xla_collective, num_ranks, rng, rows, run, setup


@needs_xla_collective("debug_checks gathers every rank's invalid-entry count with an XLA "
                      "all_gather")
@pytest.mark.parametrize("op", ["dispatch", "low_latency_dispatch"])
def test_debug_checks_fail_every_rank_and_the_group_stays_in_step(op):
  e, k, t, h = 16, 4, 16, 256
  # The check's all_gather is intended here: allow it under any fallback policy.
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       debug_checks=True, fallback="allow")
  r = num_ranks()
  gen = rng(1400)
  x, idx = rows(gen, (r, t, h)), global_routing(gen, (r,), t, k, e)
  w = np.ones((r, t, k), np.float32)

  def fn(x, i, w):
    if op == "dispatch":
      return jax_ep.dispatch(x, i, w, config=config).num_tokens
    return jax_ep.low_latency_dispatch(x, i, config=config).count

  bad = idx.copy()
  bad[r - 1, 3, 2] = e + 5  # on the last rank only
  with pytest.raises(Exception,
                     match=rf"outside \[-1, {e}\).*rank {r - 1}: topk_idx\[3\]\[2\] = {e + 5}"):
    run(fn, mesh, x, bad, w)
  run(fn, mesh, x, idx, w)  # the same op with valid input still works on every rank


@pytest.mark.parametrize("cap", ["max_tokens_per_rank", "low_latency_max_tokens_per_rank"])
def test_too_many_tokens_is_a_trace_time_error(cap):
  """More tokens than the LL cap T_ll: by default min(max_tokens_per_rank, 128),
  or low_latency_max_tokens_per_rank below max_tokens_per_rank."""
  sizes = dict(max_tokens_per_rank=8) if cap == "max_tokens_per_rank" else dict(
      max_tokens_per_rank=64, low_latency_max_tokens_per_rank=8)
  config, mesh = setup(num_experts=16, hidden=256, num_topk=4, **sizes)
  r = num_ranks()
  gen = rng(1500)
  x, idx = rows(gen, (r, 9, 256)), global_routing(gen, (r,), 9, 4, 16)
  with pytest.raises(jax_ep.EpConfigError,
                     match="has 9 tokens but EpConfig.low_latency_max_tokens_per_rank is 8"):
    run(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count, mesh, x, idx)
