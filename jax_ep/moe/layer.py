"""moe_layer: a whole MoE layer on jax_ep's public ops, for the inside of a shard_map.

Per shard (one EP rank; the batch split over every mesh axis, the experts over
the EP axes of ``config.ep``):

  logits  = x @ router                                 float32 [T, E] (full float32)
  routing = route(logits)                              (jax_ep/moe/routing.py)
  HT (training, prefill):
    d  = jax_ep.dispatch(x, idx, weights, layout="expert_major",
                         expert_alignment=gmm.row_alignment)   [M, H], grouped by expert
    y  = grouped_mlp(d.x, d.group_sizes, row_weights=d.topk_weights)
         each pair weighted in its activation, before the down GEMM (linear):
         a pass over [M, F] fused into the activation, not one over [M, H]
    out = jax_ep.combine(y, d.handle)                  [T, H], summed in float32
  LL (decoding):
    d  = jax_ep.low_latency_dispatch(x, idx)           [E_local, R*T_ll, H] blocks
    y  = batched_mlp(d.x), slots at and past d.count zeroed
    out = jax_ep.low_latency_combine(y, idx, weights, d.handle)
  out += shared experts(x)                             when shared_ffn_size > 0

With ``fp8`` the dispatch moves FP8 rows (per-128-channel scales,
jax_ep.fp8) that are dequantised before the GEMMs; the gradient of x passes
straight through the quantisation (the combine of the rows' cotangents, as
for BF16 rows). The layer uses only jax_ep's public ops: it is what a user's
own layer could be.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

import jax_ep
from jax_ep import fp8 as fp8_lib
from jax_ep.config import EpConfig
from jax_ep.errors import EpConfigError
from jax_ep.moe import balance, experts, routing
from jax_ep.moe.grouped_matmul import GroupedMatmulConfig
from jax_ep.moe.routing import RouterConfig

F32 = jnp.float32
EXCHANGES = ("ht", "ll")
Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """One MoE layer's sizes and choices; frozen and hashable.

  Attributes:
    ep: the EpConfig of its exchange (E = ep.num_experts, H = ep.hidden, K =
      ep.num_topk, the EP axes), given to jax_ep.initialize.
    ffn_size: F, each routed expert's hidden width.
    activation: "swiglu" (gate and up as one GEMM) or "gelu".
    router: RouterConfig.
    shared_ffn_size: hidden width of the shared experts (all of them fused
      into one MLP every token goes through); 0: none.
    exchange: "ht" (expert-major HT dispatch and combine: training, prefill) or
      "ll" (the low-latency ops: decoding; at most ep.ll_max_tokens tokens).
    fp8: dispatch FP8 rows (H a multiple of 128).
    capacity: HT only, the expert-major row count M (None: the worst case,
      nothing dropped, a multiple of the row tile); pairs past it are dropped
      and counted. On the Pallas kernels an M off their row tiling costs a
      zero-padded copy of the rows per product.
    gmm: how the expert GEMMs run (GroupedMatmulConfig); its forward row tile
      is the expert-major dispatch's alignment.
    stats_axes: mesh axes to sum the routing statistics over before the
      losses and the bias update (e.g. every batch axis, for batch-wide
      statistics; a psum). None: this shard's tokens alone, no collective.
    bias_update_rate: gamma of the auxiliary-loss-free bias update.
  """

  ep: EpConfig
  ffn_size: int
  activation: str = "swiglu"
  router: RouterConfig = RouterConfig()
  shared_ffn_size: int = 0
  exchange: str = "ht"
  fp8: bool = False
  capacity: Optional[int] = None
  gmm: GroupedMatmulConfig = GroupedMatmulConfig()
  stats_axes: Optional[tuple[str, ...]] = None
  bias_update_rate: float = 1e-3

  def __post_init__(self) -> None:
    if not isinstance(self.ep, EpConfig):
      raise EpConfigError(f"MoeConfig.ep must be an EpConfig, got {type(self.ep).__name__}")
    if not isinstance(self.ffn_size, int) or self.ffn_size <= 0:
      raise EpConfigError(f"MoeConfig.ffn_size must be a positive int, got {self.ffn_size!r}")
    if self.activation not in experts.ACTIVATIONS:
      raise EpConfigError(f"MoeConfig.activation must be one of {experts.ACTIVATIONS}, got "
                          f"{self.activation!r}")
    if self.exchange not in EXCHANGES:
      raise EpConfigError(f"MoeConfig.exchange must be one of {EXCHANGES}, got "
                          f"{self.exchange!r}")
    if self.shared_ffn_size < 0:
      raise EpConfigError(f"MoeConfig.shared_ffn_size must be >= 0, got {self.shared_ffn_size}")
    if self.fp8 and self.ep.hidden % fp8_lib.GROUP:
      raise EpConfigError(f"MoeConfig(fp8=True) needs the hidden size to be a multiple of "
                          f"{fp8_lib.GROUP} (per-128-channel scales), got {self.ep.hidden}")
    if isinstance(self.stats_axes, (list, str)):
      object.__setattr__(self, "stats_axes", (self.stats_axes,) if isinstance(
          self.stats_axes, str) else tuple(self.stats_axes))
    self.router.check(self.ep.num_experts, self.ep.num_topk)

  def param_shapes(self, num_ranks: int) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of one EP rank's shard (R = num_ranks)."""
    e, h, f = self.ep.num_experts, self.ep.hidden, self.ffn_size
    e_local = self.ep.experts_per_rank(num_ranks)
    shapes = dict(router=(h, e), w_in=(e_local, h, experts.in_width(self.activation, f)),
                  w_out=(e_local, f, h))
    if self.router.selection_bias:
      shapes["router_bias"] = (e,)
    if self.shared_ffn_size:
      shapes.update(shared_in=(h, experts.in_width(self.activation, self.shared_ffn_size)),
                    shared_out=(self.shared_ffn_size, h))
    return shapes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoeOutput:
  """What moe_layer returns for one shard.

  Attributes:
    y: [T, H], x's dtype: the layer's output.
    topk_idx: int32 [T, K]: the experts each token chose (global ids).
    tokens_per_expert: int32 [E_local]: (token, expert) pairs this rank's
      experts received from the whole EP group (after drops; HT), or rows
      received per local expert (LL). With out_specs over the EP axes, the
      global array is the count of every expert.
    dropped: int32 []: pairs this rank received but dropped (HT capacity).
    load_balancing_loss, router_z_loss: float32 [] (jax_ep/moe/balance.py).
    bias_update: float32 [E]: add it to params["router_bias"] (auxiliary-loss-
      free balancing); zeros unless router.selection_bias.
  """

  y: jax.Array
  topk_idx: jax.Array
  tokens_per_expert: jax.Array
  dropped: jax.Array
  load_balancing_loss: jax.Array
  router_z_loss: jax.Array
  bias_update: jax.Array


