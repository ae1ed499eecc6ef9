"""High-throughput steps of the schedule fuzzer, token-major and expert-major
(protocol: fuzz_step.py).

The comparisons and their tolerances are those of tests/gpu/test_ht_gpu.py and
tests/gpu/test_expert_major_gpu.py, whose docstrings derive them: every
dispatched field, every combine and combine's VJP bitwise (the kernels move
bytes; combines sum in float32 in the contract's order from +0.0, rounded
once); gradients: grad_x bitwise, the weight gradient's dot products within
hr.f32_sum_bound. Weights are dyadic (gpu_testing.dyadic_weights), so the
device experts below are exact twins of their host versions: a row times
(1 + a dyadic weight sum) is exact in float32 before its one rounding.
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
from fuzz_step import StepCommon, dispatch_text, draw_common
from gpu_testing import BF16, F32, assert_bitwise, dyadic_weights, mine, rows, weights
from test_expert_major_gpu import _assert_dispatch as assert_expert_major_dispatch
from test_ht_gpu import _assert_dispatch as assert_token_major_dispatch
from test_ht_gpu import _expert, _host_expert, host_grads

# Row payloads of a dispatch: bf16 or float32 rows, FP8 pairs with float32 or
# power-of-two (float8_e8m0fnu) scales.
PAYLOADS = ("bf16", "f32", "fp8", "fp8_e8m0")
Y_DTYPES = {"bf16": BF16, "f32": F32}


def _host_payload(x: np.ndarray, payload: str):
  """The global rows (or FP8 pair) a dispatch of `payload` sends, from bf16 x."""
  if payload == "bf16":
    return x
  if payload == "f32":
    return x.astype(F32)
  if payload == "fp8":
    return hr.quantize_fp8(x)
  return hr.quantize_fp8(x, round_scale=True, scale_dtype=hr.FLOAT8_E8M0)


def _payload_inputs(x: np.ndarray, payload: str) -> dict[str, np.ndarray]:
  sent = _host_payload(x, payload)
  return {"q": sent[0], "s": sent[1]} if isinstance(sent, tuple) else {"x": sent}


def _device_payload(a: dict[str, Any]):
  return (a["q"], a["s"]) if "q" in a else a["x"]


def _host_sent(a: dict[str, np.ndarray]):
  return (a["q"], a["s"]) if "q" in a else a["x"]


def _em_expert(d):
  """Expert-major device expert: bf16(f32(pair row) * (1 + pair weight))."""
  return (d.x.astype(jnp.float32) * (1 + d.topk_weights)[:, None]).astype(jnp.bfloat16)


def _host_em_expert(layout: hr.ExpertMajorDispatch) -> np.ndarray:
  scale = np.float32(1) + layout.topk_weights
  return (layout.x.astype(F32) * scale[..., None]).astype(BF16)


def _expert_major_weight_moves(ct_pair: np.ndarray, topk_idx: np.ndarray, config: EpConfig,
                               layout: hr.ExpertMajorDispatch) -> np.ndarray:
  """float64[R, T, K]: grad_w[s, t, k] = ct_pair[owner of e_k, row of the
  pair], 0 for invalid or dropped entries: the weight part of
  hr.ht_dispatch_expert_major_vjp, kept in float64 (exact values for the
  bound) instead of cast to float32."""
  clean, _ = hr.clean_topk(topk_idx, config.num_experts)
  experts_per_rank = config.experts_per_rank(clean.shape[0])
  src, token = np.indices(clean.shape[:2])
  out = np.zeros(clean.shape, np.float64)
  for k in range(clean.shape[2]):
    expert = clean[:, :, k]
    owner, local = np.divmod(np.maximum(expert, 0), experts_per_rank)
    row = layout.pair_row[src, token, owner, local]
    out[:, :, k] = np.where((expert >= 0) & (row >= 0), ct_pair[owner, np.maximum(row, 0)], 0.0)
  return out


def _assert_weight_grad(grad_w: np.ndarray, want: np.ndarray, want_abs: np.ndarray, terms: int,
                        idx: np.ndarray, config: EpConfig) -> None:
  assert grad_w.dtype == np.float32, grad_w.dtype
  error = np.abs(grad_w.astype(np.float64) - want)
  bound = hr.f32_sum_bound(want_abs, terms)
  assert np.all(error <= bound), (
      f"grad w: {float(error.max())} above the bound by {float((error - bound).max())}")
  assert np.all(grad_w[idx < 0] == 0) and np.all(grad_w[idx >= config.num_experts] == 0), (
      "grad w of invalid entries")


def _grads(loss, x_only: bool, a: dict[str, Any]):
  """jax.grad of ``loss(x, w) -> (value, aux)`` at a["x"], a["w"], w.r.t. x
  alone or x and w: (grad_x, grad_w or None, aux)."""
  if x_only:
    grad_x, aux = jax.grad(loss, has_aux=True)(a["x"], a["w"])
    return grad_x, None, aux
  (grad_x, grad_w), aux = jax.grad(loss, argnums=(0, 1), has_aux=True)(a["x"], a["w"])
  return grad_x, grad_w, aux


# ====================================================================== token-major
@dataclasses.dataclass(frozen=True)
class HtRoundTripStep:
  """dispatch (BF16, float32 or FP8 rows; optional capacity), then `combines`
  combines of its handle back to back: the first of test_ht_gpu._expert's
  rows, the others of random rows (garbage on padding rows too)."""

  common: StepCommon
  payload: str
  capacity: int | None
  combines: int
  y_dtype: str
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    return (dispatch_text(self.payload, self.capacity, self.combines, self.y_dtype)
            + self.common.suffix())

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    shape = (num_ranks, self.common.tokens)
    out = _payload_inputs(rows(gen, shape + (config.hidden,)), self.payload)
    out["idx"] = self.common.topk_idx(gen, config)
    out["w"] = dyadic_weights(gen, shape + (config.num_topk,))
    capacity = self.capacity or config.capacity(num_ranks)
    for i in range(1, self.combines):
      out[f"y{i}"] = rows(gen, (num_ranks, capacity, config.hidden), Y_DTYPES[self.y_dtype])
    return out

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    d = jax_ep.dispatch(_device_payload(a), a["idx"], a["w"], config=config,
                        capacity=self.capacity)
    outs = [jax_ep.combine(_expert(d.x, d.topk_weights) if i == 0 else a[f"y{i}"], d.handle,
                           config=config) for i in range(self.combines)]
    return {"d": d, "outs": tuple(outs)}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    layout = hr.ht_dispatch(_host_sent(a), a["idx"], a["w"], config, self.capacity)
    assert_token_major_dispatch(out["d"], layout)
    for i, combined in enumerate(out["outs"]):
      y = _host_expert(layout.x, layout.topk_weights) if i == 0 else a[f"y{i}"]
      assert_bitwise(combined, mine(hr.ht_combine(y, layout)), f"combine {i}")


@dataclasses.dataclass(frozen=True)
class HtGradStep:
  """jax.grad of dispatch -> test_ht_gpu._expert -> combine w.r.t. x, or x and
  topk_weights, as test_ht_gradients_match_host_oracle (per-rank cotangent, no
  psum); with `with_forward` the forward combine is returned and checked."""

  common: StepCommon
  wrt: str  # "x" or "x_and_w"
  with_forward: bool
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    forward = "checked" if self.with_forward else "unused"
    return (f"grad(dispatch -> expert -> combine, w.r.t. {self.wrt}, forward {forward})"
            + self.common.suffix())

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    return self.common.grad_inputs(config, num_ranks)

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    idx, cot = a["idx"], a["cot"]

    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      out = jax_ep.combine(_expert(d.x, d.topk_weights), d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) * cot), out

    grad_x, grad_w, out = _grads(loss, self.wrt == "x", a)
    return {"grad_x": grad_x, "grad_w": grad_w, "out": out if self.with_forward else None}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    x, idx, w, cot = a["x"], a["idx"], a["w"], a["cot"]
    want_x, want_w, want_abs = host_grads(x, idx, w, cot, config)
    assert_bitwise(out["grad_x"], mine(want_x), "grad x")
    if self.wrt != "x":
      _assert_weight_grad(out["grad_w"], mine(want_w), mine(want_abs), config.hidden, mine(idx),
                          config)
    if self.with_forward:
      layout = hr.ht_dispatch(x, idx, w, config)
      want = hr.ht_combine(_host_expert(layout.x, layout.topk_weights), layout)
      assert_bitwise(out["out"], mine(want), "forward")


@dataclasses.dataclass(frozen=True)
class HtCombineVjpStep:
  """jax.vjp of combine alone (on CUDA the dispatch kernel along the cached
  routing), as test_combine_backward_is_the_cached_dispatch; with capacity drops."""

  common: StepCommon
  capacity: int | None
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    cap = f"(capacity {self.capacity})" if self.capacity else ""
    return f"dispatch{cap} -> vjp(combine)" + self.common.suffix()

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    shape = (num_ranks, self.common.tokens)
    return {"x": rows(gen, shape + (config.hidden,)), "g": rows(gen, shape + (config.hidden,)),
            "idx": self.common.topk_idx(gen, config),
            "w": weights(gen, shape + (config.num_topk,))}

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    d = jax_ep.dispatch(a["x"], a["idx"], a["w"], config=config, capacity=self.capacity)
    _, vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle, config=config), d.x)
    return vjp(a["g"])[0]

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    layout = hr.ht_dispatch(a["x"], a["idx"], a["w"], config, self.capacity)
    assert_bitwise(out, mine(hr.ht_combine_vjp(a["g"], layout)), "combine vjp")


@dataclasses.dataclass(frozen=True)
class HtLayoutStep:
  """get_dispatch_layout (XLA's fused layout on every backend), bitwise."""

  common: StepCommon
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    return "get_dispatch_layout" + self.common.suffix()

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    return {"idx": self.common.topk_idx(self.common.generator(), config)}

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    return jax_ep.get_dispatch_layout(a["idx"], config=config)

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    want = hr.get_dispatch_layout(a["idx"], config)
    for name, got, expected in zip(("tokens_per_rank", "tokens_per_expert", "is_token_in_rank"),
                                   out, want):
      assert_bitwise(got, mine(expected), name)


# ====================================================================== expert-major
@dataclasses.dataclass(frozen=True)
class ExpertMajorStep:
  """dispatch(layout="expert_major", expert_alignment=A), optional capacity
  (pairs dropped past it), then `combines` combines back to back: the first
  of _em_expert's rows, the others of random rows."""

  common: StepCommon
  alignment: int
  payload: str
  capacity: int | None
  combines: int
  y_dtype: str
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    return (dispatch_text(f"expert_major, A={self.alignment}, {self.payload}", self.capacity,
                          self.combines, self.y_dtype) + self.common.suffix())

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    shape = (num_ranks, self.common.tokens)
    out = _payload_inputs(rows(gen, shape + (config.hidden,)), self.payload)
    out["idx"] = self.common.topk_idx(gen, config)
    out["w"] = dyadic_weights(gen, shape + (config.num_topk,))
    pair_rows = self.capacity or hr.expert_major_rows(config, num_ranks, self.alignment)
    for i in range(1, self.combines):
      out[f"y{i}"] = rows(gen, (num_ranks, pair_rows, config.hidden), Y_DTYPES[self.y_dtype])
    return out

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    d = jax_ep.dispatch(_device_payload(a), a["idx"], a["w"], config=config,
                        layout="expert_major", expert_alignment=self.alignment,
                        capacity=self.capacity)
    outs = [jax_ep.combine(_em_expert(d) if i == 0 else a[f"y{i}"], d.handle, config=config)
            for i in range(self.combines)]
    return {"d": d, "outs": tuple(outs)}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    layout = hr.ht_dispatch_expert_major(_host_sent(a), a["idx"], a["w"], config,
                                         alignment=self.alignment, capacity=self.capacity)
    assert_expert_major_dispatch(out["d"], mine(layout))
    for i, combined in enumerate(out["outs"]):
      y = _host_em_expert(layout) if i == 0 else a[f"y{i}"]
      assert_bitwise(combined, mine(hr.ht_combine_expert_major(y, layout)), f"combine {i}")


@dataclasses.dataclass(frozen=True)
class ExpertMajorGradStep:
  """Gradients of the expert-major ops.

  mode "vjp": jax.vjp of both ops on random cotangents, bitwise with the host
  VJPs (test_expert_major_gradients_match_host_vjps). Modes "x" and
  "x_and_w": jax.grad of dispatch -> _em_expert -> combine with a per-rank
  cotangent. grad_x is bitwise: the combine's VJP moves bf16(cot), the
  expert's multiplies by the exact 1 + w and rounds once, and the dispatch's
  is the expert-major combine of those rows (float32, per rank in ascending
  local expert, then rank order: hr.ht_dispatch_expert_major_vjp). The pair
  weight's cotangent is sum_h f32(ct_y) * f32(row), products of bf16 numbers
  summed in float32 in an unspecified order: within hr.f32_sum_bound; its move
  to grad_w is exact (one term).
  """

  common: StepCommon
  alignment: int
  mode: str  # "vjp", "x" or "x_and_w"
  with_forward: bool
  family: ClassVar[str] = "ht"

  def describe(self) -> str:
    if self.mode == "vjp":
      what = f"vjp(expert_major dispatch, A={self.alignment}) + vjp(combine)"
    else:
      forward = "checked" if self.with_forward else "unused"
      what = (f"grad(expert_major dispatch A={self.alignment} -> expert -> combine, w.r.t. "
              f"{self.mode}, forward {forward})")
    return what + self.common.suffix()

  def host_inputs(self, config: EpConfig, num_ranks: int) -> dict[str, np.ndarray]:
    gen = self.common.generator()
    shape = (num_ranks, self.common.tokens)
    out = {"x": rows(gen, shape + (config.hidden,)), "idx": self.common.topk_idx(gen, config),
           "w": dyadic_weights(gen, shape + (config.num_topk,))}
    if self.mode == "vjp":
      pair_rows = hr.expert_major_rows(config, num_ranks, self.alignment)
      out["g"] = rows(gen, shape + (config.hidden,))
      out["ct_x"] = rows(gen, (num_ranks, pair_rows, config.hidden))
      out["ct_w"] = gen.standard_normal((num_ranks, pair_rows), dtype=np.float32)
    else:
      out["cot"] = gen.standard_normal(shape + (config.hidden,), dtype=np.float32)
    return out

  def device(self, config: EpConfig, a: dict[str, Any]) -> Any:
    kwargs = dict(config=config, layout="expert_major", expert_alignment=self.alignment)
    idx = a["idx"]
    if self.mode == "vjp":
      d = jax_ep.dispatch(a["x"], idx, a["w"], **kwargs)
      _, combine_vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle, config=config), d.x)

      def dispatched(x, w):
        res = jax_ep.dispatch(x, idx, w, **kwargs)
        return res.x, res.topk_weights

      _, dispatch_vjp = jax.vjp(dispatched, a["x"], a["w"])
      grad_x, grad_w = dispatch_vjp((a["ct_x"], a["ct_w"]))
      return {"grad_y": combine_vjp(a["g"])[0], "grad_x": grad_x, "grad_w": grad_w}
    cot = a["cot"]

    def loss(x, w):
      d = jax_ep.dispatch(x, idx, w, **kwargs)
      out = jax_ep.combine(_em_expert(d), d.handle, config=config)
      return jnp.sum(out.astype(jnp.float32) * cot), out

    grad_x, grad_w, out = _grads(loss, self.mode == "x", a)
    return {"grad_x": grad_x, "grad_w": grad_w, "out": out if self.with_forward else None}

  def check(self, config: EpConfig, a: dict[str, np.ndarray], out: Any) -> None:
    x, idx, w = a["x"], a["idx"], a["w"]
    layout = hr.ht_dispatch_expert_major(x, idx, w, config, alignment=self.alignment)
    if self.mode == "vjp":
      assert_bitwise(out["grad_y"], mine(hr.ht_combine_expert_major_vjp(a["g"], layout)),
                     "combine vjp")
      want_x, want_w = hr.ht_dispatch_expert_major_vjp(a["ct_x"], a["ct_w"], idx, config, layout)
      assert_bitwise(out["grad_x"], mine(want_x), "dispatch vjp x")
      assert_bitwise(out["grad_w"], mine(want_w), "dispatch vjp topk_weights")
      return
    scale = np.float32(1) + layout.topk_weights                              # [R, M], exact
    ct_y = hr.ht_combine_expert_major_vjp(a["cot"].astype(BF16), layout).astype(F32)
    ct_rows = (ct_y * scale[..., None]).astype(BF16)
    no_weights = np.zeros(layout.topk_weights.shape, F32)
    want_x, _ = hr.ht_dispatch_expert_major_vjp(ct_rows, no_weights, idx, config, layout)
    assert_bitwise(out["grad_x"], mine(want_x), "grad x")
    if self.mode == "x_and_w":
      terms = ct_y.astype(np.float64) * layout.x.astype(np.float64)
      want_w = _expert_major_weight_moves(terms.sum(-1), idx, config, layout)
      want_abs = _expert_major_weight_moves(np.abs(terms).sum(-1), idx, config, layout)
      _assert_weight_grad(out["grad_w"], mine(want_w), mine(want_abs), config.hidden, mine(idx),
                          config)
    if self.with_forward:
      want = hr.ht_combine_expert_major(_host_em_expert(layout), layout)
      assert_bitwise(out["out"], mine(want), "forward")


