"""What the CUDA backend lowers to, checked on CPU: its FFI custom calls with
the expected attributes, side effects and operand order; plus the buffer sizing
formula against the CUDA extension where it was built."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import _extension
from jax_ep.runtime import lowering_only

CONFIG = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=8, num_topk=4)


def _lower_for_cuda(fn, *shapes, config=CONFIG):
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("ep"))) for s, d in shapes]
  with lowering_only(config, mesh, backend="cuda"):
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    return mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text: str) -> list[str]:
  return [line for line in text.splitlines() if "stablehlo.custom_call" in line]


def _targets(calls: list[str]) -> list[str]:
  return [re.search(r"@(\w+)", c).group(1) for c in calls]


def _attr(line: str, name: str) -> str:
  match = re.search(rf"{name} = ([^,}}]+)", line)
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
    assert _attr(call, "num_experts") == "16 : i64"
    assert _attr(call, "hidden") == "256 : i64"
    assert _attr(call, "max_tokens") == "8 : i64"
    assert _attr(call, "num_topk") == "4 : i64"
    assert _attr(call, "num_ranks") == "2 : i64"
  assert _attr(calls[0], "use_fp8") == ("true" if use_fp8 else "false")
  # The dispatch's results: x [E_local, R*T, H], scales, count, recv_src, num_invalid.
  x_type = "f8E4M3FN" if use_fp8 else "bf16"
  scales = "tensor<8x16x2xf32>" if use_fp8 else "tensor<8x16x0xf32>"
  assert f"-> (tensor<8x16x256x{x_type}>, {scales}, tensor<8xi32>, tensor<8x16xi32>, " \
         "tensor<i32>)" in calls[0], calls[0]
  # The combine's operands: rows, recv_src, count, topk_idx, topk_weights.
  assert ("(tensor<8x16x256xbf16>, tensor<8x16xi32>, tensor<8xi32>, tensor<8x4xi32>, "
          "tensor<8x4xf32>) -> tensor<8x256xbf16>") in calls[1], calls[1]
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
  assert "-> (tensor<i32>, tensor<i32>)" in calls[0]
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


@pytest.mark.parametrize("tokens", [65536, 65537])
def test_high_throughput_dispatch_past_the_kernels_token_limit_takes_the_portable_path(tokens):
  """The HT dispatch kernel keeps a byte per token in shared memory (at most
  HT_MAX_TOKENS = 65536 per rank); a larger call lowers to the portable exchange,
  and its combine still runs on the kernel (the handle is the same either way)."""
  from jax_ep.backends import cuda as cuda_backend  # pylint: disable=import-outside-toplevel

  assert cuda_backend.HT_MAX_TOKENS == 65536
  big = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=tokens, num_topk=4)

  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=big, capacity=64)
    return jax_ep.combine(d.x, d.handle, config=big)

  text = _lower_for_cuda(fn, ((2 * tokens, 256), jnp.bfloat16), ((2 * tokens, 4), jnp.int32),
                         ((2 * tokens, 4), jnp.float32), config=big)
  targets = _targets(_custom_calls(text))
  assert "jax_ep_ht_combine" in targets, targets
  if tokens <= cuda_backend.HT_MAX_TOKENS:
    assert "jax_ep_ht_dispatch" in targets, targets
  else:
    assert "jax_ep_ht_dispatch" not in targets and "all_to_all" in text, targets


def test_portable_payloads_stay_portable_on_cuda():
  """float32 rows have no kernel: the CUDA backend runs the portable path (jnp + all_to_all)."""
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch(x, idx, config=CONFIG)
    return jax_ep.low_latency_combine(d.x, idx, w, d.handle, config=CONFIG)

  text = _lower_for_cuda(fn, ((16, 256), jnp.float32), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  assert "all_to_all" in text and "jax_ep_ll_" not in text and "jax_ep_cpu_" not in text


@pytest.mark.parametrize("split", [False, True])
def test_low_latency_dispatch_past_the_kernels_routing_limit_takes_the_portable_path(split):
  """The LL dispatch kernel holds every token's routing in shared memory (200 KB);
  a larger call lowers to the portable exchange, and its combine still runs on the
  kernel (the handle is the same either way)."""
  from jax_ep.backends import cuda as cuda_backend  # pylint: disable=import-outside-toplevel

  big = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=7000, num_topk=8)
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
                                      num_topk=4)):
    for rdma in (False, True):
      layout = module.buffer_layout(4, cfg.num_experts, cfg.hidden, cfg.max_tokens_per_rank,
                                    cfg.num_topk, cfg.enable_low_latency,
                                    cfg.enable_high_throughput, rdma)
      assert layout["total"] == jax_ep.buffer_bytes(cfg, 4, rdma_staging=rdma)


def test_split_ops_with_portable_payloads_lower_on_cuda():
  """float32 rows through the split LL ops take the portable path end to end."""
  def fn(x, idx, w):
    d = jax_ep.low_latency_dispatch_recv(
        jax_ep.low_latency_dispatch_send(x, idx, config=CONFIG), config=CONFIG)
    sent = jax_ep.low_latency_combine_send(d.x, d.handle, config=CONFIG)
    return jax_ep.low_latency_combine_recv(sent, idx, w, config=CONFIG)

  text = _lower_for_cuda(fn, ((16, 256), jnp.float32), ((16, 4), jnp.int32),
                         ((16, 4), jnp.float32))
  assert "all_to_all" in text and "jax_ep_ll_" not in text
