"""Bad input on the GPU path: the same guarantees as on CPU."""

import numpy as np
import pytest

import jax_ep
from gpu_testing import rank, routing, rows, run, setup


@pytest.mark.parametrize("op", ["dispatch", "low_latency_dispatch"])
def test_debug_checks_fail_every_rank_and_the_group_stays_in_step(op):
  e, k, t, h = 16, 4, 16, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       debug_checks=True)
  rng = np.random.default_rng(1400 + rank())
  x, idx = rows(rng, (t, h)), routing(rng, t, k, e)
  w = np.ones((t, k), np.float32)

  def fn(x, i, w):
    if op == "dispatch":
      return jax_ep.dispatch(x, i, w, config=config).num_tokens
    return jax_ep.low_latency_dispatch(x, i, config=config).count

  bad = idx.copy()
  if rank() == 1:
    bad[3, 2] = e + 5
  with pytest.raises(Exception, match=rf"outside \[-1, {e}\).*rank 1: topk_idx\[3\]\[2\] = {e + 5}"):
    run(fn, mesh, x, bad, w)
  run(fn, mesh, x, idx, w)  # the same op with valid input still works on every rank


def test_too_many_tokens_is_a_trace_time_error():
  config, mesh = setup(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4)
  rng = np.random.default_rng(1500 + rank())
  x, idx = rows(rng, (9, 256)), routing(rng, 9, 4, 16)
  with pytest.raises(jax_ep.EpConfigError, match="max_tokens_per_rank"):
    run(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count, mesh, x, idx)
