"""A top-k routed MoE layer on jax_ep, one training step, checked against a dense layer.

Each rank of the ``ep`` mesh axis holds E/R experts (a two-layer GELU MLP each).
A step: router -> top-k -> jax_ep.dispatch -> per-expert MLP with
jax.lax.ragged_dot over the received rows grouped by local expert ->
jax_ep.combine -> loss; jax.grad differentiates through all of it. The same
layer computed densely on one device (every expert on every token, then the
top-k mix) gives the reference for the output, the loss and the gradients.

Run:  python examples/moe_layer.py            (no GPU: 8 CPU devices, portable backend)
      python -m jax_ep.launch -n 2 examples/moe_layer.py   (GPUs: one process each)
"""

from __future__ import annotations

import functools
import sys

import _cpu_default

if __name__ == "__main__":
  _cpu_default.use_cpu_devices_without_gpu()

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import launch  # noqa: E402

FLAGS = flags.DEFINE_integer("tokens_per_rank", 64, "tokens on each rank")
flags.DEFINE_integer("hidden", 128, "model width H")
flags.DEFINE_integer("ffn", 256, "expert MLP width")
flags.DEFINE_integer("experts_per_rank", 4, "experts held by each rank")
flags.DEFINE_integer("topk", 2, "experts per token")
flags.DEFINE_float("learning_rate", 0.1, "SGD step size")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_string("dtype", "float32", "activation dtype: float32 or bfloat16")


def router(params, x, num_topk):
  """Softmax router: (topk_idx int32[T, K], topk_weights f32[T, K]) renormalised over the top-k."""
  logits = x.astype(jnp.float32) @ params["router"]
  weights, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), num_topk)
  return idx.astype(jnp.int32), weights / jnp.sum(weights, axis=-1, keepdims=True)


