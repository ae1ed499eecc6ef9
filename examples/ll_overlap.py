"""A decoding step that overlaps communication with compute (low-latency ops, split).

DeepSeek-style MoE block: a shared expert that every token goes through plus
routed experts. The routed tokens travel with low_latency_dispatch_send /
low_latency_dispatch_recv and come back with low_latency_combine_send /
low_latency_combine_recv; the shared expert runs between the send and the recv
of the dispatch, and the next block's norm between those of the combine, so
XLA can schedule them while the rows are on the wire (the halves are separate
custom calls tied only by a data dependency). The result is checked against
the same step written with the one-call ops.

Run:  python examples/ll_overlap.py            (no GPU: 8 CPU devices, portable backend)
      python -m jax_ep.launch -n 2 examples/ll_overlap.py   (GPUs: one process each)
"""

from __future__ import annotations

import functools
import sys

import _devices

if __name__ == "__main__":
  _devices.set_up()

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import launch  # noqa: E402

flags.DEFINE_integer("tokens_per_rank", 32, "decoding batch per rank")
flags.DEFINE_integer("hidden", 512, "model width (a multiple of 128)")
flags.DEFINE_integer("experts_per_rank", 4, "routed experts per rank")
flags.DEFINE_integer("topk", 4, "routed experts per token")
flags.DEFINE_bool("fp8", False, "FP8 dispatch")


def routed_experts(w_in, rows):
  """One weight matrix per local expert: [E_local, R*T, H] -> same shape."""
  return jnp.einsum("erh,ehk->erk", rows.astype(jnp.float32), w_in).astype(jnp.bfloat16)


def step(params, x, config, use_fp8: bool, split: bool):
  logits = x.astype(jnp.float32) @ params["router"]
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits), config.num_topk)
  idx = idx.astype(jnp.int32)
  if split:
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, use_fp8=use_fp8)
    shared = jax.nn.gelu(x.astype(jnp.float32) @ params["shared"])   # while rows travel
    d = jax_ep.low_latency_dispatch_recv(pending, config=config)
  else:
    d = jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8)
    shared = jax.nn.gelu(x.astype(jnp.float32) @ params["shared"])
  rows = (jax_ep.fp8.dequantize(d.x, d.scales, jnp.bfloat16) if use_fp8 else d.x)
  y = routed_experts(params["experts"], rows)
  if split:
    sent = jax_ep.low_latency_combine_send(y, d.handle, config=config)
    norm = jax.lax.rsqrt(jnp.mean(shared * shared, axis=-1, keepdims=True) + 1e-6)
    routed = jax_ep.low_latency_combine_recv(sent, idx, weights, config=config)
  else:
    routed = jax_ep.low_latency_combine(y, idx, weights, d.handle, config=config)
    norm = jax.lax.rsqrt(jnp.mean(shared * shared, axis=-1, keepdims=True) + 1e-6)
  return ((shared * norm) + routed.astype(jnp.float32)).astype(jnp.bfloat16)


def main(argv):
  del argv
  launch.initialize_distributed_from_env()
  f = flags.FLAGS
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  num_ranks = mesh.shape["ep"]
  num_experts = f.experts_per_rank * num_ranks
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=f.hidden,
                           max_tokens_per_rank=f.tokens_per_rank, num_topk=f.topk,
                           enable_high_throughput=False)
  jax_ep.initialize(config, mesh)
  rng = np.random.default_rng(0)
  h = f.hidden
  params = {"router": rng.standard_normal((h, num_experts)).astype(np.float32),
            "shared": (rng.standard_normal((h, h)) / np.sqrt(h)).astype(np.float32),
            "experts": (rng.standard_normal((num_experts, h, h)) / np.sqrt(h)).astype(np.float32)}
  specs = {"router": P(), "shared": P(), "experts": P("ep")}
  put = lambda a, spec: jax.make_array_from_callback(  # noqa: E731
      a.shape, NamedSharding(mesh, spec), lambda i: a[i])
  params = {k: put(v, specs[k]) for k, v in params.items()}
  x = put(rng.standard_normal((num_ranks * f.tokens_per_rank, h)).astype(jnp.bfloat16), P("ep"))

  def run(split):
    fn = jax.jit(jax.shard_map(functools.partial(step, config=config, use_fp8=f.fp8, split=split),
                               mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
    return fn(params, x)

  overlapped, reference = run(True), run(False)
  local = lambda a: np.asarray(a.addressable_shards[0].data, np.float32)  # noqa: E731
  err = float(np.max(np.abs(local(overlapped) - local(reference))))
  print(f"backend {jax_ep.runtime_state().backend_name}: overlapped step vs one-call ops, "
        f"max |diff| = {err:.3e}")
  jax_ep.finalize()
  if err != 0.0:
    print("MISMATCH")
    sys.exit(1)
  print("OK")


if __name__ == "__main__":
  app.run(main)
