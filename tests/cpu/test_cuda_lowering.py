"""What the CUDA backend lowers to, checked on CPU: its FFI custom calls with
the expected attributes, side effects and operand order; plus the buffer sizing
formula against the CUDA extension where it was built."""

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _extension, fallbacks
from jax_ep.runtime import lowering_only

CONFIG = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4)
ALLOW = dataclasses.replace(CONFIG, fallback="allow")  # lowerings that take the portable path


def _lower_for_cuda(fn, *shapes, config=CONFIG):
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("ep"))) for s, d in shapes]
  with lowering_only(config, mesh, backend="cuda"):
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


STATUS_CHECK = "@jax_ep_status_check("


def _custom_calls(text: str) -> list[str]:
  """The kernel calls of lowered ``text``, each with its last operand, the status
  token, left out of its operand list and type signature (asserted to be the
  s32[] result of a jax_ep_status_check call on a constant 0), so that the
  assertions read the op's own operands."""
  lines = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
  checks = {}
  for line in lines:
    if STATUS_CHECK in line:
      name, operand = re.match(r"\s*(%[\w#]+) = stablehlo\.custom_call @jax_ep_status_check"
                               r"\((%[\w#]+)\)", line).groups()
      assert re.search(rf"{re.escape(operand)} = stablehlo\.constant dense<0> : tensor<i32>",
                       text), line
      assert "has_side_effect" not in line and line.endswith(": (tensor<i32>) -> tensor<i32>")
      checks[name] = line
  calls = []
  for line in lines:
    if STATUS_CHECK in line:
      continue
    match = re.search(r"(stablehlo\.custom_call @\w+\([^)]*?)(?:, )?(%[\w#]+)\)", line)
    assert match and match.group(2) in checks, f"no status token last: {line}"
    line = line.replace(match.group(0), match.group(1) + ")", 1)
    head, sep, signature = line.rpartition(" : (")
    operands, arrow, results = signature.partition(") -> ")
    assert operands.endswith("tensor<i32>"), line
    operands = operands[:-len("tensor<i32>")].rstrip(", ")
    calls.append(head + sep + operands + arrow + results)
  return calls


def _targets(calls: list[str]) -> list[str]:
  return [re.search(r"@(\w+)", c).group(1) for c in calls]


def _attr(line: str, name: str) -> str:
  match = re.search(rf"\b{name} = ([^,}}]+)", line)
  assert match, f"attribute {name} missing in {line}"
  return match.group(1).strip()


@pytest.mark.parametrize("use_fp8", [False, True])
def test_low_latency_ops_lower_to_the_cuda_targets(use_fp8):
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=CONFIG, use_fp8=use_fp8)
    y = d.x.astype(jnp.bfloat16)
    return jax_ep.low_latency_combine(y, idx, w, d.handle, config=CONFIG)

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  calls = _custom_calls(text)
  targets = _targets(calls)
  assert targets == ["jax_ep_ll_dispatch", "jax_ep_ll_combine"], targets
  for call in calls:
    assert "has_side_effect = true" in call
    # The traced config: one struct attribute.
    assert re.search(r"config = \{[^}]*\}", call), call
    assert _attr(call, "num_experts") == "16 : i64"
    assert _attr(call, "hidden") == "256 : i64"
    assert _attr(call, "max_tokens") == "8 : i64"
    assert _attr(call, "ll_max_tokens") == "8 : i64"
    assert _attr(call, "num_topk") == "4 : i64"
    assert _attr(call, "num_ranks") == "2 : i64"
  assert _attr(calls[0], "use_fp8") == ("true" if use_fp8 else "false")
  # The dispatch's operands (x, topk_idx, no weights) and results: x [E_local,
  # R*T_ll, H], scales, count, recv_src, no pair weights, num_invalid.
  x_type = "f8E4M3FN" if use_fp8 else "bf16"
  scales = "tensor<8x16x2xf32>" if use_fp8 else "tensor<8x16x0xf32>"
  assert "(tensor<8x256xbf16>, tensor<8x4xi32>, tensor<8x0xf32>) ->" in calls[0], calls[0]
  assert f"-> (tensor<8x16x256x{x_type}>, {scales}, tensor<8xi32>, tensor<8x16xi32>, " \
         "tensor<8x0xf32>, tensor<i32>)" in calls[0], calls[0]
  # The combine's operands: rows, no row values, no row weights, recv_src, count, topk_idx,
  # topk_weights.
  assert ("(tensor<8x16x256xbf16>, tensor<8x0xf32>, tensor<8x0xf32>, tensor<8x16xi32>, "
          "tensor<8xi32>, "
          "tensor<8x4xi32>, tensor<8x4xf32>) -> (tensor<8x256xbf16>, tensor<8x0xf32>)"
          ) in calls[1], calls[1]
  # No CPU handler and no collective sneaks into the CUDA lowering of these ops.
  assert "jax_ep_cpu_" not in text and "all_to_all" not in text


