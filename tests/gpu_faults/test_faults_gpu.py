"""A rank that skips a call: the other times out, reports it, fails its next call,
and finalize() still returns. One test per launcher run (see conftest.py)."""

import os
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from gpu_testing import global_array, rank, routing, rows, setup

TIMEOUT_S = 3.0
MARGIN_S = 5.0


def _barrier(name: str) -> None:
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  distributed.global_state.client.wait_at_barrier(f"jax_ep_faults/{name}", 120_000)


def _executable(op, mesh, *local_args):
  """One jitted executable and its inputs, called again and again (so that, with
  command buffers on, later calls replay its CUDA graph)."""
  mapped = jax.jit(jax.shard_map(lambda *a: jax.tree.map(lambda o: o[None], op(*a)), mesh=mesh,
                                 in_specs=P("ep"), out_specs=P("ep")))
  args = [global_array(mesh, a) for a in local_args]
  return lambda: jax.block_until_ready(mapped(*args))  # one array: the op's result


def _skip_one_call(call, expected_op: str, assert_marked) -> None:
  """Both ranks call twice (compile, warm-up, graph capture); then rank 1 skips
  a call that rank 0 makes: rank 0's call returns results marked void
  (`assert_marked`), and its next call must be refused."""
  assert jax_ep.status()["ok"]
  assert jax_ep.status()["fails_next_execution"], "the prepare-stage check is not registered"
  call()
  call()
  assert jax_ep.status()["ok"]
  _barrier("warm")
  if rank() == 1:
    time.sleep(TIMEOUT_S + MARGIN_S)  # the hang: this rank never makes the call
    assert jax_ep.status()["ok"]
  else:
    start = time.perf_counter()
    result = call()  # returns once the kernel gives up on rank 1
    elapsed = time.perf_counter() - start
    status = jax_ep.status()
    print(f"time to error: {elapsed:.2f} s (timeout_s={TIMEOUT_S}); status: {status}")
    assert not status["ok"] and status["op"].startswith(expected_op) and status["peer"] == 1
    assert 0.5 * TIMEOUT_S < elapsed < TIMEOUT_S + MARGIN_S
    # Its results must not look valid: counts that cannot be real.
    assert_marked(np.asarray(result.addressable_shards[0].data)[0])
    # The next call of the same executable fails before launching anything,
    # also when it would replay a command buffer (prepare-stage check).
    start = time.perf_counter()
    with pytest.raises(Exception, match="timed out waiting for EP rank 1"):
      call()
    print(f"next call refused after {time.perf_counter() - start:.3f} s")
  _barrier("after")
  start = time.perf_counter()
  jax_ep.finalize()
  print(f"finalize after the fault: {time.perf_counter() - start:.2f} s")
  assert time.perf_counter() - start < 30


def test_ll_dispatch_skipped_by_a_peer():
  e, k, t, h = 16, 4, 16, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       timeout_s=TIMEOUT_S, enable_high_throughput=False)
  rng = np.random.default_rng(1200 + rank())
  x, idx = rows(rng, (t, h)), routing(rng, t, k, e, none_fraction=0.0)
  op = lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count  # noqa: E731

  def marked(count):
    assert np.all(count == -1), count

  _skip_one_call(_executable(op, mesh, x, idx), "low_latency_dispatch", marked)


def test_ht_dispatch_skipped_by_a_peer():
  e, k, t, h = 16, 4, 64, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       timeout_s=TIMEOUT_S, enable_low_latency=False)
  rng = np.random.default_rng(1300 + rank())
  x, idx = rows(rng, (t, h)), routing(rng, t, k, e, none_fraction=0.0)
  w = np.ones((t, k), np.float32)
  op = lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).num_tokens  # noqa: E731

  def marked(num_tokens):
    assert int(num_tokens) == -1, num_tokens

  _skip_one_call(_executable(op, mesh, x, idx, w), "dispatch", marked)


def _protocol_executables():
  """setup(), and the executables of a one-call LL dispatch and of a split send
  alone."""
  e, k, t, h = 16, 4, 16, 256
  config, mesh = setup(num_experts=e, hidden=h, max_tokens_per_rank=t, num_topk=k,
                       timeout_s=TIMEOUT_S, enable_high_throughput=False)
  rng = np.random.default_rng(1400 + rank())
  x, idx = rows(rng, (t, h)), routing(rng, t, k, e, none_fraction=0.0)
  one_call = _executable(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count,
                         mesh, x, idx)
  send_only = _executable(
      lambda x, i: tuple(jax.tree.leaves(jax_ep.low_latency_dispatch_send(x, i, config=config))),
      mesh, x, idx)
  return one_call, send_only


def _protocol_fault_refused(one_call, send_only) -> None:
  """Makes a protocol fault: a one-call LL dispatch while a split send awaits
  its receive (a misuse of the split API, made alike on every rank). That
  call's counts are void (-1), the fault is a protocol fault, and the next
  execution of the one-call op is refused before it launches."""
  assert jax_ep.status()["ok"]
  for _ in range(2):  # compile, warm up, capture the graph
    count = np.asarray(one_call().addressable_shards[0].data)[0]
    assert np.all(count >= 0), count
  _barrier("warm")
  send_only()  # its receive never runs
  count = np.asarray(one_call().addressable_shards[0].data)[0]
  status = jax_ep.status()
  print(f"then status: {status}")
  assert np.all(count == -1), count
  assert not status["ok"] and status["kind"] == "protocol", status
  assert status["op"] == "low_latency_dispatch" and status["peer"] == rank(), status
  start = time.perf_counter()
  with pytest.raises(Exception, match="ran while a split send of its kind awaited its receive"):
    one_call()
  print(f"next call refused after {time.perf_counter() - start:.3f} s")
  _barrier("after")
  jax_ep.finalize()


def test_protocol_fault_fails_the_next_execution():
  """A protocol fault (_protocol_fault_refused), also when the next execution
  would replay a command buffer (the status check's prepare stage)."""
  executables = _protocol_executables()
  assert jax_ep.status()["fails_next_execution"]
  _protocol_fault_refused(*executables)


def test_protocol_fault_without_the_prepare_stage():
  """The same with the prepare stage off (JAX_EP_PREPARE_STATUS_CHECK=0) and
  command buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=): the status
  check's execute stage refuses the next execution."""
  if os.environ.get("JAX_EP_PREPARE_STATUS_CHECK") != "0" or (
      "--xla_gpu_enable_command_buffer= " not in os.environ.get("XLA_FLAGS", "") + " "):
    pytest.skip("run with JAX_EP_PREPARE_STATUS_CHECK=0 and "
                "XLA_FLAGS=--xla_gpu_enable_command_buffer=")
  executables = _protocol_executables()
  assert not jax_ep.status()["fails_next_execution"]
  _protocol_fault_refused(*executables)