def ep_size(config: MoeConfig) -> int:
  """R: the EP group's size, from the shard_map's axes (trace time)."""
  try:
    return math.prod(jax.lax.axis_size(name) for name in config.ep.axis_names)
  except NameError as e:
    raise EpConfigError(f"jax_ep.moe.moe_layer runs inside jax.shard_map over the EP axes "
                        f"{config.ep.axis_names}: {e}") from None


def check_inputs(params: Params, x: jax.Array, config: MoeConfig, num_ranks: int) -> None:
  """Trace-time checks of shapes and dtypes, with messages naming the fix."""
  if x.ndim != 2 or x.shape[1] != config.ep.hidden:
    raise EpConfigError(f"moe_layer: x must be [T, H={config.ep.hidden}] per shard, got "
                        f"{x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise EpConfigError(f"moe_layer: x must be floating, got {x.dtype}")
  shapes = config.param_shapes(num_ranks)
  missing = sorted(set(shapes) - set(params))
  if missing:
    raise EpConfigError(f"moe_layer: params lack {missing} (this config needs "
                        f"{sorted(shapes)}; jax_ep.moe.init_params makes them)")
  for name, shape in shapes.items():
    got = tuple(params[name].shape)
    if got != shape:
      raise EpConfigError(f"moe_layer: params[{name!r}] must be {list(shape)} on each of the "
                          f"{num_ranks} EP ranks, got {list(got)}")
    if not jnp.issubdtype(params[name].dtype, jnp.floating):
      raise EpConfigError(f"moe_layer: params[{name!r}] must be floating, got "
                          f"{params[name].dtype}")
  limit = (config.ep.ll_max_tokens if config.exchange == "ll"
           else config.ep.max_tokens_per_rank)
  if x.shape[0] > limit:
    raise EpConfigError(f"moe_layer: {x.shape[0]} tokens per shard, more than the "
                        f"{config.exchange.upper()} limit of {limit} (EpConfig)")


def moe_layer(params: Params, x: jax.Array, *, config: MoeConfig) -> MoeOutput:
  """One MoE layer on this shard's tokens (inside jax.shard_map).

  Args:
    params: this EP rank's shard of the parameters (MoeConfig.param_shapes):
      router float32 [H, E] (replicated), w_in [E_local, H, 2F or F], w_out
      [E_local, F, H] (split over the EP axes); router_bias [E] with
      router.selection_bias; shared_in [H, 2Fs or Fs], shared_out [Fs, H] with
      shared_ffn_size. Weights are cast to x's dtype for the GEMMs.
    x: [T, H] bfloat16 (or float32/float16) tokens of this shard.
    config: MoeConfig.
  Returns:
    MoeOutput; y [T, H] in x's dtype. Differentiable in x and every float
    parameter but router_bias (the bias update replaces its gradient).
  """
  num_ranks = ep_size(config)
  check_inputs(params, x, config, num_ranks)
  logits = routing.router_logits(x, params["router"])
  routed = routing.route(logits, config.ep.num_topk, config.router, params.get("router_bias"))
  if config.exchange == "ht":
    y, tokens_per_expert, dropped = _routed_ht(params, x, routed, config)
  else:
    y, tokens_per_expert, dropped = _routed_ll(params, x, routed, config)
  if config.shared_ffn_size:
    shared = experts.dense_mlp(x, params["shared_in"], params["shared_out"], config.activation)
    y = (y.astype(F32) + shared.astype(F32)).astype(x.dtype)
  stats = balance.balance_stats(logits, routed.probs, routed.topk_idx,
                                rate=config.bias_update_rate, stats_axes=config.stats_axes)
  bias_update = stats.bias_update if config.router.selection_bias else jnp.zeros_like(
      stats.bias_update)
  return MoeOutput(y=y, topk_idx=routed.topk_idx, tokens_per_expert=tokens_per_expert,
                   dropped=dropped, load_balancing_loss=stats.load_balancing_loss,
                   router_z_loss=stats.router_z_loss, bias_update=bias_update)


def _routed_ht(params, x, routed, config: MoeConfig):
  ep = config.ep
  kwargs = dict(config=ep, layout="expert_major", capacity=config.capacity,
                expert_alignment=config.gmm.row_alignment)
  if config.fp8:
    d = jax_ep.dispatch(fp8_lib.quantize(jax.lax.stop_gradient(x)), routed.topk_idx,
                        routed.topk_weights, **kwargs)
    rows = _straight_through(ep, x, fp8_lib.dequantize(d.x, d.scales, x.dtype), d.handle)
  else:
    d = jax_ep.dispatch(x, routed.topk_idx, routed.topk_weights, **kwargs)
    rows = d.x
  weighted = experts.grouped_mlp(rows, d.group_sizes, params["w_in"], params["w_out"],
                                 config.activation, config.gmm, row_weights=d.topk_weights)
  return jax_ep.combine(weighted, d.handle, config=ep), d.tokens_per_expert, d.num_dropped


def _routed_ll(params, x, routed, config: MoeConfig):
  ep = config.ep
  d = jax_ep.low_latency_dispatch(x, routed.topk_idx, config=ep, use_fp8=config.fp8)
  blocks = fp8_lib.dequantize(d.x, d.scales, x.dtype) if config.fp8 else d.x
  slots = blocks.shape[1]
  used = jnp.arange(slots, dtype=jnp.int32)[None, :] < d.count[:, None]     # [E_local, S]
  # Rows at and past count are unspecified: zero them, and their outputs are zero too
  # (both activations map 0 to 0, the GEMMs have no bias).
  blocks = jnp.where(used[:, :, None], blocks, jnp.zeros((), blocks.dtype))
  y = experts.batched_mlp(blocks, params["w_in"], params["w_out"], config.activation)
  out = jax_ep.low_latency_combine(y, routed.topk_idx, routed.topk_weights, d.handle, config=ep)
  return out, d.count, jnp.zeros((), jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _straight_through(ep: EpConfig, x, rows, handle):
  """rows (the dequantised FP8 pair rows) forward; backward, x's gradient is the
  combine of the rows' cotangents (the transpose of the BF16 dispatch)."""
  del x, handle
  return rows


def _straight_through_fwd(ep, x, rows, handle):
  return rows, handle


def _straight_through_bwd(ep, handle, d_rows):
  return jax_ep.combine(d_rows, handle, config=ep), None, None


_straight_through.defvjp(_straight_through_fwd, _straight_through_bwd)