def test_split_low_latency_ops_lower_to_send_and_recv_tied_by_a_ticket():
  def fn(x, idx, w):
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=CONFIG)
    d = jax_ep.low_latency_dispatch_recv(pending, config=CONFIG)
    sent = jax_ep.low_latency_combine_send(d.x, d.handle, config=CONFIG)
    return jax_ep.low_latency_combine_recv(sent, idx, w, config=CONFIG)

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  calls = _custom_calls(text)
  targets = _targets(calls)
  assert targets == ["jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
                     "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv"], targets
  # Each recv takes its send's ticket: dispatch_send's second result, combine_send's result.
  dispatch_send = re.match(r"\s*(%\w+):2 = ", calls[0]).group(1)
  assert f"@jax_ep_ll_dispatch_recv({dispatch_send}#1)" in calls[1]
  combine_send = re.match(r"\s*(%\w+) = ", calls[2]).group(1)
  assert f"@jax_ep_ll_combine_recv({combine_send}, " in calls[3]
  assert "(tensor<8x256xbf16>, tensor<8x4xi32>, tensor<8x0xf32>) -> (tensor<i32>, tensor<i32>)" \
      in calls[0], calls[0]  # no topk_weights
  assert "tensor<8x16xi32>, tensor<8x0xf32>)" in calls[1], calls[1]  # so no rows' weights
  assert _attr(calls[1], "num_tokens") == "8 : i64"
  assert _attr(calls[2], "num_tokens") == "8 : i64"


@pytest.mark.parametrize("fp8", [False, True])
def test_high_throughput_ops_lower_to_the_cuda_targets(fp8):
  def fn(x, idx, w):
    payload = jax_ep.fp8.quantize(x) if fp8 else x
    d = jax_ep.dispatch(payload, idx, w, config=CONFIG, capacity=12)
    return jax_ep.combine(d.x.astype(jnp.bfloat16), d.handle, config=CONFIG)

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  calls = _custom_calls(text)
  targets = _targets(calls)
  assert targets == ["jax_ep_ht_dispatch", "jax_ep_ht_combine"], targets
  for call in calls:
    assert "has_side_effect = true" in call
    assert _attr(call, "capacity") == "12 : i64"
    assert _attr(call, "num_ranks") == "2 : i64"
  x_type, scales = ("f8E4M3FN", "tensor<12x2xf32>") if fp8 else ("bf16", "tensor<12x0xf32>")
  assert (f"-> (tensor<12x256x{x_type}>, {scales}, tensor<12x4xi32>, tensor<12x4xf32>, "
          "tensor<i32>, tensor<8xi32>, tensor<i32>, tensor<i32>, tensor<12xi32>, "
          "tensor<8x2xi32>)") in calls[0], calls[0]
  assert "-> tensor<8x256xbf16>" in calls[1]


def test_e8m0_scale_rows_reach_the_kernel_as_whole_words():
  """Hidden 256: 2 float8_e8m0fnu scales (2 bytes) per row. The HT dispatch kernel
  moves scale rows as 4-byte words (its handler refuses anything else), so the
  backend pads them to 4 columns for the call and returns the 2 the caller gave."""
  def fn(x, idx, w):
    payload = jax_ep.fp8.quantize(x, round_scale=True, scale_dtype=jnp.float8_e8m0fnu)
    return jax_ep.dispatch(payload, idx, w, config=CONFIG, capacity=12).scales

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  (call,) = _custom_calls(text)
  assert "tensor<8x4xf8E8M0FNU>" in call.split(" -> ")[0], call
  assert "-> (tensor<12x256xf8E4M3FN>, tensor<12x4xf8E8M0FNU>," in call, call
  assert re.search(r"-> tensor<1x12x2xf8E8M0FNU>|tensor<12x2xf8E8M0FNU>", text), text[-2000:]


def test_high_throughput_gradients_lower_to_the_cuda_targets():
  """dispatch's backward is a combine, combine's a dispatch along the handle: both kernels."""
  def fn(x, idx, w):
    def loss(x):
      d = jax_ep.dispatch(x, idx, w, config=CONFIG)
      return jnp.sum(jax_ep.combine(d.x, d.handle, config=CONFIG).astype(jnp.float32) ** 2)
    return jax.grad(loss)(x)

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  targets = _targets(_custom_calls(text))
  assert sorted(targets) == ["jax_ep_ht_combine", "jax_ep_ht_combine", "jax_ep_ht_dispatch",
                             "jax_ep_ht_dispatch"], targets


