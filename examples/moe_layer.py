"""A top-k routed MoE layer on jax_ep, one training step, checked against a dense layer.

Each rank of the ``ep`` mesh axis holds E/R experts (a two-layer GELU MLP each,
jax.lax.ragged_dot straight on the dispatched rows: the expert-major layout
groups them by local expert). A step: router -> jax_ep.dispatch
(layout="expert_major") -> expert MLPs -> weights -> jax_ep.combine -> loss;
jax.grad differentiates through all of it.

The check: the same layer computed densely in float64 on the host CPU (every
expert on every token, then the top-k mix), with the same experts chosen: the
top-k is taken once, from the step's own router logits, and fed to both sides,
so near-ties cannot send a token to different experts. Both sides compute the
mixing weights from the router (differentiably). The output must lie within a
first-order rounding bound derived from the activation dtype (error_bound),
the loss within the bound that implies, and the gradients within a norm-wise
bound of a few roundings (GRAD_ROUNDINGS).

Where it runs (tools/run_example.sh picks):
  no GPU       8 CPU devices, portable backend, float32 by default
  one GPU      one process, a 1-device mesh (EP1) on the CUDA backend, bfloat16
  2+ GPUs      python -m jax_ep.launch -n N examples/moe_layer.py, bfloat16
On GPUs it runs bfloat16 (the kernels move bf16 rows) and fails unless the
compiled step contains jax_ep's HT kernels. It prints the backend, the jax_ep
custom calls in the compiled step, and OK, or MISMATCH with exit status 1.
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
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import launch  # noqa: E402
# HT_KERNELS and STATUS_CHECK: tests/cpu/test_example.py reads them from here.
from _kernels import (HT_KERNELS, STATUS_CHECK, jax_ep_custom_calls,  # noqa: E402,F401
                      missing_kernels)

flags.DEFINE_integer("tokens_per_rank", 64, "tokens on each rank")
flags.DEFINE_integer("hidden", 128, "model width H")
flags.DEFINE_integer("ffn", 256, "expert MLP width")
flags.DEFINE_integer("experts_per_rank", 4, "experts held by each rank")
flags.DEFINE_integer("topk", 2, "experts per token")
flags.DEFINE_integer("expert_alignment", 8, "rows per group rounded up to a multiple of this")
flags.DEFINE_float("learning_rate", 0.1, "SGD step size")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"],
                  "activation and expert weight dtype; auto: bfloat16 on GPUs, else float32")

# Roundings to the activation dtype on the longest path from the inputs to a
# gradient (forward: the expert MLP's hidden activation, its output rows, the
# combined output; backward: the output's cotangent, the hidden activation's
# cotangent, the weight gradient). Each costs at most one unit roundoff,
# relative; measured on CPU (8 ranks, bf16, seeds 0-4): 0.55 to 0.78 unit roundoff.
GRAD_ROUNDINGS = 6
F32_UNIT_ROUNDOFF = 2.0**-24


def unit_roundoff(dtype) -> float:
  return float(jnp.finfo(dtype).eps) / 2


def router_weights(router, x, idx):
  """f32 [T, K]: softmax router probabilities of the chosen experts ``idx`` int32
  [T, K], renormalised over them. Differentiable in ``router``."""
  probs = jax.nn.softmax(x.astype(router.dtype) @ router, axis=-1)
  picked = jnp.take_along_axis(probs, idx, axis=1)
  return picked / jnp.sum(picked, axis=-1, keepdims=True)


def choose_experts(router, x, num_topk):
  """int32 [T, K]: the top-k experts of the router logits, highest first."""
  return jax.lax.top_k(x.astype(router.dtype) @ router, num_topk)[1].astype(jnp.int32)


def grouped_mlp(rows, group_sizes, w1, w2):
  """This rank's experts on its expert-major rows: rows [M, H] grouped by local
  expert (group sizes int32[E_local]), w1 [E_local, H, F], w2 [E_local, F, H].
  Returns float32 [M, H]; rows past the groups give zeros."""
  h = jax.lax.ragged_dot(rows, w1, group_sizes, preferred_element_type=jnp.float32)
  g = jax.nn.gelu(h).astype(rows.dtype)
  return jax.lax.ragged_dot(g, w2, group_sizes, preferred_element_type=jnp.float32)


def moe_ep(params, x, idx, config, alignment):
  """Per-shard MoE layer (inside shard_map over 'ep'); also returns routing stats."""
  weights = router_weights(params["router"], x, idx)
  d = jax_ep.dispatch(x, idx, weights, config=config, layout="expert_major",
                      expert_alignment=alignment)
  # One row per (token, local expert) pair: weight it (0 on padding rows) and
  # let the combine sum each token's pairs, in float32, back on its rank.
  y = grouped_mlp(d.x, d.group_sizes, params["w1"], params["w2"])
  out = jax_ep.combine((y * d.topk_weights[:, None]).astype(x.dtype), d.handle, config=config)
  stats = dict(tokens_per_expert=d.tokens_per_expert, received=d.num_tokens[None],
               dropped=d.num_dropped[None])
  return out, stats


def moe_dense(params, x, idx):
  """The same layer on one device: every expert on every token, then the top-k mix.
  Also returns what error_bound needs."""
  weights = router_weights(params["router"], x, idx)
  tokens = jnp.arange(x.shape[0])[:, None]
  h = jnp.einsum("th,ehf->etf", x, params["w1"])                   # [E, T, F]
  g = jax.nn.gelu(h)
  y = jnp.einsum("etf,efh->eth", g, params["w2"])[idx, tokens]     # [T, K, H]
  out = jnp.sum(y * weights[..., None], axis=1)
  # Magnitudes for the bound (constants: no gradient flows through them).
  w1, w2 = (jax.lax.stop_gradient(jnp.abs(params[k])) for k in ("w1", "w2"))
  g_abs = jax.lax.stop_gradient(jnp.abs(g))
  h_mag = jnp.einsum("th,ehf->etf", jnp.abs(x), w1)
  slope = jax.lax.stop_gradient(jnp.abs(jax.grad(lambda a: jnp.sum(jax.nn.gelu(a)))(h)))
  parts = dict(
      y=jax.lax.stop_gradient(jnp.abs(y)),
      g_w2=jnp.einsum("etf,efh->eth", g_abs, w2)[idx, tokens],
      h_w2=jnp.einsum("etf,efh->eth", slope * h_mag, w2)[idx, tokens],
      logits=jnp.max(jnp.abs(x) @ jnp.abs(jax.lax.stop_gradient(params["router"])), axis=1),
      weights=jax.lax.stop_gradient(weights))
  return out, parts


def error_bound(parts, ref, dtype, hidden: int, ffn: int, num_topk: int, num_ranks: int):
  """First-order bound on |out_ep - out_exact| per element [T, H].

  The EP side rounds to the activation dtype (unit roundoff u) three times: the
  expert's hidden activation g before the second matmul (<= u * |g| @ |w2|),
  each weighted pair row w_k y_k before the combine moves it (together
  <= u * sum_k w_k |y_k|), and the combined output (<= u * |out|). Everything
  else accumulates in float32: a length-n sum errs by at most
  gamma_n = n u32 / (1 - n u32) of its terms' magnitudes (the matmuls, the
  weighted sums, the router logits, which move the softmax weights by at most
  2 gamma max|logit| relative, plus 4 u32 for exp and the division).
  """
  u = unit_roundoff(dtype)
  n = hidden + ffn + num_topk + num_ranks
  gamma = n * F32_UNIT_ROUNDOFF / (1 - n * F32_UNIT_ROUNDOFF)
  w = parts["weights"][..., None]
  s_y, s_g, s_h = (np.sum(w * parts[k], axis=1) for k in ("y", "g_w2", "h_w2"))
  weight_err = 2 * gamma * parts["logits"][:, None] + 4 * F32_UNIT_ROUNDOFF
  bound = u * (np.abs(ref) + s_y + s_g) + gamma * (s_y + s_g + s_h) + weight_err * s_y
  return bound * (1 + 4 * u)   # second-order terms


def loss_fn(out, target):
  return jnp.mean((out.astype(jnp.float32) - target) ** 2)


SPECS = {"router": P(), "w1": P("ep"), "w2": P("ep")}   # experts split over the ranks


def make_train_step(config, mesh, learning_rate: float, alignment: int):
  """jit(params, x, idx, target) -> (loss, (out, stats), grads, new_params).

  params as SPECS; x [R*T, H], idx int32 [R*T, K] (choose_experts), target f32
  [R*T, H], split over 'ep'.
  """

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(SPECS, P("ep"), P("ep")),
                     out_specs=(P("ep"), P("ep")))
  def layer(params, x, idx):
    return moe_ep(params, x, idx, config, alignment)

  @jax.jit
  def train_step(params, x, idx, target):
    def loss(params):
      out, stats = layer(params, x, idx)
      return loss_fn(out, target), (out, stats)
    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(params)
    new_params = jax.tree.map(lambda p, g: (p - learning_rate * g).astype(p.dtype), params,
                              grads)
    return value, aux, grads, new_params

  return train_step


def activation_dtype(flag: str, platform: str):
  """auto: bfloat16 on GPUs (what the kernels move), float32 elsewhere."""
  if flag == "auto":
    return jnp.dtype(jnp.bfloat16 if platform == "gpu" else jnp.float32)
  return jnp.dtype(flag)


def main(argv):
  del argv
  launch.initialize_distributed_from_env()
  platform = jax.devices()[0].platform
  dtype = activation_dtype(flags.FLAGS.dtype, platform)
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  num_ranks = mesh.shape["ep"]
  t, h, f = flags.FLAGS.tokens_per_rank, flags.FLAGS.hidden, flags.FLAGS.ffn
  num_experts = flags.FLAGS.experts_per_rank * num_ranks
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=h, max_tokens_per_rank=t,
                           num_topk=flags.FLAGS.topk)
  jax_ep.initialize(config, mesh)
  backend = jax_ep.runtime_state().backend_name
  say = print if jax.process_index() == 0 else (lambda *_: None)   # the verdict: every rank
  say(f"jax_ep backend: {backend}; {num_ranks} ranks on {platform} "
      f"({jax.process_count()} process(es)); E={num_experts} K={config.num_topk} H={h} "
      f"ffn={f} tokens/rank={t} dtype={dtype.name}")

  rng = np.random.default_rng(flags.FLAGS.seed)
  host = {
      "router": (rng.standard_normal((h, num_experts)) / np.sqrt(h)).astype(np.float32),
      "w1": np.asarray(jnp.asarray(rng.standard_normal((num_experts, h, f)) / np.sqrt(h), dtype)),
      "w2": np.asarray(jnp.asarray(rng.standard_normal((num_experts, f, h)) / np.sqrt(f), dtype)),
  }
  x_host = np.asarray(jnp.asarray(rng.standard_normal((num_ranks * t, h)), dtype))
  target_host = rng.standard_normal((num_ranks * t, h)).astype(np.float32)
  params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in host.items()}
  x, target = (jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x_host, target_host))
  train_step = make_train_step(config, mesh, flags.FLAGS.learning_rate,
                               flags.FLAGS.expert_alignment)

  # "highest": float32 matmuls in full float32 on GPUs too (not TF32), as the bound assumes.
  with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
    idx = jax.jit(functools.partial(choose_experts, num_topk=config.num_topk))(
        params["router"], x)
    compiled = train_step.lower(params, x, idx, target).compile()
    value, (out, stats), grads, new_params = compiled(params, x, idx, target)
    new_value = train_step(new_params, x, idx, target)[0]
  calls = jax_ep_custom_calls(compiled.as_text())
  say("jax_ep custom calls in the compiled step: " +
      (", ".join(f"{name} x{n}" for name, n in sorted(calls.items())) or "none"))

  # Every process gathers the global values and checks them on its own host CPU.
  gathered = multihost_utils.process_allgather(
      dict(idx=idx, out=out, grads=grads, stats=stats), tiled=True)
  idx_host = np.asarray(gathered["idx"])
  with jax.enable_x64(True), jax.default_device(jax.local_devices(backend="cpu")[0]):
    params64 = {k: jnp.asarray(np.asarray(v, np.float64)) for k, v in host.items()}
    x64, target64 = jnp.asarray(x_host.astype(np.float64)), jnp.asarray(target_host, jnp.float64)

    def dense_loss(p):
      out_d, parts = moe_dense(p, x64, jnp.asarray(idx_host))
      return jnp.mean((out_d - target64) ** 2), (out_d, parts)

    (dense_value, (dense_out, parts)), dense_grads = jax.jit(
        jax.value_and_grad(dense_loss, has_aux=True))(params64)
    dense_value, dense_out = float(dense_value), np.asarray(dense_out)
    parts = {k: np.asarray(v) for k, v in parts.items()}
    dense_grads = {k: np.asarray(v) for k, v in dense_grads.items()}

  stats = gathered["stats"]
  tokens_per_expert = np.asarray(stats["tokens_per_expert"]).reshape(-1)
  say("routing: tokens per expert", tokens_per_expert.tolist())
  say(f"routing: (token, expert) pairs received per rank "
      f"{np.asarray(stats['received']).tolist()}, dropped {int(np.sum(stats['dropped']))}, "
      "expert load "
      f"max/mean {tokens_per_expert.max() / max(tokens_per_expert.mean(), 1e-9):.2f}")

  out_err = np.abs(np.asarray(gathered["out"], np.float64) - dense_out)
  bound = error_bound(parts, dense_out, dtype, h, f, config.num_topk, num_ranks)
  out_ratio = float(np.max(out_err / bound))
  # The loss moves with the output: |mean((a + d)^2) - mean(a^2)| <= 2 rms(a) rms(d) +
  # mean(d^2) (Cauchy-Schwarz; a = dense - target, d = out - dense), plus the float32
  # mean over its R*T*H terms (gamma_n times the loss).
  n_loss = out_err.size
  loss_bound = (2 * np.sqrt(np.mean((dense_out - target_host)**2) * np.mean(out_err**2)) +
                np.mean(out_err**2) +
                n_loss * F32_UNIT_ROUNDOFF / (1 - n_loss * F32_UNIT_ROUNDOFF) * float(value))
  loss_err = abs(float(value) - dense_value)
  # Gradients: norm-wise relative error, a few roundings to the activation dtype plus
  # float32 sums over the R*T tokens and the widths.
  n_grad = num_ranks * t + h + f
  grad_tol = (GRAD_ROUNDINGS * unit_roundoff(dtype) +
              n_grad * F32_UNIT_ROUNDOFF / (1 - n_grad * F32_UNIT_ROUNDOFF))
  grad_err = {k: float(np.linalg.norm(np.asarray(gathered["grads"][k], np.float64) -
                                      dense_grads[k]) / np.linalg.norm(dense_grads[k]))
              for k in dense_grads}
  say(f"loss {float(value):.6f} (dense {dense_value:.6f}, |diff| {loss_err:.2e} <= "
      f"{loss_bound:.2e}); after one SGD step {float(new_value):.6f}")
  say(f"max |out - dense| = {float(np.max(out_err)):.3e}, at most {out_ratio:.3f} of the "
      f"rounding bound")
  say("gradients, |grad - dense| / |dense|: " +
      ", ".join(f"{k} {v:.2e}" for k, v in sorted(grad_err.items())) +
      f" (bound {grad_tol:.2e})")

  ok = out_ratio <= 1 and loss_err <= loss_bound and max(grad_err.values()) <= grad_tol
  ok = ok and float(new_value) < float(value)
  # On GPUs the point is the kernels: bf16 rows must run on them.
  failure = missing_kernels(calls, gpu_bf16=platform == "gpu" and dtype == jnp.bfloat16,
                            backend=backend)
  jax_ep.finalize()
  if failure:
    print(failure)
    sys.exit(1)
  if not ok:
    print("MISMATCH against the dense layer")
    sys.exit(1)
  print("OK")


if __name__ == "__main__":
  app.run(main)
