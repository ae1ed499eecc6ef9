"""A dense float64 oracle of jax_ep.moe.moe_layer, written apart from it.

Every token goes through every one of its K chosen experts (no exchange, no
grouping, no kernels), in float64 on the CPU (jax.enable_x64), so its
gradients come from plain autodiff. The routing is recomputed here from the
router's definition (softmax or sigmoid, selection bias, group-limited top-k);
the test asserts the layer chose the same experts.

Bounds (first-order forward error analysis). The layer rounds to its compute
dtype (unit roundoff u: 2^-8 bfloat16, 2^-24 float32) at most STAGES times
along any path from an input to y (GEMM outputs, the activation, the weighted
pair rows, the combine's sum), and each float32 accumulation of n terms adds
gamma_n = n 2^-24 / (1 - n 2^-24) relative to the sum of |terms|; every map
in between has a Lipschitz constant <= LIPSCHITZ per stage (silu' <= 1.1,
gelu' <= 1.13, the routing weights <= routed_scaling_factor). Elementwise:

  |y - y64| <= STAGES * (u + gamma_n) * LIPSCHITZ^STAGES * scale * y_abs

where y_abs is the same network evaluated on |x| and |weights| (the size of
the terms that were rounded) and scale the routed scaling factor. Gradients
are checked normwise with the same constant against the largest gradient entry
times the number of stages of the backward pass (STAGES again).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

STAGES = 6
LIPSCHITZ = 1.15


def _selection(logits, router_cfg, bias):
  """(scores [T, E], choice [T, E]: what top-k ranks, the experts of unkept groups at
  -inf; group_scores [T, G] or None: what the group top-k ranks)."""
  e = logits.shape[1]
  if router_cfg.score_function == "softmax":
    scores = jnp.exp(logits - logits.max(axis=1, keepdims=True))
    scores = scores / scores.sum(axis=1, keepdims=True)
  else:
    scores = 1.0 / (1.0 + jnp.exp(-logits))
  choice = jax.lax.stop_gradient(scores)
  if router_cfg.selection_bias:
    choice = choice + bias[None, :]
  group_scores = None
  if router_cfg.num_groups > 1:
    g = router_cfg.num_groups
    grouped = choice.reshape(choice.shape[0], g, e // g)
    group_scores = -jnp.sort(-grouped, axis=2)[:, :, :min(2, e // g)].sum(axis=2)
    keep = jnp.argsort(-group_scores, axis=1, stable=True)[:, :router_cfg.topk_groups]
    mask = jnp.any(jnp.arange(g)[None, :, None] == keep[:, None, :], axis=2)
    choice = jnp.where(jnp.repeat(mask, e // g, axis=1), choice, -jnp.inf)
  return scores, choice, group_scores


def _route(logits, router_cfg, num_topk, bias):
  scores, choice, _ = _selection(logits, router_cfg, bias)
  idx = jnp.argsort(-choice, axis=1, stable=True)[:, :num_topk]
  weights = jnp.take_along_axis(scores, idx, axis=1)
  if router_cfg.normalize_weights:
    weights = weights / (weights.sum(axis=1, keepdims=True) + 1e-20)
  return idx, weights * router_cfg.routed_scaling_factor


def selection_margin(params: dict, x: np.ndarray, config) -> float:
  """How clearly float32 logits decide each token's experts and their order: the
  smallest ratio, over tokens, of the gap between adjacent values of what the top-k
  ranks (its K+1 largest choices; with groups, its topk_groups+1 largest group
  scores) to the float32 logits' error in those values. Below 1, the layer and this
  oracle may choose differently (routing is discontinuous), and the gradients of
  the expert weights then differ by a whole token's contribution.

  The error: a float32 dot of H terms carries about sqrt(H) 2^-24 sum|x_i r_i|
  (rounding errors of random sign; the worst case has H for sqrt(H)); a gap
  between two values moves by twice that. Softmax without bias or groups ranks
  as its logits do, so their gaps are measured; otherwise the choice values',
  which move by at most 2 max|d logit| (softmax, sigmoid <= 1/4; a group score
  sums two)."""
  with jax.enable_x64(True), jax.default_device(jax.local_devices(backend="cpu")[0]):
    x64 = jnp.asarray(np.asarray(x, np.float32), jnp.float64)
    router = jnp.asarray(np.asarray(params["router"], np.float32), jnp.float64)
    bias = params.get("router_bias")
    bias = None if bias is None else jnp.asarray(np.asarray(bias, np.float32), jnp.float64)
    logits = x64 @ router
    _, choice, group_scores = _selection(logits, config.router, bias)
    logit_error = np.max(np.sqrt(x.shape[1]) * 2.0**-24
                         * np.asarray(jnp.abs(x64) @ jnp.abs(router)), axis=1)
    cfg = config.router
    if cfg.score_function == "softmax" and not cfg.selection_bias and cfg.num_groups <= 1:
      choice, error = logits, 2 * logit_error
    else:
      error = 2 * 2 * logit_error
    ratio = np.inf
    for values, kept in ((choice, config.ep.num_topk),
                         (group_scores, config.router.topk_groups)):
      if values is None:
        continue
      top = -np.sort(-np.asarray(values), axis=1)[:, :kept + 1]
      top = np.where(np.isfinite(top), top, -np.inf)
      with np.errstate(invalid="ignore"):
        gaps = top[:, :-1] - top[:, 1:]
      gaps = np.where(np.isnan(gaps), np.inf, gaps)     # both unkept: no decision
      if gaps.size:
        ratio = min(ratio, float(np.min(np.min(gaps, axis=1) / error)))
    return ratio


def _mlp(x, w_in, w_out, activation, magnitude=False):
  """One MLP; with magnitude, the network of absolute values (x and weights
  already |.|): |silu(g) u| <= |g| |u|, |gelu(h)| <= |h|."""
  h = x @ w_in
  if activation == "swiglu":
    gate, up = jnp.split(h, 2, axis=-1)
    a = gate * up if magnitude else gate / (1.0 + jnp.exp(-gate)) * up
  else:
    a = h if magnitude else jax.nn.gelu(h)
  return a @ w_out


def _experts(params, x, idx, weights, config, magnitude=False):
  y = jnp.zeros_like(x)
  for k in range(idx.shape[1]):
    if not x.shape[0]:
      break
    out_k = jax.vmap(lambda xt, e: _mlp(xt, params["w_in"][e], params["w_out"][e],
                                        config.activation, magnitude))(x, idx[:, k])
    y = y + weights[:, k:k + 1] * out_k
  if config.shared_ffn_size:
    y = y + _mlp(x, params["shared_in"], params["shared_out"], config.activation, magnitude)
  return y


def dense_layer(params: dict, x, config):
  """float64 (y [T, H], idx [T, K], weights [T, K]) of the tokens x [T, H] with the
  GLOBAL params."""
  logits = x @ params["router"]
  idx, weights = _route(logits, config.router, config.ep.num_topk, params.get("router_bias"))
  return _experts(params, x, idx, weights, config), idx, weights


def unit_roundoff(dtype) -> float:
  return {np.dtype(jnp.bfloat16): 2.0**-8, np.dtype(jnp.float16): 2.0**-11,
          np.dtype(np.float32): 2.0**-24}[np.dtype(dtype)]


def error_constant(config, dtype) -> float:
  n = max(config.ep.hidden, config.ffn_size, config.shared_ffn_size, config.ep.num_topk)
  gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
  scale = max(1.0, config.router.routed_scaling_factor)
  # FP8 (e4m3) rows: 3 fraction bits, a rounding of at most 2^-4 relative.
  rounding = max(unit_roundoff(dtype), 2.0**-4 if config.fp8 else 0.0)
  return STAGES * (rounding + gamma) * LIPSCHITZ**STAGES * scale


def reference(params: dict, x: np.ndarray, config, tokens: slice, dy: np.ndarray | None = None):
  """For the tokens x[tokens] (x: every token, params: global), on the CPU in float64:
  (y [T, H], y_abs [T, H] (the magnitude the bound scales), idx [T, K], and with dy
  the gradients of sum(y * dy) w.r.t. (every param, x[tokens]), else None)."""
  cpu = jax.local_devices(backend="cpu")[0]
  with jax.enable_x64(True), jax.default_device(cpu):
    p64 = {k: jnp.asarray(np.asarray(v, np.float32), jnp.float64) for k, v in params.items()}
    x64 = jnp.asarray(np.asarray(x, np.float32)[tokens], jnp.float64)
    y, y_abs, idx = _forward(p64, x64, config)
    grads = None
    if dy is not None:
      g_params, g_x = _gradients(p64, x64, jnp.asarray(dy, jnp.float64), config)
      grads = ({k: np.asarray(v) for k, v in g_params.items()}, np.asarray(g_x))
    return np.asarray(y), np.asarray(y_abs), idx, grads


# Compiled (the config static): op-by-op, the float64 gradients took seconds per call.
@functools.partial(jax.jit, static_argnums=(2,))
def _forward(p64, x64, config):
  y, idx, weights = dense_layer(p64, x64, config)
  y_abs = _experts({k: jnp.abs(v) for k, v in p64.items()}, jnp.abs(x64), idx, weights,
                   config, magnitude=True)
  return y, y_abs, idx


@functools.partial(jax.jit, static_argnums=(3,))
def _gradients(p64, x64, dy64, config):
  def loss(p, xx):
    return jnp.sum(dense_layer(p, xx, config)[0] * dy64)
  return jax.grad(loss, argnums=(0, 1))(p64, x64)


def check_close(name: str, got, exact, constant: float, magnitude) -> None:
  got64 = np.asarray(np.asarray(got, np.float32), np.float64)
  bound = constant * magnitude
  err = np.abs(got64 - exact)
  worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
  assert err.size == 0 or np.all(err <= bound), (
      f"{name}: {got64[worst]} vs exact {exact[worst]} at {worst}: error {err[worst]:.3g} "
      f"over its bound {np.broadcast_to(bound, err.shape)[worst]:.3g}")