@pytest.mark.parametrize("past_limit", [0, 1])
def test_high_throughput_dispatch_past_the_kernels_token_limit_takes_the_portable_path(
    past_limit):
  """The HT dispatch kernel keeps a byte per token in shared memory (at most
  limits().ht_max_tokens per rank, exported by the extension); a larger call
  lowers to the portable exchange, and its combine still runs on the kernel
  (the handle is the same either way)."""
  max_tokens = _extension.limits().ht_max_tokens
  tokens = max_tokens + past_limit
  big = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=tokens, num_topk=4,
                        fallback="allow")

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=big, capacity=64)
    return jax_ep.combine(d.x, d.handle, config=big)

  text = _lower_for_cuda(fn, ((2 * tokens, 256), jnp.bfloat16), ((2 * tokens, 4), jnp.int32),
                         ((2 * tokens, 4), jnp.float32), config=big)
  targets = _targets(_custom_calls(text))
  assert "jax_ep_ht_combine" in targets, targets
  if tokens <= max_tokens:
    assert "jax_ep_ht_dispatch" in targets, targets
  else:
    assert "jax_ep_ht_dispatch" not in targets and "all_to_all" in text, targets


def test_portable_payloads_stay_portable_on_cuda():
  """float32 rows have no LL kernel: the CUDA backend runs the portable path (jnp + all_to_all)."""
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=ALLOW)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=ALLOW)

  text = _lower_for_cuda(fn, ((16, 256), jnp.float32), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32), config=ALLOW)
  assert "all_to_all" in text and "jax_ep_ll_" not in text and "jax_ep_cpu_" not in text


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_dispatch_past_the_kernels_routing_limit_takes_the_portable_path(split):
  """The LL dispatch kernel holds every token's routing in shared memory (200 KB);
  a larger call lowers to the portable exchange, and its combine still runs on the
  kernel (the handle is the same either way)."""
  from jax_ep.backends import cuda as cuda_backend  # pylint: disable=import-outside-toplevel

  big = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=7000, num_topk=8,
                        low_latency_max_tokens_per_rank=7000, fallback="allow")
  assert not cuda_backend.ll_routing_fits(7000, big)
  assert cuda_backend.ll_routing_fits(6000, big)

  def fn(x, idx, w):
    if split:
      d = jax_ep.low_latency_dispatch_recv(
          jax_ep.low_latency_dispatch_send(x, idx, config=big), config=big)
    else:
      d = jax_ep.low_latency_dispatch(x, idx, config=big)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=big)

  text = _lower_for_cuda(fn, ((14000, 256), jnp.bfloat16), ((14000, 8), jnp.int32),
                         ((14000, 8), jnp.float32), config=big)
  targets = _targets(_custom_calls(text))
  assert "all_to_all" in text
  assert not any(t.startswith("jax_ep_ll_dispatch") for t in targets), targets
  assert "jax_ep_ll_combine" in targets, targets


def test_buffer_bytes_formula():
  config = jax_ep.EpConfig(num_experts=256, hidden=7168, max_tokens_per_rank=128, num_topk=8,
                           enable_high_throughput=False)
  ll = jax_ep.buffer_bytes(config, 2)
  assert 1.7e9 < ll < 2.0e9  # the same order as DeepEP's LL buffer at these sizes
  both = jax_ep.buffer_bytes(jax_ep.EpConfig(num_experts=256, hidden=7168,
                                             max_tokens_per_rank=128, num_topk=8), 2)
  assert both > ll
  module = _extension.cuda_module()
  if module is None:
    pytest.skip(f"CUDA extension not built: {_extension.cuda_module_status()}")
  for cfg in (config, jax_ep.EpConfig(num_experts=32, hidden=512, max_tokens_per_rank=64,
                                      num_topk=4),
              jax_ep.EpConfig(num_experts=64, hidden=1024, max_tokens_per_rank=4096, num_topk=8)):
    # One rank has scratch of its own (the one-rank dispatch's work taking).
    for num_ranks, rdma in ((1, False), (4, False), (4, True)):
      layout = module.buffer_layout(num_ranks, cfg.num_experts, cfg.hidden,
                                    cfg.max_tokens_per_rank, cfg.ll_max_tokens, cfg.num_topk,
                                    cfg.enable_low_latency, cfg.enable_high_throughput, rdma)
      assert layout["total"] == jax_ep.buffer_bytes(cfg, num_ranks, rdma_staging=rdma)


def test_split_ops_with_portable_payloads_lower_on_cuda():
  """float32 rows through the split LL ops take the portable path end to end."""
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch_recv(
        jax_ep.low_latency_dispatch_send(x, idx, config=ALLOW), config=ALLOW)
    sent = jax_ep.low_latency_combine_send(d.x, d.handle, config=ALLOW)
    return jax_ep.low_latency_combine_recv(sent, idx, w, config=ALLOW)

  text = _lower_for_cuda(fn, ((16, 256), jnp.float32), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32), config=ALLOW)
  assert "all_to_all" in text and "jax_ep_ll_" not in text


# ------------------------------------------------------------------ no silent fallback
def _ht_pair(config):
  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    return jax_ep.combine(d.x, d.handle, config=config)
  return fn


def _ll_pair(config):
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=config)
  return fn


