"""Low-latency steps of the schedule fuzzer (protocol: fuzz_step.py).

The comparisons and their tolerances are those of tests/gpu/test_ll_gpu.py and
tests/gpu/test_ll_presummed_gpu.py, whose docstrings derive them:
  * dispatched rows, counts, sources and rows' weights: bitwise; FP8 rows
    within one e4m3 step of the host's, scales within FP8_SCALE_ULPS, and the
    share of bitwise-equal FP8 bytes as there;
  * the per-pair combine: within LL_COMBINE_ULPS (0) of hr.ll_combine;
  * the pre-summed combine: bitwise with hr.ll_combine_presummed;
  * gradients: grad_x bitwise, grad_w within hr.f32_sum_bound, with dyadic
    weights (test_ll_gradients_match_host_oracle).
The device expert is ll_testing.expert, whose host twin is exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep.config import EpConfig
import host_reference as hr
from fuzz_step import StepCommon, draw_common
from gpu_testing import BF16, F32, assert_bitwise, assert_within_ulp, mine, rows, weights
from ll_testing import expert, host_expert, host_scale, valid_rows
from test_ll_gpu import LL_COMBINE_ULPS, assert_fp8_rows
from test_ll_presummed_gpu import _host_presummed


# ====================================================================== ops
def _dispatch(config: EpConfig, x, idx, split: bool, use_fp8: bool = False, topk_weights=None):
  """One LL dispatch: the one-call op, or its send and recv halves."""
  if split:
    pending = jax_ep.low_latency_dispatch_send(x, idx, config=config, use_fp8=use_fp8,
                                               topk_weights=topk_weights)
    return jax_ep.low_latency_dispatch_recv(pending, config=config)
  return jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8,
                                     topk_weights=topk_weights)


def _combine(config: EpConfig, y, idx, topk_weights, handle, split: bool):
  if split:
    sent = jax_ep.low_latency_combine_send(y, handle, config=config)
    return jax_ep.low_latency_combine_recv(sent, idx, topk_weights, config=config)
  return jax_ep.low_latency_combine(y, idx, topk_weights, handle, config=config)


# ====================================================================== checks
def check_dispatch(d, x: np.ndarray, idx: np.ndarray, w: np.ndarray | None, config: EpConfig,
                   use_fp8: bool) -> None:
  """test_ll_dispatch_matches_host_oracle's comparisons (and, with weights,
  test_ll_dispatch_with_weights_carries_each_rows_weight's)."""
  layout = hr.ll_dispatch(x, idx, config, use_fp8=use_fp8)
  want = mine(layout)
  assert_bitwise(d.count, want.count, "count")
  assert_bitwise(d.handle.recv_src, want.recv_src, "recv_src")
  assert_bitwise(d.num_invalid, want.num_invalid, "num_invalid")
  if w is not None:
    assert_bitwise(d.weights, mine(hr.ll_pair_weights(idx, w, layout)), "rows' weights")
    assert_bitwise(d.handle.row_weights, d.weights, "handle.row_weights")
  valid = valid_rows(d.count, d.x.shape[1])
  if not valid.any():
    return
  if not use_fp8:
    assert_bitwise(d.x[valid], want.x[valid], "rows")
    return
  assert_fp8_rows(d, want, valid)


def check_combine(out, x: np.ndarray, idx: np.ndarray, w: np.ndarray, config: EpConfig,
                  presummed: bool, name: str) -> None:
  """The combine of ll_testing.expert's rows: the per-pair combine within
  LL_COMBINE_ULPS, the pre-summed one bitwise."""
  if presummed:
    want, _, _ = _host_presummed(x, idx, w, config)
    assert_bitwise(out, mine(want), name)
    return
  layout = hr.ll_dispatch(x, idx, config)
  want = hr.ll_combine(host_expert(layout.x, layout.count), idx, w, layout)
  assert out.dtype == want.dtype == BF16, (name, out.dtype)
  assert_within_ulp(out, mine(want), LL_COMBINE_ULPS, name)


# ====================================================================== steps
@dataclasses.dataclass(frozen=True)
class LlDispatchStep:
  """low_latency_dispatch (one call, or send + recv), BF16 or FP8, with or
  without topk_weights."""

  common: StepCommon
  use_fp8: bool
  with_weights: bool
  split: bool
  family: ClassVar[str] = "ll"

  def describe(self) -> str:
    options = ["fp8" if self.use_fp8 else "bf16"] + (["weights"] if self.with_weights else [])
    op = "ll_dispatch_send/recv" if self.split else "ll_dispatch"
    return f"{op}({', '.join(options)})" + self.common.suffix()

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    out = {"x": rows(gen, (num_ranks, self.common.tokens, config.hidden)),
           "idx": self.common.topk_idx(gen, config)}
    if self.with_weights:
      out["w"] = weights(gen, (num_ranks, self.common.tokens, config.num_topk))
    return out

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    return _dispatch(config, a["x"], a["idx"], self.split, self.use_fp8, a.get("w"))

  def check(self, config: EpConfig, a: dict[str, np.ndarray], d: Any) -> None:
    check_dispatch(d, a["x"], a["idx"], a.get("w"), config, self.use_fp8)


