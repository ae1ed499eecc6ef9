"""A process killed (SIGKILL) in the middle of a call: the survivors' calls end
within timeout_s, their results are marked void (or, with mask_on_timeout, are
right without the dead rank), finalize() returns without a barrier on the dead
peer, and every process exits by itself.

Run each test in its own launcher invocation, with --keep_going (the launcher
must not stop the survivors) and JAX's recoverability on, so that JAX's
coordination service lets the survivors go on after a task died
(docs/reliability.md):

    JAX_ENABLE_RECOVERABILITY=1 python -m jax_ep.launch -n 2 --keep_going \\
        -m pytest tests/gpu_faults -k killed

The last rank is the one killed (rank 0 hosts JAX's coordination service, whose
death no process survives). Its pytest process dies with it and reports
nothing; the survivors report the test.
"""

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from gpu_testing import global_array, rank, routing, rows, setup
from test_faults_gpu import MARGIN_S, TIMEOUT_S, _barrier
from test_masking_gpu import E, H, K, T, _expected_rank0_alone

# One executable of NUM_CALLS dependent LL calls: the victim dies half way
# through it (half the time a warm run of it takes: ~30 us per call on real
# GPUs, milliseconds where processes share a GPU); after the fault every wait
# gives up at once.
NUM_CALLS = 2_000


def _looped_ll(config, mesh):
  """One executable: NUM_CALLS dependent LL dispatch + combine calls."""

  def fn(x, idx, w):
    def step(_, carry):
      d = jax_ep.low_latency_dispatch(carry, idx, config=config)
      return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config)
    out = jax.lax.fori_loop(0, NUM_CALLS, step, x)
    d = jax_ep.low_latency_dispatch(out, idx, config=config)
    return d.count[None], out[None]

  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  return lambda *a: [np.asarray(o.addressable_shards[0].data)[0]
                     for o in jax.block_until_ready(mapped(*[global_array(mesh, v) for v in a]))]


def _timed(call, *args) -> float:
  start = time.perf_counter()
  call(*args)
  return time.perf_counter() - start


def _kill_me_in(seconds: float) -> None:
  threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()


def _require_recoverability() -> None:
  if not jax.config.jax_enable_recoverability:
    pytest.skip("JAX's coordination service aborts every task once one dies unless "
                "JAX_ENABLE_RECOVERABILITY=1 (tools/gpu_check.sh sets it for this test)")


def _finalize_and_time() -> None:
  start = time.perf_counter()
  jax_ep.finalize()  # a bounded barrier: the dead peer is not waited for past timeout_s
  elapsed = time.perf_counter() - start
  print(f"finalize with a dead peer: {elapsed:.2f} s (timeout_s={TIMEOUT_S})")
  assert elapsed < TIMEOUT_S + MARGIN_S + 5


def test_killed_peer_mid_call_fails_the_survivors_call_in_time():
  _require_recoverability()
  config, mesh = setup(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                       timeout_s=TIMEOUT_S, enable_high_throughput=False)
  rng = np.random.default_rng(1700 + rank())
  x, idx = rows(rng, (T, H)), routing(rng, T, K, E, none_fraction=0.0)
  w = np.full((T, K), 0.25, np.float32)
  call = _looped_ll(config, mesh)
  call(x, idx, w)  # compile and warm up, every rank alive
  kill_after = _timed(call, x, idx, w) / 2
  _barrier("warm")
  victim = jax.process_count() - 1
  if rank() == victim:
    _kill_me_in(kill_after)
  start = time.perf_counter()
  try:
    count, _ = call(x, idx, w)  # the victim dies during it
    raised = None
  except Exception as e:  # pylint: disable=broad-except
    # The loop's next iteration refused to launch (the execute stage saw the
    # fault): the call fails instead of returning void results.
    count, raised = None, e
  elapsed = time.perf_counter() - start
  status = jax_ep.status()
  print(f"call with a peer killed after {kill_after:.3f} s ended after {elapsed:.2f} s "
        f"({'raised' if raised else 'returned'}); status {status}")
  assert not status["ok"] and status["peer"] == victim, status
  assert elapsed < kill_after + TIMEOUT_S + MARGIN_S
  if raised is not None:
    assert f"timed out waiting for EP rank {victim}" in str(raised), raised
  else:
    assert np.all(count == -1), count  # the results say they are void
  with pytest.raises(Exception, match=f"timed out waiting for EP rank {victim}"):
    call(x, idx, w)
  with pytest.raises(jax_ep.EpError, match=f"EP rank {victim}"):
    jax.jit(jax.shard_map(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count,
                          mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).trace(
                              global_array(mesh, x), global_array(mesh, idx))
  _finalize_and_time()


def test_killed_peer_is_masked_and_the_survivors_go_on():
  """mask_on_timeout: the survivor's waits mask the dead rank and it keeps serving,
  matching what the live ranks alone compute (2 processes: rank 0 alone)."""
  _require_recoverability()
  if jax.process_count() != 2:
    pytest.skip("the expected results are written for 2 processes (rank 0 survives)")
  config, mesh = setup(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                       timeout_s=TIMEOUT_S, enable_high_throughput=False,
                       mask_on_timeout=True)
  rng = np.random.default_rng(1800 + rank())
  x, idx = rows(rng, (T, H)), routing(rng, T, K, E, none_fraction=0.1)
  w = rng.random((T, K), np.float32)

  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    scale = (1.0 + jnp.arange(d.x.shape[0], dtype=jnp.float32))[:, None, None]
    y = (d.x.astype(jnp.float32) * scale).astype(jnp.bfloat16)
    out = jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)
    return d.count[None], out[None]

  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  call = lambda: [np.asarray(o.addressable_shards[0].data)[0]  # noqa: E731
                  for o in jax.block_until_ready(mapped(global_array(mesh, x),
                                                        global_array(mesh, idx),
                                                        global_array(mesh, w)))]
  looped = _looped_ll(config, mesh)
  call()
  looped(x, idx, w)
  kill_after = _timed(looped, x, idx, w) / 2
  _barrier("warm")
  if rank() == 1:
    _kill_me_in(kill_after)
  start = time.perf_counter()
  looped(x, idx, w)  # rank 1 dies during it; rank 0 masks it on the first timeout
  print(f"loop with rank 1 killed: {time.perf_counter() - start:.2f} s; "
        f"masked {jax_ep.masked_ranks()}")
  assert jax_ep.masked_ranks() == (1,)
  assert jax_ep.status()["ok"], jax_ep.status()
  for _ in range(5):
    count, out = call()
  expected_count, expected_out = _expected_rank0_alone(x, idx, w)
  np.testing.assert_array_equal(count, expected_count)
  np.testing.assert_allclose(out.astype(np.float32), expected_out, rtol=2e-2, atol=2e-2)
  _finalize_and_time()