def experts_on_rows(w1, w2, rows, local_idx, weights):
  """Applies this rank's experts to the received rows.

  rows [C, H]; local_idx int32[C, K] (-1: expert elsewhere); weights f32[C, K].
  Each (row, k) pair with a local expert is sorted by expert and run through
  ragged_dot; results are weighted and summed back per row -> [C, H].
  """
  num_rows, num_topk = local_idx.shape
  num_local = w1.shape[0]
  pair_expert = jnp.where(local_idx >= 0, local_idx, num_local).reshape(-1)
  order = jnp.argsort(pair_expert, stable=True)
  pair_row = (jnp.arange(num_rows * num_topk) // num_topk)[order]
  group_sizes = jnp.bincount(pair_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
  h = jax.lax.ragged_dot(rows[pair_row], w1, group_sizes)
  y = jax.lax.ragged_dot(jax.nn.gelu(h).astype(rows.dtype), w2, group_sizes)
  pair_weight = jnp.where(local_idx >= 0, weights, 0.0).reshape(-1)[order]
  y = y.astype(jnp.float32) * pair_weight[:, None]
  return jnp.zeros((num_rows, rows.shape[1]), jnp.float32).at[pair_row].add(y).astype(rows.dtype)


def moe_ep(params, x, config):
  """Per-shard MoE layer (inside shard_map over 'ep'); also returns routing stats."""
  idx, weights = router(params, x, config.num_topk)
  d = jax_ep.dispatch(x, idx, weights, config=config)
  y = experts_on_rows(params["w1"], params["w2"], d.x, d.topk_idx, d.topk_weights)
  out = jax_ep.combine(y, d.handle, config=config)
  stats = dict(tokens_per_expert=d.tokens_per_expert, received=d.num_tokens[None],
               dropped=d.num_dropped[None])
  return out, idx, stats


def moe_dense(params, x, num_topk):
  """The same layer on one device: every expert on every token, then the top-k mix."""
  idx, weights = router(params, x, num_topk)
  h = jax.nn.gelu(jnp.einsum("th,ehf->etf", x, params["w1"])).astype(x.dtype)
  all_out = jnp.einsum("etf,efh->eth", h, params["w2"]).astype(jnp.float32)   # [E, T, H]
  picked = all_out[idx, jnp.arange(x.shape[0])[:, None]]                       # [T, K, H]
  return jnp.sum(picked * weights[..., None], axis=1).astype(x.dtype), idx


def loss_fn(out, target):
  return jnp.mean((out.astype(jnp.float32) - target) ** 2)


def main(argv):
  del argv
  launch.initialize_distributed_from_env()
  dtype = jnp.dtype(flags.FLAGS.dtype)
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  num_ranks = mesh.shape["ep"]
  t, h, f = flags.FLAGS.tokens_per_rank, flags.FLAGS.hidden, flags.FLAGS.ffn
  num_experts = flags.FLAGS.experts_per_rank * num_ranks
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=h, max_tokens_per_rank=t,
                           num_topk=flags.FLAGS.topk)
  jax_ep.initialize(config, mesh)
  state = jax_ep.runtime_state()
  print(f"jax_ep backend: {state.backend_name}; {num_ranks} ranks on {jax.devices()[0].platform}; "
        f"E={num_experts} K={config.num_topk} H={h} ffn={f} tokens/rank={t} dtype={dtype.name}")

  rng = np.random.default_rng(flags.FLAGS.seed)
  params = {
      "router": rng.standard_normal((h, num_experts)).astype(np.float32) / np.sqrt(h),
      "w1": (rng.standard_normal((num_experts, h, f)) / np.sqrt(h)).astype(dtype),
      "w2": (rng.standard_normal((num_experts, f, h)) / np.sqrt(f)).astype(dtype),
  }
  x = rng.standard_normal((num_ranks * t, h)).astype(dtype)
  target = rng.standard_normal((num_ranks * t, h)).astype(np.float32)
  specs = {"router": P(), "w1": P("ep"), "w2": P("ep")}
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  x_s = jax.device_put(x, NamedSharding(mesh, P("ep")))
  target_s = jax.device_put(target, NamedSharding(mesh, P("ep")))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                     out_specs=(P("ep"), P("ep"), P("ep")))
  def layer(params, x):
    return moe_ep(params, x, config)

  @jax.jit
  def train_step(params, x, target):
    def loss(params):
      out, idx, stats = layer(params, x)
      return loss_fn(out, target), (out, idx, stats)
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
    new_params = jax.tree.map(lambda p, g: (p - flags.FLAGS.learning_rate * g).astype(p.dtype),
                              params, grads)
    return value, aux, grads, new_params

  with jax.set_mesh(mesh):
    value, (out, idx, stats), grads, new_params = train_step(params, x_s, target_s)
    new_value = train_step(new_params, x_s, target_s)[0]

  # Dense single-device reference of the same step.
  dense_params = {k: np.asarray(v) for k, v in params.items()}
  cpu = jax.local_devices(backend="cpu")[0] if jax.devices()[0].platform != "cpu" else None

  def dense_loss(p):
    out_d, idx_d = moe_dense(p, jnp.asarray(x), config.num_topk)
    return loss_fn(out_d, jnp.asarray(target)), (out_d, idx_d)

  with jax.default_device(cpu) if cpu else jax.default_device(jax.devices()[0]):
    (dense_value, (dense_out, dense_idx)), dense_grads = jax.jit(
        jax.value_and_grad(dense_loss, has_aux=True))(dense_params)

  tokens_per_expert = np.asarray(stats["tokens_per_expert"]).reshape(-1)
  received = np.asarray(stats["received"])
  print("routing: tokens per expert", tokens_per_expert.tolist())
  print(f"routing: rows received per rank {received.tolist()} (capacity {num_ranks * t}), "
        f"dropped {int(np.sum(stats['dropped']))}, expert load max/mean "
        f"{tokens_per_expert.max() / max(tokens_per_expert.mean(), 1e-9):.2f}")
  same_routing = bool(np.all(np.asarray(idx) == np.asarray(dense_idx)))
  out_err = float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(dense_out, np.float32))))
  grad_err = max(float(np.max(np.abs(np.asarray(grads[k], np.float32) -
                                     np.asarray(dense_grads[k], np.float32))))
                 for k in grads)
  print(f"loss {float(value):.6f} (dense {float(dense_value):.6f}); after one SGD step "
        f"{float(new_value):.6f}")
  print(f"max |out - dense| = {out_err:.3e}; max |grad - dense grad| = {grad_err:.3e}; "
        f"routing identical to dense: {same_routing}")
  tolerance = 1e-3 if dtype == jnp.float32 else 5e-2
  ok = same_routing and out_err < tolerance and grad_err < tolerance and new_value < value
  jax_ep.finalize()
  if not ok:
    print("MISMATCH against the dense layer")
    sys.exit(1)
  print("OK")


if __name__ == "__main__":
  app.run(main)
