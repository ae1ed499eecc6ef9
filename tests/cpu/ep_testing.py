"""Helpers shared by the CPU tests: meshes, random routing, per-shard calls."""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep


def make_mesh(num_ranks: int, axis: str = "ep") -> jax.sharding.Mesh:
  return jax.make_mesh((num_ranks,), (axis,), devices=jax.devices()[:num_ranks])


def run_per_shard(fn: Callable, mesh: jax.sharding.Mesh, *args, axis: str = "ep",
                  check_vma: bool = True):
  """Runs ``fn`` inside jit(shard_map) on arrays split along dim 0 over ``axis``.

  Returns fn's outputs as numpy arrays with a leading rank dimension:
  ``out[r]`` is rank r's value.
  """

  def per_shard(*shards):
    return jax.tree.map(lambda o: o[None], fn(*shards))

  mapped = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P(axis), out_specs=P(axis),
                                 check_vma=check_vma))
  placed = [jax.device_put(a, NamedSharding(mesh, P(axis))) for a in args]
  return jax.tree.map(np.asarray, mapped(*placed))


def place(mesh: jax.sharding.Mesh, *arrays, axis: str = "ep") -> list[jax.Array]:
  """Each array split along dim 0 over ``axis`` (global inputs of a shard_map)."""
  return [jax.device_put(a, NamedSharding(mesh, P(axis))) for a in arrays]


def random_routing(rng: np.random.Generator, num_tokens: int, num_topk: int, num_experts: int,
                   *, none_fraction: float = 0.2, skew: float = 0.0,
                   allowed: np.ndarray | None = None) -> np.ndarray:
  """int32[num_tokens, K] distinct experts per token, some entries -1.

  ``skew`` > 0 favours low expert ids (uneven counts per rank); ``allowed``
  restricts the experts drawn from (slots beyond it stay -1).
  """
  experts = np.arange(num_experts) if allowed is None else np.asarray(allowed)
  prob = np.exp(-skew * np.arange(len(experts)) / max(len(experts), 1))
  prob /= prob.sum()
  idx = np.full((num_tokens, num_topk), -1, np.int32)
  take = min(num_topk, len(experts))
  for t in range(num_tokens):
    idx[t, :take] = rng.choice(experts, size=take, replace=False, p=prob)
    rng.shuffle(idx[t])
  idx[rng.random(idx.shape) < none_fraction] = -1
  return idx


def random_rows(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def bits(a: np.ndarray) -> np.ndarray:
  """View floats as unsigned ints of the same width for bit-exact comparison."""
  a = np.asarray(a)
  if a.dtype.kind in "iub":
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def setup(num_ranks: int, **config_kwargs) -> tuple[jax_ep.EpConfig, jax.sharding.Mesh]:
  config = jax_ep.EpConfig(**config_kwargs)
  mesh = make_mesh(num_ranks)
  jax_ep.initialize(config, mesh)
  return config, mesh


def valid_rows_mask(count: np.ndarray, rows: int) -> np.ndarray:
  """bool[..., E_local, rows]: row < count."""
  return np.arange(rows) < np.asarray(count)[..., None]


partial = functools.partial


@contextlib.contextmanager
def local_steps(kind: str):
  """'ffi': the CPU handlers (the default on CPU); 'jnp': their jax.numpy twins."""
  if kind == "ffi":
    yield
    return
  original = jax.lax.platform_dependent

  def force_default(*a, default=None, **per_platform):
    del per_platform
    return default(*a)

  jax.lax.platform_dependent = force_default
  try:
    yield
  finally:
    jax.lax.platform_dependent = original
