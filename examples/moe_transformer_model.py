"""The model of examples/moe_transformer.py: a small decoder-only MoE transformer.

Pre-norm blocks of causal multi-head attention and an MoE FFN (router, top-k,
GELU experts, an optional shared expert), a learned position embedding, an
untied output projection, next-token cross-entropy plus a Switch-style
load-balancing loss.

Precision: parameters are float32 (the optimizer's master copy); matmul
inputs, the rows jax_ep moves and the experts' outputs are in the compute
dtype (bfloat16 in training); matmuls accumulate in float32; the residual
stream, norms, softmaxes and the loss stay float32.

Everything here is per shard, written for the inside of a shard_map over the
whole mesh: the batch is split over every mesh axis, the experts' weights over
the EP axis. The MoE FFN is a function argument, so that the jax_ep one
(``moe_ffn_ep``: dispatch, grouped-GEMM experts, combine) and the dense reference
(``moe_ffn_dense``: every expert on every token) share the rest of the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe

F32 = jnp.float32
UNEMBED_SCALE = 0.1
Params = dict[str, Any]
# moe_ffn(layer_params, x [T, H] compute dtype, idx int32 [T, K], gates f32 [T, K])
#   -> (y [T, H] compute dtype, stats dict)
MoeFfn = Callable[[Params, jax.Array, jax.Array, jax.Array], tuple[jax.Array, dict]]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes of the model; hashable (a static argument).

  Attributes:
    vocab: V tokens.
    seq_len: S, tokens per sequence.
    hidden: H, model width (a multiple of heads; of 8 for the CUDA kernels).
    heads: attention heads.
    layers: transformer blocks, each with an MoE FFN.
    experts: E routed experts per MoE FFN.
    topk: K experts per token.
    ffn: F, hidden width of each routed expert's MLP.
    shared_ffn: hidden width of the shared expert's MLP (every token); 0: none.
    compute_dtype: name of the compute dtype ("bfloat16" or "float32").
    aux_loss_weight: weight of the load-balancing loss (0: none).
  """

  vocab: int
  seq_len: int
  hidden: int
  heads: int
  layers: int
  experts: int
  topk: int
  ffn: int
  shared_ffn: int
  compute_dtype: str = "bfloat16"
  aux_loss_weight: float = 0.01

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.dtype(self.compute_dtype)


def init_params(config: ModelConfig, seed: int) -> Params:
  """float32 numpy parameters (the same on every process for one seed).

  Matrices are N(0, 1/fan_in) (the output projections of each block scaled
  down by sqrt(2 * layers), GPT-2's residual scaling; the output projection by
  UNEMBED_SCALE, so that the first loss is near log V), norms start at 1.
  """
  rng = np.random.default_rng(seed)
  h, f, e = config.hidden, config.ffn, config.experts

  def normal(shape, fan_in, scale=1.0):
    return (rng.standard_normal(shape) * scale / np.sqrt(fan_in)).astype(np.float32)

  residual_scale = 1.0 / np.sqrt(2 * config.layers)
  layers = []
  for _ in range(config.layers):
    layer = dict(
        attn_norm=np.ones(h, np.float32), wqkv=normal((h, 3 * h), h),
        wo=normal((h, h), h, residual_scale), moe_norm=np.ones(h, np.float32),
        router=normal((h, e), h), w1=normal((e, h, f), h), w2=normal((e, f, h), f, residual_scale))
    if config.shared_ffn:
      layer.update(shared_w1=normal((h, config.shared_ffn), h),
                   shared_w2=normal((config.shared_ffn, h), config.shared_ffn, residual_scale))
    layers.append(layer)
  return dict(embed=normal((config.vocab, h), 1), pos=normal((config.seq_len, h), 1, 0.1),
              layers=layers, final_norm=np.ones(h, np.float32),
              unembed=normal((h, config.vocab), h, UNEMBED_SCALE))


