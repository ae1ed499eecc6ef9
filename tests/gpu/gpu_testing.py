"""Helpers of the GPU tests: the EP mesh over all processes, global seeded
inputs, and comparisons with the host oracle (tests/host_reference.py).

Protocol of every test: each process builds the same GLOBAL inputs ([R, ...],
one seed for all ranks), runs the ops on its own slice ``[rank()]``, and
compares its outputs with rank r's part of the host oracle's results. No data
crosses between processes outside jax_ep's own ops, so a test's program holds
no XLA collective: with several processes on one GPU (``--devices 0,0,...``,
JAX_EP_GPUS_SHARED=1) NCCL refuses two ranks on one GPU and a collective
hangs. run() checks each program's lowering for collectives before it runs
(on CUDA always; on CPU processes with JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING=1,
lowered for the CUDA backend). Tests that need a collective are marked
``needs_xla_collective`` (skipped where the GPU is shared).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import launch
import host_reference as hr
from ep_configs import ep_config

# The suite's logic may run on CPU processes with the portable backend
# (JAX_EP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu); the kernels need GPUs.
ON_CPU = os.environ.get("JAX_EP_GPU_TESTS_ON_CPU") == "1"
BF16 = hr.BFLOAT16
F32 = np.float32

# EpGroup.timeout_s of the tests: with processes sharing a GPU the kernels of
# different processes take turns (time slices), so waits last longer.
TIMEOUT_S = 30.0
SHARED_GPU_TIMEOUT_S = 120.0


def skip_all(items, reason: str | None) -> None:
  """pytest_collection_modifyitems body shared by tests/gpu and tests/gpu_faults:
  marks every collected test skipped with `reason` (nothing when None)."""
  if reason:
    for item in items:
      item.add_marker(pytest.mark.skip(reason=reason))


def gpus_shared() -> bool:
  """Whether the launcher put several processes on one GPU (launch.ENV_GPUS_SHARED)."""
  return os.environ.get(launch.ENV_GPUS_SHARED) == "1"


def needs_xla_collective(why: str):
  """Marks a test whose program holds an XLA collective: skipped when the
  processes share a GPU, where NCCL cannot run (the processes would hang)."""
  return pytest.mark.skipif(
      gpus_shared(), reason=f"needs an XLA collective ({why}); NCCL refuses two ranks on one "
      "GPU, and the processes here share one (JAX_EP_GPUS_SHARED=1)")


def kernels_only(why: str):
  """Marks a test of the CUDA kernels' own behaviour (a handler's check, say),
  which the portable backend does not have: on CPU processes it is deselected
  (conftest.py), not skipped, so a run there still skips nothing."""
  return pytest.mark.kernels_only(why)


def missing_gpus() -> str | None:
  """Why the kernels cannot run in this (launched) process, or None.

  Each process holds one device, so jax.device_count() is the number of
  processes: N distinct GPUs, or one GPU shared by N processes.
  """
  from jax_ep import _extension  # pylint: disable=import-outside-toplevel
  try:
    platform = jax.devices()[0].platform
  except RuntimeError as e:
    return f"no JAX devices: {e}"
  if platform != "gpu":
    return f"no GPU (JAX platform {platform})"
  if jax.local_device_count() != 1 or jax.device_count() != jax.process_count():
    return (f"needs one GPU per process (the launcher's layout), found {jax.local_device_count()} "
            f"local and {jax.device_count()} global devices in {jax.process_count()} processes")
  if _extension.cuda_module() is None:
    return f"CUDA extension unavailable: {_extension.cuda_module_status()}"
  return None


# ====================================================================== mesh and runs
def num_ranks() -> int:
  """R: one EP rank per process."""
  return jax.process_count()


def rank() -> int:
  return jax.process_index()


def ep_mesh() -> jax.sharding.Mesh:
  """The EP axis over all processes, rank r = process r."""
  devices = sorted(jax.devices(), key=lambda d: d.process_index)
  return jax.make_mesh((len(devices),), ("ep",), devices=devices)


def setup(**config_kwargs) -> tuple[jax_ep.EpConfig, jax.sharding.Mesh]:
  """initialize() for a config on the EP axis over every process (ep_mesh)."""
  mesh = ep_mesh()
  return setup_mesh(mesh, **config_kwargs), mesh


def setup_mesh(mesh: jax.sharding.Mesh, **config_kwargs) -> jax_ep.EpConfig:
  """initialize() for a config on `mesh`; on CUDA with fallback="error" (unless
  given), so an op that would take the portable path (an XLA collective) fails
  at trace time instead of hanging where the processes share a GPU."""
  if not ON_CPU:
    config_kwargs.setdefault("fallback", "error")
  config_kwargs.setdefault("timeout_s", SHARED_GPU_TIMEOUT_S if gpus_shared() else TIMEOUT_S)
  config = ep_config(**config_kwargs)
  jax_ep.initialize(config, mesh)
  assert jax_ep.runtime_state().backend_name == ("xla" if ON_CPU else "cuda")
  return config


def global_array(mesh, local: np.ndarray):
  """The global array whose shard on this process is ``local`` (split on dim 0)."""
  sharding = NamedSharding(mesh, P("ep"))
  shape = (local.shape[0] * mesh.size,) + local.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local, shape)


def _local(x) -> np.ndarray:
  return np.asarray(x.addressable_shards[0].data)


# StableHLO collectives: none may appear in a test's program (module docstring).
_COLLECTIVES = ("all_gather", "all_reduce", "all_to_all", "reduce_scatter",
                "collective_permute", "collective_broadcast")
# On CPU processes the portable backend's own collectives hide a test's: with
# this set, each program is also lowered for the CUDA backend (without a GPU,
# jax_ep.runtime.lowering_only) and checked there.
CHECK_CUDA_LOWERING_ON_CPU = os.environ.get("JAX_EP_GPU_TESTS_CHECK_CUDA_LOWERING") == "1"


def xla_collectives(stablehlo: str) -> list[str]:
  """The XLA collectives named in a lowered program's StableHLO text."""
  return [op for op in _COLLECTIVES if f"stablehlo.{op}" in stablehlo]