# Each reason the CUDA backend takes the portable path: (config kwargs, op pair, x dtype,
# the reason's words in the error).
FALLBACK_CASES = {
    "ll_float32_rows": (dict(), _ll_pair, jnp.float32, "rows of dtype float32"),
    "ll_float16_rows": (dict(), _ll_pair, jnp.float16, "rows of dtype float16"),
    "ht_topk_over_32": (dict(num_experts=64, num_topk=33), _ht_pair, jnp.bfloat16,
                        "num_topk=33 > 32"),
    "ll_topk_over_32": (dict(num_experts=64, num_topk=33), _ll_pair, jnp.bfloat16,
                        "num_topk=33 > 32"),
    "ht_hidden_not_16_bytes": (dict(hidden=260), _ht_pair, jnp.bfloat16,
                               "hidden=260 is not a multiple of 8"),
    "ll_hidden_not_16_bytes": (dict(hidden=260), _ll_pair, jnp.bfloat16,
                               "hidden=260 is not a multiple of 8"),
    "ht_disabled": (dict(enable_high_throughput=False), _ht_pair, jnp.bfloat16,
                    "enable_high_throughput=False"),
    "ht_experts_per_rank_over_1024": (dict(num_experts=4096), _ht_pair, jnp.bfloat16,
                                      "2048 experts per rank > 1024"),
}


@pytest.mark.parametrize("case", sorted(FALLBACK_CASES))
def test_fallback_error_raises_at_trace_time_for_each_reason(case):
  kwargs, pair, dtype, reason = FALLBACK_CASES[case]
  config = jax_ep.EpConfig(**{**dict(num_experts=16, hidden=256, max_tokens_per_rank=8,
                                     num_topk=4), **kwargs}, fallback="error")
  k, h = config.num_topk, config.hidden
  with pytest.raises(jax_ep.EpConfigError, match=re.escape(reason)):
    _lower_for_cuda(pair(config), ((16, h), dtype), ((16, k), jnp.int32), ((16, k), jnp.float32),
                    config=config)
  # The same call with fallback="allow" lowers to the portable exchange.
  allowed = dataclasses.replace(config, fallback="allow")
  text = _lower_for_cuda(pair(allowed), ((16, h), dtype), ((16, k), jnp.int32),
                         ((16, k), jnp.float32), config=allowed)
  assert "all_to_all" in text


@pytest.mark.parametrize("case", ["ht_tokens", "ll_routing"])
def test_fallback_error_raises_for_the_size_limits(case):
  if case == "ht_tokens":
    config = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=65537, num_topk=4,
                             fallback="error")
    fn, tokens, reason = _ht_pair(config), 65537, "65537 tokens per rank > 65536"
  else:
    config = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=7000, num_topk=8,
                             low_latency_max_tokens_per_rank=7000, fallback="error")
    fn, tokens, reason = _ll_pair(config), 7000, "routing table"
  k = config.num_topk
  with pytest.raises(jax_ep.EpConfigError, match=re.escape(reason)):
    _lower_for_cuda(fn, ((2 * tokens, 256), jnp.bfloat16), ((2 * tokens, k), jnp.int32),
                    ((2 * tokens, k), jnp.float32), config=config)


def test_more_ranks_than_the_ht_kernels_serve_is_a_stated_reason():
  from jax_ep.backends import cuda as cuda_backend  # pylint: disable=import-outside-toplevel
  config = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4)
  reason, fix = cuda_backend.ht_unsupported(config, 16)
  assert "16 EP ranks" in reason and "at most 8" in fix
  assert cuda_backend.ht_unsupported(config, 8) is None


def test_fallback_warns_once_per_op_and_reason(caplog):
  config = dataclasses.replace(CONFIG, hidden=260)
  fallbacks.forget()
  with caplog.at_level(logging.WARNING):
    for _ in range(2):
      jax.clear_caches()
      _lower_for_cuda(_ll_pair(config), ((16, 260), jnp.bfloat16), ((16, 4), jnp.int32),
                      ((16, 4), jnp.float32), config=config)
  warnings = [r.getMessage() for r in caplog.records if "portable path" in r.getMessage()]
  # One per op (dispatch, combine), naming the reason and the fix, each once.
  assert len(warnings) == 2, warnings
  assert all("hidden=260" in w and "pad hidden" in w for w in warnings), warnings


def test_low_latency_ops_without_their_buffers_raise_at_trace_time():
  config = dataclasses.replace(CONFIG, enable_low_latency=False)
  with pytest.raises(jax_ep.EpConfigError, match="enable_low_latency=False"):
    _lower_for_cuda(_ll_pair(config), ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                    ((16, 4), jnp.float32), config=config)


def _targets_and_text(fn, config, x_dtype=jnp.bfloat16, num_ranks=2):
  mesh = jax.make_mesh((num_ranks,), ("ep",), devices=jax.devices()[:num_ranks])
  t, k, h = config.max_tokens_per_rank, config.num_topk, config.hidden
  shapes = (((num_ranks * t, h), x_dtype), ((num_ranks * t, k), jnp.int32),
            ((num_ranks * t, k), jnp.float32))
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("ep"))) for s, d in shapes]
  with lowering_only(config, mesh, backend="cuda"):
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    text = mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return _targets(_custom_calls(text)), text


