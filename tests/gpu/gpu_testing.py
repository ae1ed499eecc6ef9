"""Helpers of the GPU tests: the EP mesh over all processes, per-rank data."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep


def skip_all(items, reason: str | None) -> None:
  """pytest_collection_modifyitems body shared by tests/gpu and tests/gpu_faults:
  marks every collected test skipped with `reason` (nothing when None)."""
  if reason:
    for item in items:
      item.add_marker(pytest.mark.skip(reason=reason))


def missing_gpus() -> str | None:
  """Why the kernels cannot run in this (launched) process, or None."""
  from jax_ep import _extension  # pylint: disable=import-outside-toplevel
  try:
    platform = jax.devices()[0].platform
  except RuntimeError as e:
    return f"no JAX devices: {e}"
  if platform != "gpu":
    return f"no GPU (JAX platform {platform})"
  if jax.device_count() < 2:
    return f"needs at least 2 GPUs, found {jax.device_count()}"
  if _extension.cuda_module() is None:
    return f"CUDA extension unavailable: {_extension.cuda_module_status()}"
  return None


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


def call_routing(seed: int, call, num_tokens: int, num_topk: int, num_experts: int,
                 none_fraction: float) -> jax.Array:
  """int32[num_tokens, K] distinct experts per token, -1 with probability
  ``none_fraction``, different for every call index and rank (traced, inside a loop)."""
  key = jax.random.fold_in(jax.random.key(seed), call * 1000 + jax.lax.axis_index("ep"))
  idx = jax.lax.top_k(jax.random.uniform(key, (num_tokens, num_experts)), num_topk)[1]
  return jnp.where(jax.random.uniform(key, (num_tokens, num_topk)) < none_fraction, -1,
                   idx.astype(jnp.int32))


def rows(rng: np.random.Generator, shape, dtype=jnp.bfloat16) -> np.ndarray:
  return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype.kind in "iub":
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


partial = functools.partial
