"""Helpers of the GPU tests: the EP mesh over all processes, per-rank data."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep


def ep_mesh() -> jax.sharding.Mesh:
  return jax.make_mesh((jax.device_count(),), ("ep",))


def setup(**config_kwargs) -> tuple[jax_ep.EpConfig, jax.sharding.Mesh]:
  config = jax_ep.EpConfig(**config_kwargs)
  mesh = ep_mesh()
  jax_ep.initialize(config, mesh)
  expected = "xla" if os.environ.get("JAX_EP_GPU_TESTS_ON_CPU") == "1" else "cuda"
  assert jax_ep.runtime_state().backend_name == expected
  return config, mesh


def rank() -> int:
  return jax.process_index()


def global_array(mesh, local: np.ndarray):
  """The global array whose shard on this process is ``local`` (split on dim 0)."""
  sharding = NamedSharding(mesh, P("ep"))
  shape = (local.shape[0] * jax.device_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local, shape)


def local(x) -> np.ndarray:
  """This process's shard of a global array, as numpy."""
  return np.asarray(x.addressable_shards[0].data)


def run(fn, mesh, *local_args, check_vma: bool = True):
  """jit(shard_map(fn)) on per-rank numpy inputs; returns this rank's outputs (numpy)."""

  def per_shard(*shards):
    return jax.tree.map(lambda o: o[None], fn(*shards))

  mapped = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                 check_vma=check_vma))
  out = mapped(*[global_array(mesh, a) for a in local_args])
  return jax.tree.map(lambda o: local(o)[0], out)


def routing(rng: np.random.Generator, num_tokens: int, num_topk: int, num_experts: int,
            none_fraction: float = 0.1) -> np.ndarray:
  idx = np.stack([rng.choice(num_experts, num_topk, replace=False) for _ in range(num_tokens)])
  idx = idx.astype(np.int32)
  idx[rng.random(idx.shape) < none_fraction] = -1
  return idx


def rows(rng: np.random.Generator, shape, dtype=jnp.bfloat16) -> np.ndarray:
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype.kind in "iub":
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


partial = functools.partial