def test_float32_combine_and_its_gradient_run_only_jax_ep_kernels():
  """The mixed-precision case: bf16 rows dispatched, float32 expert outputs combined,
  gradients of x and topk_weights: every exchange is a jax_ep kernel (no all_to_all,
  no all_gather, no CPU handler)."""
  config = dataclasses.replace(CONFIG, fallback="error")

  def fn(x, idx, w):
    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      y = d.x.astype(jnp.float32) * jnp.sum(d.topk_weights, axis=1, keepdims=True)
      out = jax_ep.combine(y, d.handle, config=config)
      assert out.dtype == jnp.float32
      return jnp.sum(out * out)
    return jax.grad(loss, argnums=(0, 1))(x, w)

  targets, text = _targets_and_text(fn, config)
  assert set(targets) == {"jax_ep_ht_dispatch", "jax_ep_ht_combine"}, targets
  for word in ("all_to_all", "all_gather", "all_reduce", "jax_ep_cpu_"):
    assert word not in text, word
  # The float32 combine's row type and width reach the kernel as is.
  combines = [c for c in _custom_calls(text) if "@jax_ep_ht_combine" in c]
  assert any("tensor<16x256xf32>" in c for c in combines), combines


@pytest.mark.parametrize("num_topk", [1, 2])
def test_combine_backward_with_more_ranks_than_topk_runs_on_the_kernel(num_topk):
  """R = 4 > K: the cached routing lists each token's kept ranks in its K entries."""
  config = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8,
                           num_topk=num_topk, fallback="error", debug_checks=False)

  def fn(x, idx, w):
    def loss(x):
      d = jax_ep.dispatch(x, idx, w, config=config)
      return jnp.sum(jax_ep.combine(d.x, d.handle, config=config).astype(jnp.float32) ** 2)
    return jax.grad(loss)(x)

  targets, text = _targets_and_text(fn, config, num_ranks=4)
  assert sorted(targets) == ["jax_ep_ht_combine", "jax_ep_ht_combine", "jax_ep_ht_dispatch",
                             "jax_ep_ht_dispatch"], targets
  assert "all_to_all" not in text


def test_low_latency_backward_runs_on_the_kernels():
  """LL combine's backward: one weighted dispatch (the pair weights ride in the
  headers) and one values-only combine; the dispatch's backward: one combine."""
  config = dataclasses.replace(CONFIG, fallback="error")

  def fn(x, idx, w):
    def loss(x, w):
      d = jax_ep.low_latency_dispatch(x, idx, config=config)
      y = jnp.tanh(d.x.astype(jnp.float32)).astype(jnp.bfloat16)
      out = jax_ep.low_latency_combine(y, idx, w, d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1))(x, w)

  targets, text = _targets_and_text(fn, config)
  assert sorted(targets) == ["jax_ep_ll_combine", "jax_ep_ll_combine", "jax_ep_ll_combine",
                             "jax_ep_ll_dispatch", "jax_ep_ll_dispatch"], targets
  for word in ("all_to_all", "all_gather", "jax_ep_cpu_"):
    assert word not in text, word
  calls = _custom_calls(text)
  weighted = [c for c in calls if "@jax_ep_ll_dispatch" in c and "tensor<8x4xf32>) ->" in c]
  assert len(weighted) == 1, calls  # the backward's dispatch carries the weights
  values_only = [c for c in calls if "@jax_ep_ll_combine" in c and "x0xbf16>" in c]
  assert len(values_only) == 1, calls  # and one combine returns values, no rows


def test_default_memory_of_the_readme_config():
  """DeepEP's HT setting (T=4096, H=7168, E=256, K=8): both families fit in 4 GiB per
  GPU at R=8 because the LL buffers have their own token cap (128)."""
  config = jax_ep.EpConfig(num_experts=256, hidden=7168, max_tokens_per_rank=4096, num_topk=8)
  for num_ranks in (2, 8):
    assert jax_ep.buffer_bytes(config, num_ranks) <= 4 * 2**30
  families = jax_ep.buffers.buffer_bytes_by_family(config, 8)
  assert families["low_latency"] < 2 * 2**30 and families["high_throughput"] < 1.5 * 2**30


@pytest.mark.parametrize("axes,partial", [("expert", False), (("data", "expert"), False),
                                          ("expert", True)])
def test_ep_groups_lower_to_the_kernels_with_the_group_size(axes, partial):
  """A (2, 4) mesh: the config attribute carries R = the group's size (4, or 8 for
  both axes); a shard_map over the EP axis alone runs the kernels per group too."""
  mesh = jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices()[:8])
  num_ranks = 8 if isinstance(axes, tuple) else 4
  config = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4,
                           group=jax_ep.EpGroup(axis_name=axes), fallback="error")

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    return (jax_ep.combine(d.x, d.handle, config=config),
            jax_ep.low_latency_combine(ll.x, idx, w, ll.handle, config=config))

  spec = P("expert") if partial else P(("data", "expert"))
  shapes = (((64, 256), jnp.bfloat16), ((64, 4), jnp.int32), ((64, 4), jnp.float32))
  sharding = NamedSharding(mesh, P(("data", "expert")))
  args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes]
  with lowering_only(config, mesh, backend="cuda"):
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                   axis_names={"expert"} if partial else {"data", "expert"}))
    text = mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  calls = _custom_calls(text)
  assert sorted(_targets(calls)) == ["jax_ep_ht_combine", "jax_ep_ht_dispatch",
                                     "jax_ep_ll_combine", "jax_ep_ll_dispatch"], _targets(calls)
  for call in calls:
    assert _attr(call, "num_ranks") == f"{num_ranks} : i64", call
  assert "all_to_all" not in text and "all_gather" not in text


