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
from ep_configs import ep_config


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


def global_fn(per_shard: Callable, mesh: jax.sharding.Mesh, axis: str = "ep") -> Callable:
  """jit(shard_map) of a per-shard function over arrays split on dim 0."""
  return jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def weight_and_row_grads(mesh: jax.sharding.Mesh, x: jax.Array, idx: jax.Array, w: jax.Array,
                         **dispatch_kwargs):
  """{"ours": (g_w, g_x), "ref": (g_w, g_x)}: for jax_ep.dispatch and for
  jax_ep.reference.dispatch with ``dispatch_kwargs``, the gradient of
  sum(topk_weights ** 2) in w alone and of sum(x ** 2) in x alone, so each
  output's cotangent path runs on its own (symbolic zeros elsewhere)."""

  def parts(impl):
    def per_shard(x, i, w):
      if impl == "ours":
        d = jax_ep.dispatch(x, i, w, **dispatch_kwargs)
        return jnp.sum(d.topk_weights ** 2)[None], jnp.sum(d.x ** 2)[None]
      ref = jax_ep.reference.dispatch(x, i, w, **dispatch_kwargs)
      return jnp.sum(ref["topk_weights"] ** 2)[None], jnp.sum(ref["x"] ** 2)[None]

    f = global_fn(per_shard, mesh)
    return (jax.grad(lambda w: jnp.sum(f(x, idx, w)[0]))(w),
            jax.grad(lambda x: jnp.sum(f(x, idx, w)[1]))(x))

  with jax.set_mesh(mesh):
    return {impl: parts(impl) for impl in ("ours", "ref")}


def check_grads_of_layer(f: Callable, mesh: jax.sharding.Mesh, x: jax.Array, idx: jax.Array,
                         w: jax.Array, **tolerances) -> None:
  """jax.test_util.check_grads (reverse mode, first order) of the global
  f(x, idx, w) in x and w, with x and w resharded over "ep" at each call."""
  with jax.set_mesh(mesh):
    sharded = lambda x, w: f(jax.reshard(x, P("ep")), idx, jax.reshard(w, P("ep")))  # noqa: E731
    jax.test_util.check_grads(sharded, (x, w), order=1, modes=("rev",), **tolerances)


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


def ranks_routing(rng: np.random.Generator, num_ranks: int, t_local: int, num_topk: int,
                  num_experts: int, **kwargs) -> np.ndarray:
  """int32[num_ranks * t_local, K]: random_routing per rank, stacked along dim 0."""
  return np.concatenate([random_routing(rng, t_local, num_topk, num_experts, **kwargs)
                         for _ in range(num_ranks)])


def exact_grad_problem(rng: np.random.Generator, num_rows: int, hidden: int, num_topk: int,
                       routing: Callable[[], np.ndarray]):
  """(x, idx, w, cot) whose sums are exact in float32 in both passes: x small
  integers / 4 [num_rows, hidden], idx = routing(), weights k / 8 [num_rows, K],
  integer cotangents [num_rows, hidden] (drawn in that order)."""
  x = rng.integers(-8, 9, (num_rows, hidden)).astype(np.float32) / 4
  idx = routing()
  w = rng.integers(1, 9, (num_rows, num_topk)).astype(np.float32) / 8
  cot = rng.integers(-4, 5, (num_rows, hidden)).astype(np.float32)
  return x, idx, w, cot


def random_rows(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def bits(a: np.ndarray) -> np.ndarray:
  """View floats as unsigned ints of the same width for bit-exact comparison."""
  a = np.asarray(a)
  if a.dtype.kind in "iub":
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def setup(num_ranks: int, **config_kwargs) -> tuple[jax_ep.EpConfig, jax.sharding.Mesh]:
  config = ep_config(**config_kwargs)
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