def _assert_no_collective(per_shard, mesh, args, check_vma: bool) -> None:
  """Fails before running a program that holds an XLA collective (where the
  processes share a GPU it would hang). Skipped for configs with
  fallback="allow": those tests mean to use one (needs_xla_collective)."""
  state = jax_ep.runtime_state()
  if state is None or state.config.fallback == "allow" or (ON_CPU and
                                                           not CHECK_CUDA_LOWERING_ON_CPU):
    return

  def fresh(*shards):  # a new function: jit's trace cache must not keep this trace
    return per_shard(*shards)

  mapped = jax.jit(jax.shard_map(fresh, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                 check_vma=check_vma))
  if ON_CPU:
    from jax_ep import runtime  # pylint: disable=import-outside-toplevel
    with runtime.lowering_only(state.configs, state.mesh, backend="cuda"):
      text = mapped.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  else:
    text = mapped.trace(*args).lower().as_text()
  found = xla_collectives(text)
  assert not found, (f"the test's program holds XLA collectives {found} (on the CUDA backend); "
                     "they cannot run where processes share a GPU")


def _per_shard(fn):
  def per_shard(*shards):
    return jax.tree.map(lambda o: o[None], fn(*[s[0] for s in shards]))
  return per_shard


def _run(fn, mesh, locals_, check_vma: bool, compiler_options: dict | None = None):
  per_shard = _per_shard(fn)
  args = [global_array(mesh, np.asarray(a)[None]) for a in locals_]
  _assert_no_collective(per_shard, mesh, args, check_vma)
  mapped = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                 check_vma=check_vma))
  if compiler_options:
    mapped = mapped.lower(*args).compile(compiler_options)
  return jax.tree.map(lambda o: _local(o)[0], mapped(*args))