# ------------------------------------------------------------------ expert-major layout
def _expert_major_layer(config, alignment=8):
  def fn(x, idx, w):
    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, config=config, layout="expert_major",
                          expert_alignment=alignment)
      y = d.x * d.topk_weights[:, None].astype(d.x.dtype)
      return jnp.sum(jax_ep.combine(y, d.handle, config=config).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1))(x, w)
  return fn


def _operands(call: str) -> list[str]:
  """The SSA operands of a call from _custom_calls (the status token left out)."""
  return [o.strip() for o in re.search(r"@\w+\(([^)]*)\)", call).group(1).split(",")]


def _result_name(call: str) -> str:
  return re.match(r"\s*(%[\w#]+)(?::\d+)? = ", call).group(1)


# The expert-major dispatch kernel's results at CONFIG, R = 2, A = 8: M = 2*8*4 + 8*7
# = 120 pair rows, C = R*T = 16 staging rows; x, scales, pair_expert, pair_weight,
# pair_src, num_pairs, tokens_per_expert, group_sizes, num_dropped, num_invalid,
# recv_src, send_row, num_tokens, slot_row, rows_by_expert.
def _expert_major_results(x_type="bf16", scales="tensor<120x0xf32>"):
  return (f"-> (tensor<120x256x{x_type}>, {scales}, tensor<120xi32>, tensor<120xf32>, "
          "tensor<120xi32>, tensor<i32>, tensor<8xi32>, tensor<8xi32>, tensor<i32>, tensor<i32>, "
          "tensor<16xi32>, tensor<8x2xi32>, tensor<i32>, tensor<16x4xi32>, tensor<16x4xi32>)")


@pytest.mark.parametrize("fallback", ["warn", "error"])
def test_expert_major_layer_runs_on_the_expert_major_kernels(caplog, fallback):
  """The kernels write and read the pair rows: the forward dispatch and combine,
  the dispatch's row gradient (an expert-major combine of the rows' cotangent),
  the combine's backward (the expert-major dispatch again, on the forward's
  routing with zero weights) and the weight gradient (per-slot values of the
  pair cotangents, then the token-major combine of those [C, K] values) are
  jax_ep kernels; no XLA collective, no warning, also under fallback="error"."""
  fallbacks.forget()
  config = dataclasses.replace(CONFIG, fallback=fallback)
  jax.clear_caches()
  with caplog.at_level(logging.WARNING):
    targets, text = _targets_and_text(_expert_major_layer(config), config)
  assert sorted(targets) == ["jax_ep_ht_combine", "jax_ep_ht_combine_expert_major",
                             "jax_ep_ht_combine_expert_major", "jax_ep_ht_dispatch_expert_major",
                             "jax_ep_ht_dispatch_expert_major", "jax_ep_ht_slot_values"], targets
  for word in ("all_to_all", "all_gather", "all_reduce", "jax_ep_cpu_"):
    assert word not in text, word
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  calls = _custom_calls(text)
  for call in calls:
    assert "has_side_effect = true" in call and _attr(call, "num_ranks") == "2 : i64", call
  dispatches = [c for c in calls if "@jax_ep_ht_dispatch_expert_major(" in c]
  forward, backward = dispatches
  for call in dispatches:
    # x, no scales, topk_idx, topk_weights -> the pair rows and tables.
    assert ("(tensor<8x256xbf16>, tensor<8x0xf32>, tensor<8x4xi32>, tensor<8x4xf32>) "
            + _expert_major_results()) in call, call
    assert _attr(call, "capacity") == "16 : i64"
    assert _attr(call, "num_rows") == "120 : i64"
    assert _attr(call, "alignment") == "8 : i64"
  # Combine's backward: the forward's topk_idx operand (the handle's), the
  # cotangent rows in x's place.
  assert _operands(backward)[2] == _operands(forward)[2], (forward, backward)
  assert _operands(backward)[0] != _operands(forward)[0]
  made = _result_name(forward)
  combines = [c for c in calls if "@jax_ep_ht_combine_expert_major(" in c]
  for call in combines:  # y [M, H], rows_by_expert, recv_src, send_row, num_tokens
    assert ("(tensor<120x256xbf16>, tensor<16x4xi32>, tensor<16xi32>, tensor<8x2xi32>, "
            "tensor<i32>) -> tensor<8x256xbf16>") in call, call
    assert _operands(call)[1:] == [f"{made}#14", f"{made}#10", f"{made}#11", f"{made}#12"], call
    assert _attr(call, "capacity") == "16 : i64"
  (slots,) = [c for c in calls if "@jax_ep_ht_slot_values(" in c]
  assert "(tensor<120xf32>, tensor<16x4xi32>) -> tensor<16x4xf32>" in slots, slots
  assert _operands(slots)[1] == f"{made}#13", slots
  assert "capacity" not in slots
  (weights,) = [c for c in calls if "@jax_ep_ht_combine(" in c]
  assert _operands(weights) == [_result_name(slots), f"{made}#10", f"{made}#11", f"{made}#12"]
  assert ("(tensor<16x4xf32>, tensor<16xi32>, tensor<8x2xi32>, tensor<i32>) -> "
          "tensor<8x4xf32>") in weights, weights


