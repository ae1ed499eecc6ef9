"""Bad input: clear errors at trace time, invalid indices never used as addresses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from ep_testing import make_mesh, random_rows, run_per_shard, setup

CONFIG = dict(num_experts=8, hidden=16, max_tokens_per_rank=4, num_topk=2)


def _args(num_ranks=2, t=4, h=16, k=2, dtype=jnp.bfloat16):
  rng = np.random.default_rng(0)
  return (random_rows(rng, (num_ranks * t, h), dtype),
          np.zeros((num_ranks * t, k), np.int32), np.ones((num_ranks * t, k), np.float32))


def test_config_validation():
  with pytest.raises(jax_ep.EpConfigError, match="num_experts"):
    jax_ep.EpConfig(num_experts=0, hidden=8, max_tokens_per_rank=4, num_topk=1)
  with pytest.raises(jax_ep.EpConfigError, match="num_topk"):
    jax_ep.EpConfig(num_experts=4, hidden=8, max_tokens_per_rank=4, num_topk=5)
  with pytest.raises(jax_ep.EpConfigError, match="hidden"):
    jax_ep.EpConfig(num_experts=4, hidden=8.0, max_tokens_per_rank=4, num_topk=1)
  config = jax_ep.EpConfig(**CONFIG)
  assert hash(config) == hash(jax_ep.EpConfig(**CONFIG))
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.hidden = 3


def test_low_latency_token_cap():
  big = dict(CONFIG, max_tokens_per_rank=4096)
  assert jax_ep.EpConfig(**big).ll_max_tokens == 128
  assert jax_ep.EpConfig(**CONFIG).ll_max_tokens == CONFIG["max_tokens_per_rank"]
  assert jax_ep.EpConfig(**big, low_latency_max_tokens_per_rank=256).ll_max_tokens == 256
  for bad in (0, -3, 2.0, True):
    with pytest.raises(jax_ep.EpConfigError, match="low_latency_max_tokens_per_rank"):
      jax_ep.EpConfig(**CONFIG, low_latency_max_tokens_per_rank=bad)


def test_low_latency_tokens_past_their_cap_are_a_trace_time_error():
  config = jax_ep.EpConfig(**dict(CONFIG, max_tokens_per_rank=8),
                           low_latency_max_tokens_per_rank=2)
  jax_ep.initialize(config, make_mesh(2))
  x, idx, _ = _args(t=3)
  with pytest.raises(jax_ep.EpConfigError, match="low_latency_max_tokens_per_rank is 2"):
    run_per_shard(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config).count,
                  make_mesh(2), x, idx)


def test_fallback_policy_is_checked():
  with pytest.raises(jax_ep.EpConfigError, match="fallback"):
    jax_ep.EpConfig(**CONFIG, fallback="silent")


def test_experts_not_divisible_by_ranks():
  config = jax_ep.EpConfig(num_experts=6, hidden=8, max_tokens_per_rank=4, num_topk=1)
  with pytest.raises(jax_ep.EpConfigError, match="divisible"):
    jax_ep.initialize(config, make_mesh(4))


def test_axis_not_in_mesh():
  config = jax_ep.EpConfig(**CONFIG, group=jax_ep.EpGroup(axis_name="experts"))
  with pytest.raises(jax_ep.EpConfigError, match=r"\['experts'\] not among the mesh axes"):
    jax_ep.initialize(config, make_mesh(2))


def test_call_without_initialize():
  config = jax_ep.EpConfig(**CONFIG)
  with pytest.raises(jax_ep.EpError, match="initialize"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, make_mesh(2),
                  *_args())


def test_call_with_another_config():
  config, mesh = setup(2, **CONFIG)
  other = dataclasses.replace(config, hidden=32)
  with pytest.raises(jax_ep.EpConfigError, match="initialized with"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=other).x, mesh,
                  *_args(h=32))


def test_call_outside_shard_map():
  config, _ = setup(2, **CONFIG)
  x, idx, w = _args()
  with pytest.raises(jax_ep.EpConfigError, match="inside jax.shard_map"):
    jax.jit(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x)(x[:4], idx[:4], w[:4])


@pytest.mark.parametrize("bad,match", [
    (dict(h=32), r"\[tokens, 16\]"),
    (dict(t=5), "max_tokens_per_rank"),
    (dict(k=3), r"topk_idx must be \[5?4?, 2\]|topk_idx must be"),
    (dict(dtype=jnp.int32), "dtype int32 is not supported"),
])
def test_dispatch_shape_and_dtype_errors(bad, match):
  config, mesh = setup(2, **CONFIG)
  with pytest.raises(jax_ep.EpConfigError, match=match):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh, *_args(**bad))


def test_topk_dtype_and_weights_errors():
  config, mesh = setup(2, **CONFIG)
  x, idx, w = _args()
  with pytest.raises(jax_ep.EpConfigError, match="topk_idx dtype"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh,
                  x, idx.astype(np.float32), w)
  with pytest.raises(jax_ep.EpConfigError, match="topk_weights must be"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh,
                  x, idx, w[:, :1])
  with pytest.raises(jax_ep.EpConfigError, match="topk_weights must be floating"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config).x, mesh,
                  x, idx, w.astype(np.int32))


def test_topk_weights_shape_errors_name_both_layouts():
  """Routing weights are [T_local, K]; a dispatch's result's topk_weights is [C, K]
  token-major and [M] expert-major. Passing a result's weights where the routing's
  belong, or weighting a combine's rows with the other layout's shape, says which
  shape applies and names both layouts'."""
  config, mesh = setup(2, **CONFIG)
  layouts = r".*float32\[C, 2\] in the token-major layout.*float32\[M\] in the expert-major"

  def result_weights_as_routing(x, i, w):  # [M] = [16] where [4, 2] belongs
    d = jax_ep.dispatch(x, i, w, config=config, layout="expert_major")
    return jax_ep.dispatch(x, i, d.topk_weights, config=config).x

  with pytest.raises(jax_ep.EpConfigError,
                     match=r"jax_ep.dispatch: topk_weights must be \[4, 2\] \(tokens, num_topk\), "
                           r"this rank's routing weights.*got \(16,\)" + layouts):
    run_per_shard(result_weights_as_routing, mesh, *_args())

  def ll_combine_with_result_weights(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    t = jax_ep.dispatch(x, i, w, config=config)  # token-major: [C, K] = [8, 2]
    return jax_ep.low_latency_combine(d.x, i, t.topk_weights, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError, match=r"low_latency_combine: topk_weights must be "
                                                 r"\[4, 2\].*got \(8, 2\)" + layouts):
    run_per_shard(ll_combine_with_result_weights, mesh, *_args())

  def token_major_weighted_per_k(x, i, w):  # [C, K, H]: the K weights not summed
    d = jax_ep.dispatch(x, i, w, config=config)
    y = d.x[:, None, :] * d.topk_weights[:, :, None].astype(d.x.dtype)
    return jax_ep.combine(y, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError,
                     match=r"y must be \[8, 16\] .*got \(8, 2, 16\); this handle is token-major: "
                           r".*d.topk_weights is float32\[C, K\] = \[8, 2\]" + layouts):
    run_per_shard(token_major_weighted_per_k, mesh, *_args())

  def expert_major_with_token_rows(x, i, w):
    d = jax_ep.dispatch(x, i, w, config=config, layout="expert_major")
    return jax_ep.combine(x, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError,
                     match=r"y must be \[16, 16\] .*got \(4, 16\); this handle is expert-major: "
                           r".*d.topk_weights is float32\[M\] = \[16\]" + layouts):
    run_per_shard(expert_major_with_token_rows, mesh, *_args())


@pytest.mark.parametrize("capacity", [0, 9, -1, 2.5])
def test_capacity_errors(capacity):
  config, mesh = setup(2, **CONFIG)
  with pytest.raises(jax_ep.EpConfigError, match="capacity"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=config, capacity=capacity).x,
                  mesh, *_args())