def compiled_text(fn, mesh, *local_args) -> str:
  """The compiled program (HLO text) that run_local(fn, mesh, *local_args) runs."""
  args = [global_array(mesh, np.asarray(a)[None]) for a in local_args]
  mapped = jax.jit(jax.shard_map(_per_shard(fn), mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
  return mapped.lower(*args).compile().as_text()


def run(fn, mesh, *global_args, check_vma: bool = True):
  """jit(shard_map(fn)) on this rank's slice of each global [R, ...] input;
  returns this rank's outputs as numpy."""
  return _run(fn, mesh, [np.asarray(a)[rank()] for a in global_args], check_vma)


def run_local(fn, mesh, *local_args, check_vma: bool = True,
              compiler_options: dict | None = None):
  """Like run, on inputs this rank built for itself alone ([...] per rank);
  compiler_options: XLA options of this program's compilation alone."""
  return _run(fn, mesh, local_args, check_vma, compiler_options)


def mine(host_result):
  """This rank's part of a global host-oracle result: an array's [r], or a
  host_reference result dataclass with each array field indexed [r]."""
  if dataclasses.is_dataclass(host_result):
    return dataclasses.replace(host_result, **{
        f.name: mine(getattr(host_result, f.name)) for f in dataclasses.fields(host_result)
        if isinstance(getattr(host_result, f.name), np.ndarray)})
  return np.asarray(host_result)[rank()]


# ====================================================================== global inputs
def rng(seed: int) -> np.random.Generator:
  """The generator of a test's global inputs: the same on every rank."""
  return np.random.default_rng(seed)


def global_routing(gen: np.random.Generator, lead: tuple[int, ...], num_tokens: int,
                   num_topk: int, num_experts: int, none_fraction: float = 0.1) -> np.ndarray:
  """int32[*lead, T, K]: distinct experts per token (a random top-k), entries
  -1 with probability ``none_fraction``."""
  keys = gen.random(lead + (num_tokens, num_experts), dtype=np.float32)
  idx = np.argsort(keys, axis=-1)[..., :num_topk].astype(np.int32)
  idx[gen.random(idx.shape) < none_fraction] = -1
  return idx


# Routings of the gradient tests: random top-k, or every token of every rank on
# one rank's experts (rank 0 or the last), where that rank's tokens all stay
# home and the others send everything to it (issue 30: a rank that needs no
# peer's rows must still not lap its peers).
GRAD_ROUTINGS = ("random", "all_to_rank_0", "all_to_last_rank")


def one_rank_routing(gen: np.random.Generator, lead: tuple[int, ...], num_tokens: int,
                     num_topk: int, num_experts: int, num_ranks_: int, owner: int,
                     none_fraction: float = 0.15) -> np.ndarray:
  """int32[*lead, T, K]: every token's experts among rank ``owner``'s
  (distinct, min(K, E_local) of them, the rest -1), entries -1 with
  probability ``none_fraction`` besides."""
  per_rank = num_experts // num_ranks_
  keys = gen.random(lead + (num_tokens, per_rank), dtype=np.float32)
  picked = np.argsort(keys, axis=-1)[..., :num_topk].astype(np.int32) + owner * per_rank
  idx = np.full(lead + (num_tokens, num_topk), -1, np.int32)
  idx[..., :picked.shape[-1]] = picked
  idx[gen.random(idx.shape) < none_fraction] = -1
  return idx


def grad_routing(name: str, gen: np.random.Generator, lead: tuple[int, ...], num_tokens: int,
                 num_topk: int, num_experts: int) -> np.ndarray:
  """The GRAD_ROUTINGS entry ``name`` as int32[*lead, T, K] (lead = (R,))."""
  if name == "random":
    return global_routing(gen, lead, num_tokens, num_topk, num_experts)
  owner = {"all_to_rank_0": 0, "all_to_last_rank": num_ranks() - 1}[name]
  return one_rank_routing(gen, lead, num_tokens, num_topk, num_experts, num_ranks(), owner)


def routing(gen: np.random.Generator, num_tokens: int, num_topk: int, num_experts: int,
            none_fraction: float = 0.1) -> np.ndarray:
  """int32[T, K] for one rank (tests/gpu_faults build per-rank inputs)."""
  return global_routing(gen, (), num_tokens, num_topk, num_experts, none_fraction)


@functools.lru_cache(maxsize=None)
def _normal_quantiles(dtype) -> np.ndarray:
  """dtype[65536]: the standard normal's quantiles at (i + 1/2) / 65536, rounded
  to dtype (from -4.33 to 4.33)."""
  inv_cdf = statistics.NormalDist().inv_cdf
  return np.array([inv_cdf((i + 0.5) / 65536) for i in range(65536)], np.float32).astype(dtype)


def rows(gen: np.random.Generator, shape, dtype=BF16) -> np.ndarray:
  """Standard-normal rows (bf16 by default), built on the host: a uniform 16-bit
  draw per element picks one of 65536 equally likely normal quantiles. A draw
  costs a table lookup, about 3x less than numpy's standard_normal plus the
  bf16 rounding (every rank builds every rank's inputs, hundreds of MB in the
  largest tests)."""
  draws = gen.integers(0, 65536, size=shape, dtype=np.uint16)
  return _normal_quantiles(np.dtype(dtype))[draws]


def weights(gen: np.random.Generator, shape) -> np.ndarray:
  """float32 in [0, 1): full-precision top-k weights."""
  return gen.random(shape, dtype=np.float32)


def dyadic_weights(gen: np.random.Generator, shape) -> np.ndarray:
  """float32 multiples of 2**-8 in [2**-8, 1): sums of up to 32 of them are exact
  in float32 in any order, and a product with a bf16 value is exact (8 + 8
  significant bits), so no rounding depends on an implementation's order."""
  return (gen.integers(1, 256, shape) / 256).astype(np.float32)


# Inputs whose bits must be the same on every machine (golden hashes): a
# counter-based generator (splitmix64) in plain uint64 arithmetic, independent
# of numpy's Generator streams, which numpy does not promise to keep.
def _splitmix64(seed: int, count: int) -> np.ndarray:
  z = (np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
       + np.uint64(seed & (2 ** 64 - 1)))
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def stable_bits(seed: int, shape) -> np.ndarray:
  """uint64[shape] of splitmix64 outputs for counters 1.. under ``seed``."""
  return _splitmix64(seed, int(np.prod(shape))).reshape(shape)


def stable_routing(seed: int, lead: tuple[int, ...], num_tokens: int, num_topk: int,
                   num_experts: int, none_fraction: float) -> np.ndarray:
  """int32[*lead, T, K] like routing(), from stable_bits (machine-independent)."""
  assert num_experts <= 256
  keys = stable_bits(seed, lead + (num_tokens, num_experts)) & ~np.uint64(0xFF)
  keys |= np.arange(num_experts, dtype=np.uint64)          # distinct keys: no ties
  idx = np.argsort(keys, axis=-1, kind="stable")[..., :num_topk].astype(np.int32)
  none = stable_bits(seed + 1, idx.shape) >> np.uint64(40) < np.uint64(
      int(none_fraction * 2 ** 24))
  idx[none] = -1
  return idx


def stable_rows(seed: int, shape) -> np.ndarray:
  """bf16 uniform in [-2, 2) from stable_bits (24 random bits, exact in float32)."""
  top = (stable_bits(seed, shape) >> np.uint64(40)).astype(np.float32)
  return (top * np.float32(2.0 ** -22) - np.float32(2.0)).astype(BF16)


def stable_dyadic_weights(seed: int, shape) -> np.ndarray:
  """dyadic_weights() from stable_bits."""
  return (((stable_bits(seed, shape) >> np.uint64(56)) % np.uint64(255) + np.uint64(1))
          .astype(np.float32) / np.float32(256))


# ====================================================================== comparisons
def bits(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype.kind in "iub":
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_bitwise(actual, expected, name: str = "") -> None:
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
      name, actual.dtype, actual.shape, expected.dtype, expected.shape)
  np.testing.assert_array_equal(bits(actual), bits(expected), err_msg=name)


def assert_within_ulp(actual, expected, ulps: int = 1, name: str = "") -> None:
  """Every element of ``actual`` is within ``ulps`` units in the last place of
  ``expected`` (same float dtype: compared on the bit patterns, +0 == -0)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
      name, actual.dtype, actual.shape, expected.dtype, expected.shape)
  distance = hr.ulp_distance(actual, expected)
  worst = np.unravel_index(np.argmax(distance), distance.shape) if distance.size else ()
  assert distance.size == 0 or distance.max() <= ulps, (
      f"{name}: {int(np.sum(distance > ulps))} of {distance.size} elements more than {ulps} "
      f"ulp(s) away; worst at {worst}: {actual[worst]} vs {expected[worst]} "
      f"({int(distance[worst])} ulps)")


def bf16_accumulated(terms, out_dtype) -> np.ndarray:
  """The bf16-accumulation mutant of a combine: the float32 ``terms`` (an
  iterable of (valid mask, value)) summed with a bfloat16 accumulator (every
  partial sum rounded to bf16), cast to out_dtype. A test shows that its
  comparison rejects this on its own data (issue 14: tests that can fail)."""
  acc = None
  for valid, value in terms:
    if acc is None:
      acc = np.zeros(value.shape, BF16)
    acc = np.where(valid, (acc.astype(F32) + value).astype(BF16), acc)
  return acc.astype(out_dtype)


# ====================================================================== hashes
# Order-sensitive uint32 hashes, identical in jnp (on the device, over a loop
# of calls) and numpy (from host-oracle results): acc * 1000003 + sum_i
# bits_i * (i * 2654435761 + 1), all modulo 2**32, over the value's bits in
# row-major order (bool as uint8, floats by their bit patterns).
_HASH_MULT = 1000003
_HASH_POS = 2654435761


def hash_fold(acc, a):
  """jnp: ``acc`` (uint32 scalar) with array ``a`` folded in."""
  if a.dtype == jnp.bool_:
    a = a.astype(jnp.uint8)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
  word = jax.lax.bitcast_convert_type(a, width).astype(jnp.uint32).reshape(-1)
  position = jnp.arange(word.shape[0], dtype=jnp.uint32) * jnp.uint32(_HASH_POS) + 1
  return acc * jnp.uint32(_HASH_MULT) + jnp.sum(word * position, dtype=jnp.uint32)


@functools.cache
def _hash_positions(size: int) -> np.ndarray:
  """uint32[size]: i * 2654435761 + 1 (the host hashes fold many arrays of few sizes)."""
  position = np.arange(size, dtype=np.uint32) * np.uint32(_HASH_POS) + np.uint32(1)
  position.flags.writeable = False
  return position


def _hash_words(a) -> np.ndarray:
  a = np.asarray(a)
  if a.dtype == np.bool_:
    a = a.astype(np.uint8)
  return bits(a).astype(np.uint32)


def hash_fold_host(acc: int, a: np.ndarray) -> int:
  """numpy twin of hash_fold (same value for the same bits)."""
  word = _hash_words(a).reshape(-1)
  total = int(np.sum(word * _hash_positions(word.shape[0]), dtype=np.uint32))
  return (acc * _HASH_MULT + total) % (1 << 32)


def hash_fold_host_each(accs: list[int], a: np.ndarray) -> list[int]:
  """[hash_fold_host(accs[r], a[r]) for every r], in one pass over the stacked
  ``a`` ([R, ...]): the sums are modulo 2**32 either way."""
  word = _hash_words(a).reshape(len(accs), -1)
  totals = np.sum(word * _hash_positions(word.shape[1]), axis=1, dtype=np.uint32)
  return [(acc * _HASH_MULT + int(total)) % (1 << 32) for acc, total in zip(accs, totals)]