@pytest.mark.parametrize("scale_dtype", [None, jnp.float32, jnp.float8_e8m0fnu])
def test_expert_major_dispatch_lowers_its_payloads_like_the_token_major_one(scale_dtype):
  """bf16 rows, or FP8 rows with float32 or e8m0 scales: the scale operand is the
  token-major dispatch's (zero columns without FP8; e8m0 padded to whole 4-byte
  words), the pair rows keep x's dtype, and the scales come back cut to the
  caller's columns."""
  config = dataclasses.replace(CONFIG, fallback="error")

  def fn(x, idx, w):
    payload = x if scale_dtype is None else jax_ep.fp8.quantize(
        x, round_scale=scale_dtype != jnp.float32, scale_dtype=scale_dtype)
    d = jax_ep.dispatch(payload, idx, w, config=config, layout="expert_major",
                        expert_alignment=8)
    return d.x, d.scales if scale_dtype is not None else d.x[:, :0], d.group_sizes

  text = _lower_for_cuda(fn, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32), config=config)
  (call,) = _custom_calls(text)
  assert _targets([call]) == ["jax_ep_ht_dispatch_expert_major"]
  if scale_dtype is None:
    operands, x_type, scales = "tensor<8x256xbf16>, tensor<8x0xf32>", "bf16", "tensor<120x0xf32>"
  elif scale_dtype == jnp.float32:
    operands = "tensor<8x256xf8E4M3FN>, tensor<8x2xf32>"
    x_type, scales = "f8E4M3FN", "tensor<120x2xf32>"
  else:
    operands = "tensor<8x256xf8E4M3FN>, tensor<8x4xf8E8M0FNU>"
    x_type, scales = "f8E4M3FN", "tensor<120x4xf8E8M0FNU>"
    assert re.search(r"tensor<(1x)?120x2xf8E8M0FNU>", text.split("jax_ep_ht_dispatch_expert_major")
                     [-1]), text[-2000:]
  assert (f"({operands}, tensor<8x4xi32>, tensor<8x4xf32>) "
          + _expert_major_results(x_type, scales)) in call, call
  assert "all_to_all" not in text


def test_expert_major_ops_the_kernels_cannot_run_take_the_portable_path():
  """hidden not a multiple of 8: the expert-major dispatch and combine take the
  portable path, announced (an error under fallback="error")."""
  odd = jax_ep.EpConfig(num_experts=16, hidden=252, max_tokens_per_rank=8, num_topk=4,
                        fallback="allow")
  targets, text = _targets_and_text(_expert_major_layer(odd), odd)
  assert not any("expert_major" in t or "slot_values" in t for t in targets), targets
  assert "all_to_all" in text
  strict = dataclasses.replace(odd, fallback="error")
  with pytest.raises(jax_ep.EpConfigError, match="pad hidden"):
    _targets_and_text(_expert_major_layer(strict), strict)