def test_fp8_input_errors():
  config, mesh = setup(2, num_experts=8, hidden=256, max_tokens_per_rank=4, num_topk=2)
  x, idx, w = _args(h=256)

  def with_scales(scales_fn):
    def fn(x, i, w):
      q, s = jax_ep.fp8.quantize(x)
      return jax_ep.dispatch((q, scales_fn(s)), i, w, config=config).x
    return fn

  with pytest.raises(jax_ep.EpConfigError, match="scales must be"):
    run_per_shard(with_scales(lambda s: s[:, :1]), mesh, x, idx, w)
  with pytest.raises(jax_ep.EpConfigError, match="scales must be float32"):
    run_per_shard(with_scales(lambda s: s.astype(jnp.bfloat16)), mesh, x, idx, w)
  with pytest.raises(jax_ep.EpConfigError, match="x_fp8 dtype"):
    run_per_shard(lambda x, i, w: jax_ep.dispatch((x, x[:, :2]), i, w, config=config).x,
                  mesh, x, idx, w)


def test_fp8_needs_hidden_multiple_of_128():
  config, mesh = setup(2, **CONFIG)
  with pytest.raises(jax_ep.EpConfigError, match="multiple of 128"):
    run_per_shard(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config, use_fp8=True).x,
                  mesh, *_args()[:2])


