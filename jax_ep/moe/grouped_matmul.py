"""grouped_matmul: rows grouped by expert times each expert's weights, with a VJP.

It is the expert GEMM of an MoE layer on the expert-major dispatch's rows
(``jax_ep.dispatch(..., layout="expert_major")`` gives ``x [M, H]`` and
``group_sizes [E_local]``), with ``jax.lax.ragged_dot``'s meaning. Each of its
three products (forward, input_grad, weight_grad; jax_ep/moe/gmm_impls.py) runs
on the implementation GroupedMatmulConfig picks:

- ``implementation="auto"`` (default): on Hopper GPUs (sm_90) the fastest one
  measured on one H100 for each product (AUTO_ON_SM90; the table in
  docs/benchmarks.md, "Grouped GEMMs"); elsewhere (CPU, TPU, other GPUs)
  ``jax.lax.ragged_dot``. On a GPU that is not sm_90, or where the Hopper
  kernels refuse the operands, the call takes ``jax.lax.ragged_dot``, which XLA
  runs as a dense dot over zero-padded groups there (G times the FLOPs): that
  is announced once, as ``fallback`` says.
- ``"pallas"``, ``"worklist"``, ``"tokamax"``, ``"xla"``: every product on that
  one (``"worklist"``: jax_ep's kernel for the forward and input_grad, the
  Pallas weight_grad); a choice that cannot run here is an error at trace time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_ep import fallbacks
from jax_ep._vma import match_vma, vary_like
from jax_ep.errors import EpConfigError
from jax_ep.moe import gmm_impls
from jax_ep.moe.gmm_impls import PallasTiles

IMPLEMENTATIONS = ("auto", "pallas", "worklist", "tokamax", "xla")
FALLBACK_POLICIES = fallbacks.POLICIES
# The fastest of the tiles tried for all three products on one H100
# (docs/results/gmm-sweep_2026-12-07_34f1b9a.json).
MEASURED_TILES = PallasTiles(block_m=128, block_n=128, block_k=64, stages=4, grid_block_n=4)

# What "auto" runs on sm_90, per product: the fastest correct implementation
# measured (docs/benchmarks.md, "MoE layer and grouped GEMMs";
# docs/results/gmm_2026-12-07_e3338e6.json: the work-list kernel 6-15% faster
# than ragged_dot_mgpu in the forward and input_grad, bit for bit the same;
# the weight_grad is JAX's kernel either way).
AUTO_ON_SM90 = dict(forward="worklist", input_grad="worklist", weight_grad="pallas")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
  """How grouped_matmul runs its products; frozen and hashable.

  Attributes:
    implementation: "auto", "pallas", "worklist", "tokamax" or "xla" (module
      docstring).
    fallback: when "auto" has to take ``jax.lax.ragged_dot`` on a GPU (slow
      there): "warn" logs it once per reason, "error" raises at trace time,
      "allow" stays silent.
    forward_tiles, input_grad_tiles, weight_grad_tiles: the Pallas kernels'
      tiles per product. The forward's ``block_m`` is the row block an
      expert-major dispatch should align its groups to (``row_alignment``).
  """

  implementation: str = "auto"
  fallback: str = "warn"
  forward_tiles: PallasTiles = MEASURED_TILES
  input_grad_tiles: PallasTiles = MEASURED_TILES
  weight_grad_tiles: PallasTiles = MEASURED_TILES

  def __post_init__(self) -> None:
    if self.implementation not in IMPLEMENTATIONS:
      raise EpConfigError(f"GroupedMatmulConfig.implementation must be one of "
                          f"{IMPLEMENTATIONS}, got {self.implementation!r}")
    if self.fallback not in FALLBACK_POLICIES:
      raise EpConfigError(f"GroupedMatmulConfig.fallback must be one of {FALLBACK_POLICIES}, "
                          f"got {self.fallback!r}")

  @property
  def tiles(self) -> dict[str, PallasTiles]:
    return dict(forward=self.forward_tiles, input_grad=self.input_grad_tiles,
                weight_grad=self.weight_grad_tiles)

  @property
  def row_alignment(self) -> int:
    """The expert_alignment that keeps every row block of the forward kernel
    inside one group (no block computed twice at a group boundary)."""
    return self.forward_tiles.block_m


@dataclasses.dataclass(frozen=True)
class Plan:
  """The implementation of each product for one call (static)."""

  forward: str
  input_grad: str
  weight_grad: str
  tiles: tuple[tuple[str, PallasTiles], ...]

  def functions(self):
    tiles = dict(self.tiles)
    return {product: gmm_impls.products(getattr(self, product), tiles)[product]
            for product in gmm_impls.PRODUCTS}


def _announce(config: GroupedMatmulConfig, reason: str) -> None:
  message = (f"jax_ep.moe.grouped_matmul: {reason}, so it runs on jax.lax.ragged_dot, which "
             "XLA lowers on GPUs to a dense dot over zero-padded groups: as many times the "
             "FLOPs as there are groups, and a temporary that size.")
  fallbacks.slower_path(config.fallback, ("grouped_matmul", reason), message,
                        "GroupedMatmulConfig", "runs it anyway")


def _devices() -> tuple[str, bool, str]:
  """(platform of the default devices, whether all are sm_90 GPUs, what they are)."""
  devices = jax.devices()
  platform = devices[0].platform
  if platform != "gpu":
    return platform, False, platform
  capabilities = {getattr(d, "compute_capability", "?") for d in devices}
  return platform, capabilities == {"9.0"}, f"GPUs of compute capability {sorted(capabilities)}"


def plan_for(config: GroupedMatmulConfig, rows: jax.ShapeDtypeStruct,
             w: jax.ShapeDtypeStruct) -> Plan:
  """Which implementation runs each product for operands like these (trace time)."""
  tiles = tuple(config.tiles.items())
  refusal = gmm_impls.pallas_refusal(rows.shape, w.shape, rows.dtype, w.dtype, config.tiles)
  choice = config.implementation
  if choice == "xla":
    return Plan("xla", "xla", "xla", tiles)
  if choice == "tokamax":
    if gmm_impls.tokamax_module() is None:
      raise EpConfigError(f"GroupedMatmulConfig(implementation='tokamax'): tokamax does not "
                          f"import ({gmm_impls.tokamax_import_error()}; pip install "
                          f"'jax_ep[tokamax]')")
    return Plan("tokamax", "tokamax", "tokamax", tiles)
  platform, sm90, devices = _devices()
  if choice in ("pallas", "worklist"):
    if not sm90:
      raise EpConfigError(f"GroupedMatmulConfig(implementation={choice!r}) needs Hopper GPUs "
                          f"(sm_90); the devices here are {devices}")
    if refusal:
      raise EpConfigError(f"GroupedMatmulConfig(implementation={choice!r}): the kernels "
                          f"cannot take these operands: {refusal}")
    return Plan(choice, choice, choice, tiles)
  # auto
  if platform != "gpu":
    return Plan("xla", "xla", "xla", tiles)      # CPU / TPU: ragged_dot is the path there
  if not sm90:
    _announce(config, f"the Hopper kernels need sm_90 and the devices here are {devices}")
    return Plan("xla", "xla", "xla", tiles)
  if refusal:
    _announce(config, f"the Hopper kernels cannot take these operands: {refusal}")
    return Plan("xla", "xla", "xla", tiles)
  return Plan(**AUTO_ON_SM90, tiles=tiles)


def grouped_matmul(rows: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   config: GroupedMatmulConfig = GroupedMatmulConfig()) -> jax.Array:
  """Each group of rows times its expert's weights; differentiable in rows and w.

  Args:
    rows: [M, K] bfloat16/float16/float32: group g is rows
      ``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))``; rows from
      ``sum(group_sizes)`` on belong to no group.
    w: [G, K, N], rows' dtype.
    group_sizes: int32 [G], non-negative, ``sum(group_sizes) <= M``.
    config: GroupedMatmulConfig.
  Returns:
    [M, N] of rows' dtype (accumulated in float32): ``rows[i] @ w[g]`` for a
    row i of group g, zero for rows outside every group.
  """
  if rows.ndim != 2 or w.ndim != 3 or rows.shape[1] != w.shape[1]:
    raise EpConfigError(f"grouped_matmul takes rows [M, K] and w [G, K, N], got rows "
                        f"{rows.shape} and w {w.shape}")
  if group_sizes.shape != (w.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise EpConfigError(f"grouped_matmul: group_sizes must be an int array [G] = "
                        f"[{w.shape[0]}], got {group_sizes.dtype}{list(group_sizes.shape)}")
  if rows.dtype != w.dtype:
    raise EpConfigError(f"grouped_matmul: rows are {rows.dtype} but w is {w.dtype}; cast the "
                        f"weights to the rows' dtype (w.astype(rows.dtype))")
  plan = plan_for(config, rows, w)
  # Inside shard_map the three must vary over the same mesh axes: weights split over
  # the expert axes alone meet rows split over the batch axes too. The pcast's
  # transpose sums the weights' gradient over the axes it added.
  rows, w, group_sizes = match_vma(rows, w, group_sizes.astype(jnp.int32))
  return _grouped_matmul(plan, rows, w, group_sizes)


def _outside_groups_zero(implementation: str, out: jax.Array, group_sizes: jax.Array
                         ) -> jax.Array:
  """Rows at and past sum(group_sizes) set to 0, where ``implementation`` leaves
  them unwritten (JAX's Pallas kernels). The mask is a pass of its own over
  [M, N] when the result goes to a custom call (the layer's combine), so the
  implementations that write the zeros themselves skip it."""
  if implementation in gmm_impls.ZERO_OUTSIDE_GROUPS:
    return out
  in_group = jnp.arange(out.shape[0], dtype=jnp.int32)[:, None] < jnp.sum(group_sizes)
  return jnp.where(in_group, out, jnp.zeros((), out.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped_matmul(plan: Plan, rows, w, group_sizes):
  out = plan.functions()["forward"](rows, w, group_sizes)
  return _outside_groups_zero(plan.forward, vary_like(out, rows), group_sizes)


def _grouped_matmul_fwd(plan, rows, w, group_sizes):
  return _grouped_matmul(plan, rows, w, group_sizes), (rows, w, group_sizes)


def _grouped_matmul_bwd(plan, residuals, d_out):
  rows, w, group_sizes = residuals
  functions = plan.functions()
  d_out = d_out.astype(rows.dtype)
  # A custom VJP's cotangents must vary over the primal inputs' manual axes,
  # which the Pallas kernels' results do not carry.
  d_rows = vary_like(functions["input_grad"](d_out, w, group_sizes), rows)
  d_w = vary_like(functions["weight_grad"](rows, d_out, group_sizes).astype(w.dtype), w)
  return _outside_groups_zero(plan.input_grad, d_rows, group_sizes), d_w, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)
