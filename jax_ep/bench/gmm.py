"""``--mode gmm``: the expert GEMMs' three products on every implementation, EP1.

For each GEMM of a SwiGLU expert layer (gate+up: K = hidden, N = 2 * ffn;
down: K = ffn, N = hidden), rows grouped as an expert-major dispatch groups
them (top-k routing of random logits, groups aligned to 128 rows), it times
forward, input_grad and weight_grad (jax_ep/moe/gmm_impls.py) on ``xla``
(jax.lax.ragged_dot), ``pallas`` (JAX's Mosaic GPU kernels), ``worklist``
(jax_ep's forward / input_grad kernel, jax_ep/moe/worklist_gmm.py) and ``tokamax``
(when installed), next to the floor: one dense matmul with the same useful
FLOPs (2 * pairs * K * N, pairs = tokens * top-k). ``--gmm_sweep`` also times
the Pallas and work-list kernels at other tiles.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_ep.bench import single_device
from jax_ep.moe import gmm_impls
from jax_ep.moe.gmm_impls import PallasTiles
from jax_ep.moe.grouped_matmul import GroupedMatmulConfig

F32 = jnp.float32
ALIGNMENT = 128

# Tiles tried by --gmm_sweep (shared memory permitting: a refusal is a row).
# (128, 256) tiles ran at a sixth of the others on an H100 (gmm-sweep_2026-12-07_34f1b9a).
SWEEP = dict(
    forward=[PallasTiles(128, 128, 64, 4, 1), PallasTiles(128, 128, 64, 4, 8),
             PallasTiles(128, 128, 64, 4, 16), PallasTiles(128, 128, 64, 5, 4),
             PallasTiles(64, 256, 64, 4, 4), PallasTiles(128, 128, 128, 3, 4)],
    weight_grad=[PallasTiles(128, 128, 64, 4, 1), PallasTiles(128, 128, 64, 4, 8),
                 PallasTiles(128, 128, 64, 5, 4), PallasTiles(128, 128, 128, 3, 4)])
SWEEP["input_grad"] = SWEEP["forward"]


def group_sizes_of(tokens: int, experts: int, topk: int, seed: int) -> tuple[np.ndarray, int]:
  """(aligned group sizes int32[E], pairs): top-k of random logits, as routed."""
  logits = np.random.default_rng(seed).standard_normal((tokens, experts))
  chosen = np.argsort(-logits, axis=1)[:, :topk]
  counts = np.bincount(chosen.reshape(-1), minlength=experts)
  return (-(-counts // ALIGNMENT) * ALIGNMENT).astype(np.int32), int(counts.sum())


def _operands(rows: int, k: int, n: int, group_sizes: np.ndarray, seed: int):
  key_rows, key_w, key_out = jax.random.split(jax.random.key(seed), 3)
  used = int(group_sizes.sum())
  in_group = (jnp.arange(rows) < used)[:, None]
  lhs = jnp.where(in_group, jax.random.normal(key_rows, (rows, k), F32), 0).astype(jnp.bfloat16)
  d_out = jnp.where(in_group, jax.random.normal(key_out, (rows, n), F32), 0).astype(jnp.bfloat16)
  w = (jax.random.normal(key_w, (len(group_sizes), k, n), F32) / np.sqrt(k)).astype(jnp.bfloat16)
  return lhs, w, d_out, jnp.asarray(group_sizes)


def _product_calls(implementation: str, tiles: PallasTiles | None) -> dict[str, Callable]:
  table = gmm_impls.products(implementation, {p: tiles or PallasTiles()
                                              for p in gmm_impls.PRODUCTS})
  return dict(forward=lambda lhs, w, d_out, gs: table["forward"](lhs, w, gs),
              input_grad=lambda lhs, w, d_out, gs: table["input_grad"](d_out, w, gs),
              weight_grad=lambda lhs, w, d_out, gs: table["weight_grad"](lhs, d_out, gs))


def _floor_calls(pairs: int) -> dict[str, Callable]:
  def mm(a, b):
    return jnp.matmul(a, b, preferred_element_type=F32).astype(a.dtype)
  return dict(forward=lambda lhs, w, d_out, gs: mm(lhs[:pairs], w[0]),
              input_grad=lambda lhs, w, d_out, gs: mm(d_out[:pairs], w[0].T),
              weight_grad=lambda lhs, w, d_out, gs: mm(lhs[:pairs].T, d_out[:pairs]))


def run(tokens: int, hidden: int, ffn: int, experts: int, topk: int, seed: int, sweep: bool,
        repeats: int, on_row: Callable[[list[dict]], None] | None = None,
        implementations: Sequence[str] = ("xla", "pallas", "worklist", "tokamax")
        ) -> tuple[list[dict], dict]:
  """Rows (one per shape, product, system) and the run's settings; ``on_row``
  gets the rows so far after each one (the caller saves them as it goes).
  ``implementations``: those timed beside the floor, where they can run."""
  group_sizes, pairs = group_sizes_of(tokens, experts, topk, seed)
  rows_m = -(-(tokens * topk + experts * (ALIGNMENT - 1)) // ALIGNMENT) * ALIGNMENT
  default = GroupedMatmulConfig()
  systems: list[tuple[str, str, PallasTiles | None]] = [("floor (dense matmul)", "floor", None)]
  if "xla" in implementations:
    systems.append(("xla", "xla", None))
  on_gpu = jax.devices()[0].platform == "gpu"
  if on_gpu:                  # Mosaic GPU kernels: no CPU path but Pallas' interpreter
    systems += [(impl, impl, None) for impl in ("pallas", "worklist") if impl in implementations]
  if "tokamax" not in implementations:
    pass
  elif gmm_impls.tokamax_module() is not None and on_gpu:
    systems.append(("tokamax", "tokamax", None))
  elif on_gpu:
    print(f"tokamax: not timed, it does not import ({gmm_impls.tokamax_import_error()}; "
          "pip install 'jax_ep[tokamax]')", flush=True)
  out: list[dict] = []
  for gemm, k, n in (("gate_up", hidden, 2 * ffn), ("down", ffn, hidden)):
    args = _operands(rows_m, k, n, group_sizes, seed)
    flops = 2.0 * pairs * k * n
    for product in gmm_impls.PRODUCTS:
      floor_us = None
      candidates = [(name, impl, tiles or default.tiles[product]) for name, impl, tiles in systems]
      if sweep and on_gpu:
        # The work-list kernel's weight_grad is the Pallas one: swept once.
        swept = [impl for impl in ("pallas", "worklist") if impl in implementations
                 and not (impl == "worklist" and product == "weight_grad")]
        candidates += [(f"{impl} {dataclasses.astuple(t)}", impl, t)
                       for impl in swept for t in SWEEP[product]]
      for name, impl, tiles in candidates:
        fn = (_floor_calls(pairs) if impl == "floor"
              else _product_calls(impl, tiles))[product]
        measured = single_device.measure(fn, args, repeats=repeats)
        if impl == "floor":
          floor_us = measured.us
        row = dict(gemm=gemm, k=k, n=n, product=product, system=name, implementation=impl,
                   tiles=dataclasses.asdict(tiles) if impl in ("pallas", "worklist") else None,
                   us=measured.us, noise_us=measured.noise_us, error=measured.error,
                   peak_bytes=measured.peak_bytes,
                   tflops=flops / measured.us / 1e6 if measured.us else None,
                   of_floor=floor_us / measured.us if measured.us and floor_us else None)
        out.append(row)
        print(format_row(row), flush=True)
        if on_row is not None:
          on_row(out)
  meta = dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk, seed=seed,
              pairs=pairs, rows=rows_m, alignment=ALIGNMENT, repeats=repeats,
              group_sizes=group_sizes.tolist(), useful_flops="2 * pairs * K * N",
              implementations=[name for name, _, _ in systems])
  return out, meta


def format_row(row: dict) -> str:
  if row["us"] is None:
    what = f"FAILED: {row['error'][:120]}" if row["error"] else "below noise"
    return f"{row['gemm']:8s} {row['product']:11s} {row['system']:34s} {what}"
  ratio = f"{row['of_floor']:.2f}x floor" if row["of_floor"] else ""
  return (f"{row['gemm']:8s} {row['product']:11s} {row['system']:34s} {row['us']:10.1f} us "
          f"{row['tflops']:6.0f} TF/s {ratio}")
