"""Shared pieces of the benchmarks: routing like DeepEP's tests, results table."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np


def deepep_routing(rng: np.random.Generator, num_tokens: int, num_experts: int,
                   num_topk: int) -> np.ndarray:
  """Top-k of |N(0,1)|+1 scores per token: distinct experts, uniform load (DeepEP's tests)."""
  scores = np.abs(rng.standard_normal((num_tokens, num_experts))) + 1
  return np.argsort(-scores, axis=1)[:, :num_topk].astype(np.int32)


def random_rows(rng: np.random.Generator, shape, dtype=jnp.bfloat16) -> np.ndarray:
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


@dataclasses.dataclass
class Row:
  """One line of the results table."""

  name: str
  system: str
  us: float
  gbps: float | None = None          # DeepEP's way: all received bytes (local too) / time
  nvlink_gbps: float | None = None   # bytes that crossed NVLink per direction / time
  baseline_us: float | None = None
  note: str = ""

  @property
  def speedup(self) -> float | None:
    return None if self.baseline_us is None else self.baseline_us / self.us


def print_table(rows: list[Row], title: str) -> None:
  print(f"\n{title}")
  print(f"{'op':<28}{'system':<30}{'us/call':>10}{'GB/s':>9}{'NVL GB/s':>10}{'x base':>9}")
  for r in rows:
    gb = f"{r.gbps:9.1f}" if r.gbps is not None else " " * 9
    nv = f"{r.nvlink_gbps:10.1f}" if r.nvlink_gbps is not None else " " * 10
    sp = f"{r.speedup:9.2f}" if r.speedup is not None else " " * 9
    print(f"{r.name:<28}{r.system:<30}{r.us:10.1f}{gb}{nv}{sp}")


def write_json(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=2, default=lambda o: dataclasses.asdict(o)
              if dataclasses.is_dataclass(o) else str(o))


def device_description() -> str:
  d = jax.devices()[0]
  return f"{jax.device_count()}x {d.device_kind}"