def param_specs(params: Params, expert_axis: str | None) -> Params:
  """PartitionSpecs: w1, w2 split over ``expert_axis`` (None: replicated), the rest
  replicated."""
  def spec(path, _):
    name = path[-1].key if hasattr(path[-1], "key") else None
    return P(expert_axis) if name in ("w1", "w2") and expert_axis else P()
  return jax.tree_util.tree_map_with_path(spec, params)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  """float32 [..., H] -> float32, normalised over H."""
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def matmul(a: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """a @ w with both in ``dtype``, accumulated and returned in float32."""
  return jnp.matmul(a.astype(dtype), w.astype(dtype), preferred_element_type=F32)


def attention(x: jax.Array, layer: Params, config: ModelConfig) -> jax.Array:
  """Causal multi-head self-attention; x float32 [B, S, H] -> float32 [B, S, H]."""
  b, s, h = x.shape
  qkv = matmul(x, layer["wqkv"], config.dtype).reshape(b, s, 3, config.heads, h // config.heads)
  q, k, v = (qkv[:, :, i] for i in range(3))                          # [B, S, heads, Dh]
  scores = jnp.einsum("bqnd,bknd->bnqk", q.astype(config.dtype), k.astype(config.dtype),
                      preferred_element_type=F32) / np.sqrt(h // config.heads)
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  mixed = jnp.einsum("bnqk,bknd->bqnd", probs.astype(config.dtype), v.astype(config.dtype),
                     preferred_element_type=F32).reshape(b, s, h)
  return matmul(mixed, layer["wo"], config.dtype)


def gates(router: jax.Array, x: jax.Array, idx: jax.Array) -> jax.Array:
  """float32 [T, K]: softmax over the chosen experts' logits (differentiable in
  router and x). router f32 [H, E], x [T, H], idx int32 [T, K]."""
  logits = x.astype(F32) @ router
  return jax.nn.softmax(jnp.take_along_axis(logits, idx, axis=1), axis=-1)


def choose_experts(router: jax.Array, x: jax.Array, num_topk: int) -> jax.Array:
  """int32 [T, K]: the top-k router logits' experts (not differentiated)."""
  logits = jax.lax.stop_gradient(x.astype(F32) @ router)
  return jax.lax.top_k(logits, num_topk)[1].astype(jnp.int32)


def expert_pairs(x: jax.Array, w1: jax.Array, w2: jax.Array, group_sizes: jax.Array,
                 dtype, gmm: moe.GroupedMatmulConfig = moe.GroupedMatmulConfig()) -> jax.Array:
  """GELU MLPs of consecutive row groups: rows of group e through expert e, on
  jax_ep.moe.grouped_matmul (the Pallas Hopper kernels on sm_90, ragged_dot elsewhere).
  x [M, H], w1 [E_local, H, F], w2 [E_local, F, H] -> [M, H] of dtype (0 past the groups)."""
  return moe.experts.grouped_mlp(x.astype(dtype), group_sizes, w1, w2, "gelu", gmm)


def moe_ffn_ep(ep_config: jax_ep.EpConfig, alignment: int, capacity: int | None,
               gmm: moe.GroupedMatmulConfig = moe.GroupedMatmulConfig()) -> MoeFfn:
  """The MoE FFN on jax_ep: expert-major dispatch, grouped-GEMM experts, combine."""

  def ffn(layer, x, idx, gate):
    d = jax_ep.dispatch(x, idx, gate, config=ep_config, layout="expert_major",
                        expert_alignment=alignment, capacity=capacity)
    # d.x [M, H]: pair rows grouped by local expert, group_sizes aligned to A;
    # d.topk_weights f32 [M]: each pair's gate, 0 on padding rows.
    y = expert_pairs(d.x, layer["w1"], layer["w2"], d.group_sizes, x.dtype, gmm)
    y = (y.astype(F32) * d.topk_weights[:, None]).astype(x.dtype)
    out = jax_ep.combine(y, d.handle, config=ep_config)                # [T, H], fp32 sums
    return out, dict(tokens_per_expert=d.tokens_per_expert, dropped=d.num_dropped)

  return ffn


def moe_ffn_dense(layer, x, idx, gate):
  """The reference MoE FFN: every expert (all E, replicated) on every token, then
  the top-k mix of the chosen experts' outputs, summed in k order in float32."""
  dtype = x.dtype
  hidden = jnp.einsum("th,ehf->etf", x, layer["w1"].astype(dtype), preferred_element_type=F32)
  y = jnp.einsum("etf,efh->eth", jax.nn.gelu(hidden).astype(dtype), layer["w2"].astype(dtype),
                 preferred_element_type=F32)                           # [E, T, H]
  picked = y[idx, jnp.arange(x.shape[0])[:, None]]                     # [T, K, H]
  weighted = (picked * gate[..., None]).astype(dtype).astype(F32)      # rounded as the EP side
  out = weighted[:, 0]
  for k in range(1, weighted.shape[1]):
    out = out + weighted[:, k]
  counts = jnp.zeros(layer["w1"].shape[0], jnp.int32).at[idx.reshape(-1)].add(1)
  return out.astype(dtype), dict(tokens_per_expert=counts, dropped=jnp.zeros((), jnp.int32))


def shared_expert(layer: Params, x: jax.Array, dtype) -> jax.Array:
  return matmul(jax.nn.gelu(matmul(x, layer["shared_w1"], dtype)), layer["shared_w2"], dtype)


def local_loss(params: Params, tokens: jax.Array, config: ModelConfig, moe_ffn: MoeFfn,
               batch_axes: tuple[str, ...], routing: jax.Array | None = None):
  """One shard's part of the loss, summed over the mesh.

  Args:
    params: float32 (w1/w2: this rank's experts for moe_ffn_ep, all E for
      moe_ffn_dense).
    tokens: int32 [B_local, S + 1]: inputs tokens[:, :-1], targets tokens[:, 1:].
    routing: int32 [layers, B_local * S, K]: the experts to use (the dense
      reference takes those the jax_ep run chose); None: the router's top-k.
  Returns:
    (loss f32 [] = mean cross-entropy + aux_loss_weight * mean load-balancing
     loss, over the whole batch; aux: cross_entropy f32 [], routing int32
     [layers, B_local * S, K], and per layer (stacked) moe_ffn's stats).
  """
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  b, s = inputs.shape
  num_tokens = b * s * jax.lax.psum(1, batch_axes)                     # global tokens
  x = params["embed"][inputs] + params["pos"][None, :s]
  chosen, stats, balance = [], [], 0.0
  for i, layer in enumerate(params["layers"]):
    x = x + attention(rms_norm(x, layer["attn_norm"]), layer, config)
    h = rms_norm(x, layer["moe_norm"]).reshape(b * s, config.hidden)
    idx = (choose_experts(layer["router"], h, config.topk) if routing is None else routing[i])
    gate = gates(layer["router"], h, idx)
    y, layer_stats = moe_ffn(layer, h.astype(config.dtype), idx, gate)
    y = y.astype(F32)
    if config.shared_ffn:
      y = y + shared_expert(layer, h, config.dtype)
    x = x + y.reshape(b, s, config.hidden)
    # Switch Transformer's balance loss E * sum_e f_e p_e: f_e the fraction of
    # the (token, k) choices that pick e (no gradient), p_e the mean router
    # probability of e, both over the whole batch.
    probs = jax.nn.softmax(h @ layer["router"], axis=-1)
    picks = jnp.zeros(config.experts, F32).at[idx.reshape(-1)].add(1.0)
    f = jax.lax.psum(picks, batch_axes) / (num_tokens * config.topk)
    p = jax.lax.psum(jnp.sum(probs, axis=0), batch_axes) / num_tokens
    balance = balance + config.experts * jnp.sum(f * p)
    chosen.append(idx)
    stats.append(layer_stats)
  logits = matmul(rms_norm(x, params["final_norm"]), params["unembed"], config.dtype)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  cross_entropy = jax.lax.psum(jnp.sum(logz - picked), batch_axes) / num_tokens
  loss = cross_entropy + config.aux_loss_weight * balance / config.layers
  stats = jax.tree.map(lambda *a: jnp.stack(a), *stats)
  return loss, dict(cross_entropy=cross_entropy, routing=jnp.stack(chosen), stats=stats)