# ------------------------------------------------------------------ LL weights at the dispatch
def test_low_latency_dispatch_with_weights_carries_them_on_the_kernel():
  """topk_weights given to the dispatch travel in the kernel's pair headers (its
  weights result, [E_local, R*T_ll]); the pre-summed combine takes them to its
  own kernel (row_weights operand, topk_weights [T, 0]), one-call and split,
  with no portable exchange, also under fallback="error"."""
  def dispatch_only(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=CONFIG, topk_weights=w)
    return d.x, d.weights

  text = _lower_for_cuda(dispatch_only, ((16, 256), jnp.bfloat16), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  calls = _custom_calls(text)
  assert _targets(calls) == ["jax_ep_ll_dispatch"]
  assert "(tensor<8x256xbf16>, tensor<8x4xi32>, tensor<8x4xf32>) ->" in calls[0], calls[0]
  assert "tensor<8x16xf32>, tensor<i32>)" in calls[0], calls[0]  # the rows' weights
  assert "all_to_all" not in text

  def presummed(config, split):
    def fn(x, idx, w):
      if not split:
        d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
        return jax_ep.low_latency_combine(d.x, idx, None, d.handle, config=config)
      pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, topk_weights=w)
      d = jax_ep.low_latency_dispatch_recv(pending, config=config)
      sent = jax_ep.low_latency_combine_send(d.x, d.handle, config=config)
      return jax_ep.low_latency_combine_recv(sent, idx, None, config=config)
    return fn

  strict = dataclasses.replace(CONFIG, fallback="error")
  for split, targets in ((False, ["jax_ep_ll_dispatch", "jax_ep_ll_combine"]),
                         (True, ["jax_ep_ll_dispatch_send", "jax_ep_ll_dispatch_recv",
                                 "jax_ep_ll_combine_send", "jax_ep_ll_combine_recv"])):
    text = _lower_for_cuda(presummed(strict, split), ((16, 256), jnp.bfloat16),
                           ((16, 4), jnp.int32), ((16, 4), jnp.float32), config=strict)
    calls = _custom_calls(text)
    assert _targets(calls) == targets, _targets(calls)
    assert "all_to_all" not in text
    if split:  # the weights at the dispatch's send; its recv returns the rows' weights,
      # which the combine's send takes; no weights at the combine's recv
      assert "(tensor<8x256xbf16>, tensor<8x4xi32>, tensor<8x4xf32>) ->" in calls[0], calls[0]
      assert "tensor<8x16xi32>, tensor<8x16xf32>)" in calls[1], calls[1]
      assert ("(tensor<8x16x256xbf16>, tensor<8x16xf32>, tensor<8x16xi32>, tensor<8xi32>) ->"
              in calls[2]), calls[2]
      assert "(tensor<i32>, tensor<8x4xi32>, tensor<8x0xf32>) ->" in calls[3], calls[3]
    else:  # rows, no row values, row_weights, recv_src, count, topk_idx, no topk_weights
      assert ("(tensor<8x16x256xbf16>, tensor<8x0xf32>, tensor<8x16xf32>, tensor<8x16xi32>, "
              "tensor<8xi32>, tensor<8x4xi32>, tensor<8x0xf32>) ->" in calls[1]), calls[1]


# ------------------------------------------------------------------ several configs
def test_each_call_of_two_configs_lowers_with_its_own_config():
  """initialize((a, b)): one program with the HT and LL ops of both configs;
  every custom call's config attribute is its own config's (the dims its kernel
  runs with), and its shapes agree with it."""
  a = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4,
                      fallback="error")
  b = jax_ep.EpConfig(num_experts=8, hidden=128, max_tokens_per_rank=4, num_topk=2,
                      low_latency_max_tokens_per_rank=2, fallback="error")
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])

  def round_trips(config):
    def fn(x, idx, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      ll = jax_ep.low_latency_dispatch(x[:config.ll_max_tokens], idx[:config.ll_max_tokens],
                                       config=config)
      return (jax_ep.combine(d.x, d.handle, config=config),
              jax_ep.low_latency_combine(ll.x, idx[:config.ll_max_tokens],
                                         w[:config.ll_max_tokens], ll.handle, config=config))
    return fn

  def both(xa, ia, wa, xb, ib, wb):
    return round_trips(a)(xa, ia, wa), round_trips(b)(xb, ib, wb)

  shapes = []
  for c in (a, b):
    t = 2 * c.max_tokens_per_rank
    shapes += [((t, c.hidden), jnp.bfloat16), ((t, c.num_topk), jnp.int32),
               ((t, c.num_topk), jnp.float32)]
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("ep"))) for s, d in shapes]
  with lowering_only((a, b), mesh, backend="cuda"):
    mapped = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    text = mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "all_to_all" not in text and "jax_ep_cpu_" not in text
  calls = _custom_calls(text)
  by_hidden = {a.hidden: a, b.hidden: b}
  seen = {a: [], b: []}
  for call in calls:
    config = by_hidden[int(_attr(call, "hidden").split()[0])]
    for name, value in jax_ep.backends.cuda.config_attr(config, 2).items():
      assert _attr(call, name) == f"{int(value)} : i64", (name, call)
    seen[config].append(_targets([call])[0])
    # Its operands and results are its config's shapes.
    e_local, rows = config.num_experts // 2, 2 * config.ll_max_tokens
    if "@jax_ep_ll_dispatch" in call:
      assert f"(tensor<{config.ll_max_tokens}x{config.hidden}xbf16>, " \
             f"tensor<{config.ll_max_tokens}x{config.num_topk}xi32>," in call, call
      assert f"-> (tensor<{e_local}x{rows}x{config.hidden}xbf16>" in call, call
    if "@jax_ep_ht_dispatch" in call:
      assert f"(tensor<{config.max_tokens_per_rank}x{config.hidden}xbf16>, " in call, call
      assert f"-> (tensor<{2 * config.max_tokens_per_rank}x{config.hidden}xbf16>" in call, call
  for config in (a, b):
    assert sorted(seen[config]) == ["jax_ep_ht_combine", "jax_ep_ht_dispatch",
                                    "jax_ep_ll_combine", "jax_ep_ll_dispatch"], seen