# ====================================================================== drawing
def _capacity(gen: np.random.Generator, full: int, step: int = 1) -> int | None:
  """None (the default) mostly, else a multiple of `step` in [step, full]."""
  if gen.random() < 0.7:
    return None
  return step * int(gen.integers(1, full // step + 1))


def draw(gen: np.random.Generator, config: EpConfig, num_ranks: int):
  """One HT step for `config` (its shapes) at R = num_ranks."""
  kind = gen.choice(["round_trip", "grad", "combine_vjp", "layout", "expert_major",
                     "expert_major_grad"], p=[0.25, 0.2, 0.1, 0.05, 0.2, 0.2])
  common = draw_common(gen, num_ranks, config.max_tokens_per_rank)
  combines = int(gen.choice([0, 1, 2, 3], p=[0.15, 0.4, 0.25, 0.2]))
  y_dtype = ("bf16", "f32")[gen.integers(2)]
  if kind == "round_trip":
    return HtRoundTripStep(common, payload=PAYLOADS[gen.integers(len(PAYLOADS))],
                           capacity=_capacity(gen, config.capacity(num_ranks)),
                           combines=combines, y_dtype=y_dtype)
  if kind == "grad":
    return HtGradStep(common, wrt=("x", "x_and_w")[gen.integers(2)],
                      with_forward=bool(gen.random() < 0.4))
  if kind == "combine_vjp":
    return HtCombineVjpStep(common, capacity=_capacity(gen, config.capacity(num_ranks)))
  if kind == "layout":
    return HtLayoutStep(common)
  alignment = int((1, 8, 16)[gen.integers(3)])
  if kind == "expert_major":
    return ExpertMajorStep(
        common, alignment=alignment, payload=("bf16", "f32", "fp8")[gen.integers(3)],
        capacity=_capacity(gen, hr.expert_major_rows(config, num_ranks, alignment), alignment),
        combines=min(combines, 2), y_dtype=y_dtype)
  return ExpertMajorGradStep(common, alignment=alignment,
                             mode=("vjp", "x", "x_and_w")[gen.integers(3)],
                             with_forward=bool(gen.random() < 0.4))