def test_combine_errors():
  config, mesh = setup(2, **CONFIG)

  def wrong_rows(x, i, w):
    d = jax_ep.dispatch(x, i, w, config=config)
    return jax_ep.combine(d.x[:3], d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError, match="y must be"):
    run_per_shard(wrong_rows, mesh, *_args())

  def wrong_handle(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    return jax_ep.combine(x, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError, match="DispatchHandle"):
    run_per_shard(wrong_handle, mesh, *_args())


def test_low_latency_combine_errors():
  config, mesh = setup(2, **CONFIG)

  def wrong_shape(x, i, w):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    return jax_ep.low_latency_combine(d.x[:, :2], i, w, d.handle, config=config)

  with pytest.raises(jax_ep.EpConfigError, match="E_local, R\\*T_ll, H"):
    run_per_shard(wrong_shape, mesh, *_args())


def test_invalid_indices_are_counted_and_never_used():
  """Out-of-range indices behave exactly like -1 and are counted per rank."""
  config, mesh = setup(2, **CONFIG)
  x, _, w = _args()
  idx = np.array([[0, 9], [-2, 3], [7, -1], [100, -100],
                  [1, 2], [8, 8], [-1, -1], [5, 2**31 - 1]], np.int32)
  cleaned = np.where((idx >= -1) & (idx < 8), idx, -1)

  def fn(x, i, w):
    return (jax_ep.dispatch(x, i, w, config=config),
            jax_ep.low_latency_dispatch(x, i, config=config))

  (ht, ll), (ht_clean, ll_clean) = (run_per_shard(fn, mesh, x, idx, w),
                                    run_per_shard(fn, mesh, x, cleaned, w))
  np.testing.assert_array_equal(ht.num_invalid, [4, 3])
  np.testing.assert_array_equal(ll.num_invalid, [4, 3])
  for a, b in [(ht.x, ht_clean.x), (ht.topk_idx, ht_clean.topk_idx),
               (ht.num_tokens, ht_clean.num_tokens), (ll.count, ll_clean.count),
               (ll.x, ll_clean.x)]:
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("op", ["dispatch", "low_latency_dispatch", "layout"])
def test_debug_checks_raise_at_run_time(op):
  config, mesh = setup(2, **CONFIG, debug_checks=True)
  x, idx, w = _args()
  idx[5, 1] = 42

  def fn(x, i, w):
    if op == "dispatch":
      return jax_ep.dispatch(x, i, w, config=config).x
    if op == "layout":
      return jax_ep.get_dispatch_layout(i, config=config)[0]
    return jax_ep.low_latency_dispatch(x, i, config=config).x

  with pytest.raises(Exception, match=r"outside \[-1, 8\).*per rank: \[0, 1\].*rank 1: topk_idx\[1\]\[1\] = 42"):
    run_per_shard(fn, mesh, x, idx, w)
  idx[5, 1] = 3  # valid input runs
  run_per_shard(fn, mesh, x, idx, w)


def test_finalize_drops_a_failed_runtime_token(monkeypatch):
  """After a fault, JAX's saved runtime token holds the refused call's error and
  JAX waits for it at exit; finalize() drops it so the process exits cleanly."""
  from jax._src import dispatch  # pylint: disable=import-outside-toplevel

  class FailedTokens:
    cleared = False

    def block_until_ready(self):
      raise RuntimeError("DEADLINE_EXCEEDED: jax_ep.EpError: ... timed out")

    def clear(self):
      FailedTokens.cleared = True

  monkeypatch.setattr(dispatch, "runtime_tokens", FailedTokens())
  jax_ep.finalize()
  assert FailedTokens.cleared


@pytest.mark.parametrize("fault, message, absent", [
    # a kernel recorded a timeout: the op and the peer are named
    (dict(kind="timeout", op="dispatch (count exchange)", peer=1),
     r"dispatch \(count exchange\)\) timed out waiting for EP rank 1", None),
    # a one-call LL op while a split send of its kind awaited its receive: a
    # misuse of the split API, not a peer's timeout
    (dict(kind="protocol", op="low_latency_dispatch", peer=0),
     r"low_latency_dispatch\) ran while a split send of its kind awaited its receive",
     "timed out"),
])
def test_a_recorded_fault_fails_the_next_trace_with_ep_error(monkeypatch, fault, message, absent):
  """After a kernel recorded a fault, tracing any jax_ep op raises jax_ep.EpError
  saying what happened (executables compiled before fail inside XLA)."""
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  config, mesh = setup(2, **CONFIG)
  idx = np.zeros((2 * 4, 2), np.int32)
  monkeypatch.setattr(runtime, "status", lambda: {
      "ok": False, "backend": "cuda", "detail": 0, "fault_count": 1, **fault})
  with pytest.raises(jax_ep.EpError, match=message) as raised:
    run_per_shard(lambda i: jax_ep.get_dispatch_layout(i, config=config)[0], mesh, idx)
  if absent is not None:
    assert absent not in str(raised.value)


@pytest.mark.parametrize("code, kind", [(1, "timeout"), (2, "protocol")])
def test_status_names_the_kind_of_fault(monkeypatch, code, kind):
  """jax_ep.status() on CUDA: the device status word's code as a kind (a stand-in
  for the CUDA runtime's status read; cuda/ep_types.h kStatus*)."""
  from jax_ep import runtime  # pylint: disable=import-outside-toplevel
  setup(2, **CONFIG)

  class StatusWord:
    def status(self):
      return dict(code=code, op=1, peer=0, detail=3, fault_count=2)

  with monkeypatch.context() as patch:  # undone before the test's teardown finalizes
    patch.setattr(runtime, "_state", dataclasses.replace(runtime._state, cuda=StatusWord()))
    fault = jax_ep.status()
  assert fault["ok"] is False and fault["kind"] == kind
  assert (fault["op"], fault["peer"], fault["detail"], fault["fault_count"]) == (
      "low_latency_dispatch", 0, 3, 2)


def test_a_failed_runtime_token_is_also_dropped_at_exit():
  """A process that never calls finalize() after a fault must exit cleanly too:
  the token drop runs at exit, before JAX's own exit wait (registered later, runs first)."""
  import os  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  script = (
      "import jax_ep\n"
      "from jax._src import dispatch\n"
      "class Failed:\n"
      "  failed = True\n"
      "  def block_until_ready(self):\n"
      "    if self.failed:\n"
      "      raise RuntimeError('jax_ep.EpError: timed out')\n"
      "  def clear(self):\n"
      "    print('dropped', flush=True)\n"
      "    self.failed = False\n"
      "dispatch.runtime_tokens = Failed()\n")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert result.returncode == 0, result.stderr
  assert "dropped" in result.stdout
  assert "Exception ignored in atexit" not in result.stderr, result.stderr
