"""The remote-peer mode (testing only): with JAX_EP_TESTING_RDMA_PEERS set, the
kernels treat those EP peers as reachable only by RDMA, so the LL kernels take
their RDMA branch (staging, puts, quiet or per-QP signals) over NVSHMEM's own
P2P transport. tests/gpu/test_ll_gpu.py is the LL suite of this mode; this
file checks the mode itself and what the HT ops do under it. Collected only
when the variable is set (conftest.py; tools/gpu_check.sh one-gpu rdma sets it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from gpu_testing import rank, routing, rows, run_local

E, K, T, H = 16, 4, 16, 256


def _mesh():
  return jax.make_mesh((jax.process_count(),), ("ep",))


def test_probe_reports_the_forced_peers_as_rdma_only():
  config = jax_ep.EpConfig(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                           enable_high_throughput=False)
  jax_ep.initialize(config, _mesh())
  state = jax_ep.runtime_state()
  assert state.cuda is not None and state.cuda.rdma_staging
  reachable = state.cuda.probe_peers()  # by EP rank
  assert reachable[state.cuda.rank]  # a PE always reaches itself
  assert not any(reachable[r] for r in range(len(reachable)) if r != state.cuda.rank)


def test_high_throughput_needs_every_peer_on_nvlink():
  """Documented behaviour: initialize refuses the HT buffers when a peer is RDMA-only."""
  config = jax_ep.EpConfig(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K)
  with pytest.raises(jax_ep.EpError, match="high-throughput kernels need every EP peer"):
    jax_ep.initialize(config, _mesh())


def test_high_throughput_ops_without_their_buffers_are_refused_at_trace_time():
  """With enable_high_throughput=False the HT ops would take the portable (XLA
  collective) path: fallback='error' refuses them before anything runs."""
  config = jax_ep.EpConfig(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                           enable_high_throughput=False, fallback="error")
  jax_ep.initialize(config, _mesh())
  rng = np.random.default_rng(2000 + rank())
  x, idx = rows(rng, (T, H)), routing(rng, T, K, E)
  w = np.ones((T, K), np.float32)
  with pytest.raises(jax_ep.EpConfigError, match="enable_high_throughput=False"):
    run_local(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).num_tokens,
        jax_ep.runtime_state().mesh, x, idx, w)


def test_low_latency_round_trip_over_the_rdma_branch():
  """One LL dispatch + combine over the RDMA branch against the NVLink-free
  expectation: every row equals its source token (identity experts, weights 1)."""
  config = jax_ep.EpConfig(num_experts=E, hidden=H, max_tokens_per_rank=T, num_topk=K,
                           enable_high_throughput=False, fallback="error")
  jax_ep.initialize(config, _mesh())
  rng = np.random.default_rng(2100 + rank())
  x = rows(rng, (T, H))
  idx = routing(rng, T, K, E, none_fraction=0.0)
  w = np.ones((T, K), np.float32) / K

  def fn(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    return jax_ep.low_latency_combine(d.x, i, w, d.handle, config=config)

  out = run_local(fn, jax_ep.runtime_state().mesh, x, idx, w)
  # K distinct experts, each returning x[t] (bf16, exact), weighted 1/K: the
  # fp32 sum of K exact terms x/K is exact for K a power of two.
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(jnp.asarray(x, jnp.float32)))
