"""``--mode layer``: a whole MoE layer at EP1 (one process, one GPU), forward and
forward+backward, against MaxText's algorithm and the dense floor, same routing.

Systems (a DeepSeek-V3 rank's share by default: hidden 7168, expert FFN 2048,
32 experts, top-8, SwiGLU, bfloat16):
- jax_ep.moe: moe_layer (router, HT expert-major dispatch, grouped_matmul
  experts, weighted combine), inside shard_map over the one device;
- MaxText's algorithm (argsort permute, SwiGLU experts by jax.lax.ragged_dot,
  weighted unpermute), and the same with grouped_matmul (the fastest grouped
  GEMM measured) in place of ragged_dot;
- jax_ep.moe's expert GEMMs alone: its SwiGLU experts (grouped_matmul) on the
  expert-major rows of the same dispatch, made once outside the timing: the
  layer's time less this is its router, exchange and weighting;
- the floor: dense matmuls of the same useful FLOPs (the expert GEMMs of
  pairs = tokens * top-k rows; forward+backward: their gradients too).
``gmm_implementations`` beyond "auto" (``--layer_gmm``) add jax_ep.moe and its
experts alone on those grouped_matmul implementations, in the same run;
``num_sms`` (``--layer_num_sms``) adds jax_ep.moe rows at those HT SM budgets
(EpGroup.num_sms; the runtime is initialised again for each).
Useful FLOPs: forward 2 * pairs * H * 3F (gate+up and down), forward+backward 3x.
Every system gets the same router weights, so the same routing. The chart of the
rows is drawn from the JSON (benchmarks/plot_layer.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import moe
from jax_ep.moe import experts as moe_experts
from jax_ep.bench import single_device

F32 = jnp.float32
BF16 = jnp.bfloat16
OOM_WORDS = ("RESOURCE_EXHAUSTED", "out of memory", "Out of memory")


def _maxtext_layer(gemm, topk: int):
  """MaxText's dropless algorithm; gemm(rows, w, group_sizes) -> rows' dtype."""

  def layer(params, x):
    num_tokens, hidden = x.shape
    num_experts = params["w_in"].shape[0]
    logits = moe.router_logits(x, params["router"])
    weights, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), topk)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    rows = x[order // idx.shape[1]]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = gemm(rows, params["w_in"].astype(x.dtype), group_sizes)
    gate, up = jnp.split(h.astype(F32), 2, axis=-1)
    out = gemm((jax.nn.silu(gate) * up).astype(x.dtype), params["w_out"].astype(x.dtype),
               group_sizes)
    unsorted = jnp.zeros_like(out).at[order].set(out)
    y = jnp.sum(unsorted.reshape(num_tokens, -1, hidden).astype(F32) * weights[..., None], axis=1)
    return y.astype(x.dtype)

  return layer


def _lax_gemm(rows, w, group_sizes):
  return jax.lax.ragged_dot(rows, w, group_sizes, preferred_element_type=F32).astype(rows.dtype)


def _floor(topk: int):
  """The expert GEMMs' useful FLOPs as two dense bfloat16 matmuls over the pairs' rows.

  Its params are one expert's weights ({"w_in": (H, 2F), "w_out": (F, H)}), so
  the backward computes only the products' gradients. The matmuls take and give
  the rows' dtype (float32 accumulation inside cuBLAS): with a float32 result,
  JAX's transpose would hand the backward's GEMMs float32 cotangents against
  bfloat16 operands, which XLA runs as float32 GEMMs (24.7 ms instead of about
  14 on one H100, 2026-12-07).
  """

  def floor(params, x):
    rows = jnp.broadcast_to(x[:, None], (x.shape[0], topk, x.shape[1])).reshape(-1, x.shape[1])
    h = jnp.matmul(rows, params["w_in"].astype(x.dtype))
    gate, up = jnp.split(h, 2, axis=-1)
    return jnp.matmul(gate * up, params["w_out"].astype(x.dtype))

  return floor


def _expert_major_rows(config, mesh, specs, params, x):
  """The rows and group sizes moe_layer's expert GEMMs get: the same routing and
  expert-major dispatch (aligned to the GEMMs' row tile), run once."""

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                     out_specs=(P("ep"), P("ep")))
  def dispatched(p, xx):
    logits = moe.router_logits(xx, p["router"])
    routed = moe.route(logits, config.ep.num_topk, config.router)
    d = jax_ep.dispatch(xx, routed.topk_idx, routed.topk_weights, config=config.ep,
                        layout="expert_major", expert_alignment=config.gmm.row_alignment)
    return d.x, d.group_sizes

  rows, group_sizes = jax.jit(dispatched)(params, x)
  # Through the host once: plain arrays, like the other systems' inputs (typed by no
  # mesh axis, which ragged_dot's sharding rule would refuse).
  return jnp.asarray(np.asarray(rows)), jnp.asarray(np.asarray(group_sizes))