@dataclasses.dataclass(frozen=True)
class LlCombineStep:
  """One LL dispatch, ll_testing.expert, then `combines` combines of its
  handle back to back (no dispatch between): per-pair with weights of their
  own each, or pre-summed (the weights given to the dispatch; every combine
  the same result). Either half may be split; split combines are chained (a
  send waits for the previous recv, as the split contract asks)."""

  common: StepCommon
  presummed: bool
  combines: int
  split_dispatch: bool
  split_combine: bool
  family: ClassVar[str] = "ll"

  def describe(self) -> str:
    dispatch = "ll_dispatch_send/recv" if self.split_dispatch else "ll_dispatch"
    combine = "ll_combine_send/recv" if self.split_combine else "ll_combine"
    kind = "pre-summed" if self.presummed else "per-pair"
    return (f"{dispatch}{'(weights)' if self.presummed else ''} -> expert -> "
            f"{self.combines}x {combine}({kind})" + self.common.suffix())

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    shape = (num_ranks, self.common.tokens)
    out = {"x": rows(gen, shape + (config.hidden,)), "idx": self.common.topk_idx(gen, config)}
    for i in range(1 if self.presummed else self.combines):
      out[f"w{i}"] = weights(gen, shape + (config.num_topk,))
    return out

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    x, idx = a["x"], a["idx"]
    d = _dispatch(config, x, idx, self.split_dispatch,
                  topk_weights=a["w0"] if self.presummed else None)
    y = expert(d.x)
    outs = []
    for i in range(self.combines):
      y_i = y if not (self.split_combine and outs) else jax.lax.optimization_barrier(
          (y, outs[-1]))[0]
      outs.append(_combine(config, y_i, idx, None if self.presummed else a[f"w{i}"], d.handle,
                           self.split_combine))
    return {"count": d.count, "outs": tuple(outs)}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    layout = hr.ll_dispatch(a["x"], a["idx"], config)
    assert_bitwise(out["count"], mine(layout.count), "count")
    for i, combined in enumerate(out["outs"]):
      check_combine(combined, a["x"], a["idx"], a["w0" if self.presummed else f"w{i}"], config,
                    self.presummed, f"combine {i}")


@dataclasses.dataclass(frozen=True)
class LlGradStep:
  """jax.grad of low_latency_dispatch -> expert -> low_latency_combine w.r.t.
  x and topk_weights, the weights at the combine or at the dispatch (the
  pre-summed combine), as test_ll_gradients_match_host_oracle: each rank's loss
  is sum(f32(out) * cot_r) with its own cotangent (no psum). With
  `with_forward` the forward combine's output is returned and checked too;
  without, it is dead, and XLA may run the gradient's combines back to back."""

  common: StepCommon
  weights_at: str  # "combine" or "dispatch"
  with_forward: bool
  family: ClassVar[str] = "ll"

  def describe(self) -> str:
    forward = "checked" if self.with_forward else "unused"
    return (f"grad(ll_dispatch -> expert -> ll_combine, weights at {self.weights_at}, "
            f"forward {forward})" + self.common.suffix())

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    return self.common.grad_inputs(config, num_ranks)

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    idx, cot = a["idx"], a["cot"]

    def loss(x, w):
      if self.weights_at == "dispatch":
        d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
        out = jax_ep.low_latency_combine(expert(d.x), idx, None, d.handle, config=config)
      else:
        d = jax_ep.low_latency_dispatch(x, idx, config=config)
        out = jax_ep.low_latency_combine(expert(d.x), idx, w, d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) * cot), out

    (grad_x, grad_w), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(a["x"], a["w"])
    return {"grad_x": grad_x, "grad_w": grad_w, "out": out if self.with_forward else None}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    x, idx, w, cot = a["x"], a["idx"], a["w"], a["cot"]
    layout = hr.ll_dispatch(x, idx, config)
    y = host_expert(layout.x, layout.count)
    vjp = hr.ll_combine_vjp(cot.astype(BF16), y, idx, w, layout)
    c = host_scale(y.shape[1])[:, :, None, None]
    ct_rows = (vjp.grad_y.astype(F32) * c).astype(BF16)
    assert_bitwise(out["grad_x"], mine(hr.ll_dispatch_vjp(ct_rows, idx, layout)), "grad x")
    grad_w = out["grad_w"]
    assert grad_w.dtype == np.float32, grad_w.dtype
    error = np.abs(grad_w.astype(np.float64) - mine(vjp.grad_weights))
    bound = hr.f32_sum_bound(mine(vjp.grad_weights_abs), vjp.terms)
    assert np.all(error <= bound), (
        f"grad w: {float(error.max())} above the bound by {float((error - bound).max())}")
    assert np.all(grad_w[mine(idx) < 0] == 0) and np.all(grad_w[mine(idx) >= config.num_experts]
                                                         == 0), "grad w of invalid entries"
    if self.with_forward:
      check_combine(out["out"], x, idx, w, config, self.weights_at == "dispatch", "forward")


# ====================================================================== drawing
def draw(gen: np.random.Generator, config_tokens: int, num_ranks: int, chained: bool):
  """One LL step. In a chained program (LL steps in order, split ops allowed)
  every step's ops must all be live, so that the next step's fence follows
  all of them: a gradient there returns its forward result."""
  kind = gen.choice(["dispatch", "combine", "grad"], p=[0.2, 0.45, 0.35])
  common = draw_common(gen, num_ranks, config_tokens)
  if kind == "dispatch":
    return LlDispatchStep(common, use_fp8=bool(gen.random() < 0.5),
                          with_weights=bool(gen.random() < 0.4),
                          split=chained and bool(gen.random() < 0.7))
  if kind == "combine":
    split_dispatch, split_combine = (
        [(True, False), (False, True), (True, True), (False, False)][gen.integers(4)]
        if chained else (False, False))
    return LlCombineStep(common, presummed=bool(gen.random() < 0.4),
                         combines=int(gen.choice([1, 2, 3], p=[0.4, 0.35, 0.25])),
                         split_dispatch=split_dispatch, split_combine=split_combine)
  return LlGradStep(common, weights_at=("combine", "dispatch")[gen.integers(2)],
                    with_forward=chained or bool(gen.random() < 0.4))