def _forward_backward(fn):
  """The gradients of sum(y * dy) for a random dy given as an argument: with the
  plain sum(y), y's cotangent is a broadcast constant, from which XLA may simplify
  a dense floor's backward GEMMs (a product with ones is a row sum) but not the
  kernels' (custom calls), and the floor would not be one."""
  def run(params, x, dy):
    def loss(p, xx):
      return jnp.sum(fn(p, xx).astype(F32) * dy.astype(F32))
    return jax.grad(loss, argnums=(0, 1))(params, x)
  return run


LAX_FORWARD_SKIPPED = "not run (--nolayer_lax_forward): asked to leave it out"
LAX_BACKWARD_SKIPPED = (
    "not run (--layer_lax_backward runs it): XLA lowers ragged_dot's weight gradient to a "
    "dense dot over zero-padded groups; at DeepSeek shapes on one H100 (2026-12-07) this "
    "forward+backward ran out of memory or waited in XLA's allocator for minutes")


def run(tokens: int, hidden: int, ffn: int, experts: int, topk: int, seed: int, repeats: int,
        lax_backward: bool = False, lax_forward: bool = True, on_row: Callable[[list[dict]], None] | None = None,
        gmm_implementations: Sequence[str] = ("auto",),
        probes: Sequence = (), num_sms: Sequence[int] = ()) -> tuple[list[dict], dict]:
  """Rows (one per mode and system) and the run's settings; ``on_row`` gets the
  rows so far after each one (the caller saves them as it goes). ``probes``
  (jax_ep.bench.measure.Probe; those not kernels_only) look inside each timing:
  their results go to the meta under their keys, by "mode: system"."""
  ep = jax_ep.EpConfig(num_experts=experts, hidden=hidden, max_tokens_per_rank=tokens,
                       num_topk=topk, group=jax_ep.EpGroup(axis_name="ep"),
                       enable_low_latency=False)
  config = moe.MoeConfig(ep=ep, ffn_size=ffn)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
  jax_ep.initialize(ep, mesh)
  key_params, key_x, key_dy, key_dy_pairs, key_rows_dy = jax.random.split(
      jax.random.key(seed), 5)
  params = moe.init_params(config, key_params, dtype=BF16)
  x = jax.random.normal(key_x, (tokens, hidden), F32).astype(BF16)
  # y's cotangent; the floor's y is one row per pair, its cotangent too.
  dy = jax.random.normal(key_dy, (tokens, hidden), F32).astype(BF16)
  dy_pairs = jax.random.normal(key_dy_pairs, (tokens * topk, hidden), F32).astype(BF16)
  specs = moe.param_specs(config)
  placed = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  x_placed = jax.device_put(x, NamedSharding(mesh, P("ep")))
  dy_placed = jax.device_put(dy, NamedSharding(mesh, P("ep")))

  def jax_ep_layer(layer_config: moe.MoeConfig):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep"))
    def layer(p, xx):
      return moe.moe_layer(p, xx, config=layer_config).y
    return layer

  # The EpConfig each system needs initialised (None: none); one runtime at a time.
  current_ep = [ep]

  def runtime_for(wanted: jax_ep.EpConfig | None) -> None:
    if wanted is not None and wanted != current_ep[0]:
      jax_ep.finalize()
      jax_ep.initialize(wanted, mesh)
      current_ep[0] = wanted

  expert_rows, group_sizes = _expert_major_rows(config, mesh, specs, placed, x_placed)
  expert_rows_dy = jax.random.normal(key_rows_dy, expert_rows.shape, F32).astype(BF16)

  def experts_alone(gmm: moe.GroupedMatmulConfig):
    def run_experts(p, rows_in):
      return moe_experts.grouped_mlp(rows_in, group_sizes, p["w_in"], p["w_out"], "swiglu",
                                     gmm)
    return run_experts

  def on(implementation: str) -> str:
    return "" if implementation == "auto" else f" {implementation}"

  expert_weights = {"w_in": params["w_in"], "w_out": params["w_out"]}
  def with_sms(sms: int) -> moe.MoeConfig:
    return dataclasses.replace(config, ep=dataclasses.replace(
        ep, group=dataclasses.replace(ep.group, num_sms=sms)))

  # (name, function, its forward arguments, y's cotangent for the forward+backward,
  #  the EpConfig it runs on or None)
  systems = [
      (f"jax_ep.moe (HT expert-major, grouped_matmul, {sms} SMs)", jax_ep_layer(with_sms(sms)),
       (placed, x_placed), dy_placed, with_sms(sms).ep)
      for sms in num_sms]
  systems += [
      (f"jax_ep.moe (HT expert-major, grouped_matmul{on(impl)})",
       jax_ep_layer(dataclasses.replace(config, gmm=dataclasses.replace(
           config.gmm, implementation=impl))), (placed, x_placed), dy_placed, ep)
      for impl in gmm_implementations]
  systems += [
      ("MaxText algorithm, jax.lax.ragged_dot", _maxtext_layer(_lax_gemm, topk), (params, x),
       dy, None),
      ("MaxText algorithm, grouped_matmul", _maxtext_layer(moe.grouped_matmul, topk),
       (params, x), dy, None),
  ]
  systems += [
      (f"jax_ep.moe experts alone (grouped_matmul{on(impl)})",
       experts_alone(dataclasses.replace(config.gmm, implementation=impl)),
       (expert_weights, expert_rows), expert_rows_dy, None)
      for impl in gmm_implementations]
  systems += [
      ("floor: dense matmuls, same useful FLOPs", _floor(topk),
       ({"w_in": params["w_in"][0], "w_out": params["w_out"][0]}, x), dy_pairs, None),
  ]
  pairs = tokens * topk
  flops = dict(forward=6.0 * pairs * hidden * ffn, forward_backward=18.0 * pairs * hidden * ffn)
  rows: list[dict] = []
  probed: dict[str, dict[str, dict]] = {}
  probes_by_key = {p.key: p for p in probes}
  for mode in ("forward", "forward_backward"):
    floor_us = None
    for name, fn, args, cotangent, runs_on in reversed(systems):  # the floor first (ratios)
      runtime_for(runs_on)
      timed = fn if mode == "forward" else _forward_backward(fn)
      args = args if mode == "forward" else args + (cotangent,)
      lax_row_wanted = lax_forward if mode == "forward" else lax_backward
      skipped = "ragged_dot" in name and not lax_row_wanted
      if skipped:
        measured = single_device.Measured(None, error=(
            LAX_FORWARD_SKIPPED if mode == "forward" else LAX_BACKWARD_SKIPPED))
      else:
        measured = single_device.measure(
            timed, args, repeats=repeats, check_memory=True,
            probes=[p for p in probes if not p.kernels_only])
        for key, result in measured.probed.items():
          probed.setdefault(key, {})[f"{mode}: {name}"] = result
          print(f"  {key}: {probes_by_key[key].format(result)}", flush=True)
      if name.startswith("floor"):
        floor_us = measured.us
      # Expected: the row left out on purpose, or an out-of-memory (ragged_dot's dense path).
      expected = measured.error is not None and (
          skipped or any(w in measured.error for w in OOM_WORDS))
      row = dict(mode=mode, system=name, us=measured.us, noise_us=measured.noise_us,
                 error=measured.error, expected_failure=expected, peak_bytes=measured.peak_bytes,
                 tflops=flops[mode] / measured.us / 1e6 if measured.us else None,
                 of_floor=floor_us / measured.us if measured.us and floor_us else None)
      rows.append(row)
      print(format_row(row), flush=True)
      if on_row is not None:
        on_row(rows)
  meta = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk, seed=seed,
              pairs=pairs, backward_of="sum(y * dy), dy random bfloat16",
              activation="swiglu", dtype="bfloat16", repeats=repeats,
              useful_flops=flops, expert_alignment=config.gmm.row_alignment,
              gmm_implementations=list(gmm_implementations), num_sms=list(num_sms),
              default_num_sms=ep.num_sms, **probed)
  meta["grouped_matmul"] = {p: v for p, v in vars(moe.grouped_matmul_plan(
      config.gmm, jax.ShapeDtypeStruct((pairs, hidden), BF16),
      jax.ShapeDtypeStruct((experts, hidden, 2 * ffn), BF16))).items() if p != "tiles"}
  return rows, meta


def format_row(row: dict) -> str:
  head = f"{row['mode']:17s} {row['system']:54s}"
  if row["us"] is None:
    error = row["error"] or ""
    if not error:
      return f"{head} below noise"
    return f"{head} {error[:110] if error.startswith('not run') else 'FAILED: ' + error[:110]}"
  peak = f"{row['peak_bytes'] / 2**30:6.1f} GiB" if row["peak_bytes"] else "      ?"
  ratio = f"{row['of_floor']:.2f}x floor" if row["of_floor"] else ""
  return f"{head} {row['us'] / 1e3:9.2f} ms {row['tflops']:6.0f} TF/s {peak}  {ratio}"
