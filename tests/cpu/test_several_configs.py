"""Several EpConfigs in one process: jax_ep.initialize((a, b), mesh), ops traced
with either config (in one jit and in several) against the oracles; the
mismatch errors, which name only the differing fields; the configs that cannot
be served together; the CUDA buffers' sizing for several configs and the FFI
handlers' check of a call against it (the compiled module, no GPU needed)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep import _extension
from jax_ep.backends.cuda import config_attr
from jax_ep.buffers import sizing_config
import host_reference
from ep_testing import ranks_routing, bits, make_mesh, random_rows, run_per_shard

R = 4
# A train-like and a decode-like shape: every size differs.
TRAIN = jax_ep.EpConfig(num_experts=16, hidden=32, max_tokens_per_rank=8, num_topk=4)
DECODE = jax_ep.EpConfig(num_experts=8, hidden=64, max_tokens_per_rank=4, num_topk=2,
                         low_latency_max_tokens_per_rank=3)
T_LOCAL = {TRAIN: 8, DECODE: 3}


def _inputs(config: jax_ep.EpConfig, seed: int):
  """x bf16 [R*T_local, H], idx int32 [R*T_local, K], w f32 [R*T_local, K]."""
  rng = np.random.default_rng(seed)
  t, k = T_LOCAL[config], config.num_topk
  x = random_rows(rng, (R * t, config.hidden), jnp.bfloat16)
  idx = ranks_routing(rng, R, t, k, config.num_experts, skew=1.0)
  w = rng.random((R * t, k), np.float32)
  return x, idx, w


def _expert(rows):
  """A per-row function that differs per rank, so that every copy differs."""
  rank = jax.lax.axis_index("ep").astype(jnp.float32)
  return (rows.astype(jnp.float32) * (1.5 + rank)).astype(rows.dtype)


def _ops(config: jax_ep.EpConfig):
  """Per shard: the HT and LL round trips with ``config``, and the jnp oracle's HT ones."""
  def fn(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, config=config)
    out = jax_ep.combine(_expert(d.x), d.handle, config=config)
    ref = jax_ep.reference.dispatch(x, idx, w, config=config)
    ref_out = jax_ep.reference.combine(_expert(ref["x"]), idx, config=config)
    ll = jax_ep.low_latency_dispatch(x, idx, config=config)
    y = _expert(ll.x)
    ll_out = jax_ep.low_latency_combine(y, idx, w, ll.handle, config=config)
    return dict(x=d.x, num_tokens=d.num_tokens, topk_idx=d.topk_idx, out=out, ref_x=ref["x"],
                ref_num_tokens=ref["num_tokens"], ref_topk_idx=ref["topk_idx"], ref_out=ref_out,
                ll_x=ll.x, ll_y=y, ll_count=ll.count, ll_out=ll_out)
  return fn


def _check(config: jax_ep.EpConfig, got: dict, x, idx, w) -> None:
  """Bit for bit against the oracles: the HT ops against jax_ep.reference, the
  LL ones against tests/host_reference.py (as tests/cpu/test_ht.py, test_ll.py)."""
  t = T_LOCAL[config]
  assert got["out"].shape == (R, t, config.hidden)
  assert got["x"].shape == (R, R * config.max_tokens_per_rank, config.hidden)
  np.testing.assert_array_equal(got["num_tokens"], got["ref_num_tokens"])
  np.testing.assert_array_equal(got["topk_idx"], got["ref_topk_idx"])
  np.testing.assert_array_equal(bits(got["x"]), bits(got["ref_x"]))
  np.testing.assert_array_equal(bits(got["out"]), bits(got["ref_out"]))
  per_rank = lambda a: a.reshape((R, -1) + a.shape[1:])  # noqa: E731
  layout = host_reference.ll_dispatch(per_rank(x), per_rank(idx), config)
  np.testing.assert_array_equal(got["ll_count"], layout.count)
  valid = np.arange(R * config.ll_max_tokens) < layout.count[..., None]
  np.testing.assert_array_equal(bits(got["ll_x"])[valid], bits(layout.x)[valid])
  want = host_reference.ll_combine(got["ll_y"], per_rank(idx), per_rank(w), layout)
  np.testing.assert_array_equal(bits(got["ll_out"]), bits(want))


def test_two_configs_in_one_jit_match_the_oracle():
  mesh = make_mesh(R)
  jax_ep.initialize((TRAIN, DECODE), mesh)
  assert jax_ep.runtime_state().configs == (TRAIN, DECODE)
  a, b = _inputs(TRAIN, 1), _inputs(DECODE, 2)

  def both(xa, ia, wa, xb, ib, wb):
    return _ops(TRAIN)(xa, ia, wa), _ops(DECODE)(xb, ib, wb)

  got_a, got_b = run_per_shard(both, mesh, *a, *b)
  _check(TRAIN, got_a, *a)
  _check(DECODE, got_b, *b)


def test_two_configs_in_two_jits_match_the_oracle():
  mesh = make_mesh(R)
  jax_ep.initialize([TRAIN, DECODE], mesh)
  a, b = _inputs(TRAIN, 3), _inputs(DECODE, 4)
  _check(TRAIN, run_per_shard(_ops(TRAIN), mesh, *a), *a)
  _check(DECODE, run_per_shard(_ops(DECODE), mesh, *b), *b)
  _check(TRAIN, run_per_shard(_ops(TRAIN), mesh, *a), *a)  # again, after the other


def test_initialize_with_the_same_configs_twice_keeps_them():
  mesh = make_mesh(R)
  jax_ep.initialize((TRAIN, DECODE, TRAIN), mesh)  # duplicates count once
  first = jax_ep.runtime_state()
  assert first.configs == (TRAIN, DECODE) and first.config == TRAIN
  jax_ep.initialize((TRAIN, DECODE), mesh)
  assert jax_ep.runtime_state() is first


def test_a_call_with_a_config_not_given_names_only_the_differing_fields():
  mesh = make_mesh(R)
  jax_ep.initialize(TRAIN, mesh)
  other = dataclasses.replace(TRAIN, hidden=64, num_topk=2)
  x, idx, w = _inputs(DECODE, 5)  # [., 64] rows, K = 2
  with pytest.raises(jax_ep.EpConfigError) as error:
    run_per_shard(lambda x, i, w: jax_ep.dispatch(x, i, w, config=other).x, mesh, x, idx, w)
  message = str(error.value)
  assert "initialized with a config that differs from this call's in hidden: 32 " \
         "(initialized) vs 64 (this call); num_topk: 4 (initialized) vs 2 (this call)." in message
  for absent in ("EpConfig(", "num_experts", "max_tokens_per_rank", "axis_name"):
    assert absent not in message, (absent, message)
  assert "jax_ep.initialize((config_a, config_b), mesh)" in message


def test_with_several_configs_the_mismatch_names_the_closest():
  mesh = make_mesh(R)
  jax_ep.initialize((TRAIN, DECODE), mesh)
  other = dataclasses.replace(DECODE, max_tokens_per_rank=5)
  x, idx, w = _inputs(DECODE, 6)
  with pytest.raises(jax_ep.EpConfigError) as error:
    run_per_shard(lambda x, i: jax_ep.low_latency_dispatch(x, i, config=other).count, mesh, x,
                  idx)
  message = str(error.value)
  assert ("initialized with 2 configs, none equal to this call's; the closest, configs[1], "
          "that differs from this call's in max_tokens_per_rank: 4 (initialized) vs 5 "
          "(this call)") in message, message
  assert "EpConfig(" not in message and "hidden" not in message


def test_a_later_initialize_replaces_the_configs():
  """Each initialize() declares the whole set: a config left out is refused at
  trace time, also for a function traced while it was held (its cached trace
  is dropped, so it is traced again)."""
  mesh = make_mesh(R)
  jax_ep.initialize((TRAIN, DECODE), mesh)
  x, idx, w = _inputs(TRAIN, 7)
  fn = lambda x, i, w: jax_ep.dispatch(x, i, w, config=TRAIN).num_tokens  # noqa: E731
  run_per_shard(fn, mesh, x, idx, w)
  jax_ep.initialize(DECODE, mesh)
  with pytest.raises(jax_ep.EpConfigError, match=r"in num_experts: 8 \(initialized\) vs 16"):
    run_per_shard(fn, mesh, x, idx, w)


def test_a_handle_of_another_config_names_only_the_differing_fields():
  mesh = make_mesh(R)
  jax_ep.initialize((TRAIN, DECODE), mesh)
  x, idx, w = _inputs(TRAIN, 8)

  def fn(x, i, w):
    d = jax_ep.dispatch(x, i, w, config=TRAIN)
    return jax_ep.combine(d.x, d.handle, config=DECODE)

  with pytest.raises(jax_ep.EpConfigError) as error:
    run_per_shard(fn, mesh, x, idx, w)
  message = str(error.value)
  assert ("the handle comes from a dispatch with another config: num_experts: 16 (the "
          "dispatch) vs 8 (this call); hidden: 32 (the dispatch) vs 64 (this call)") in message
  assert "EpConfig(" not in message and "axis_name" not in message


def test_a_config_the_group_cannot_split_is_refused_at_initialize():
  odd = dataclasses.replace(DECODE, num_experts=6)
  with pytest.raises(jax_ep.EpConfigError, match=r"num_experts \(6\) must be divisible"):
    jax_ep.initialize((TRAIN, odd), make_mesh(R))
  with pytest.raises(jax_ep.EpConfigError, match="at least one EpConfig"):
    jax_ep.initialize((), make_mesh(R))
  with pytest.raises(jax_ep.EpConfigError, match="needs EpConfigs, got a dict"):
    jax_ep.initialize((TRAIN, {}), make_mesh(R))


# ------------------------------------------------------------------ CUDA buffers
HT_ONLY = jax_ep.EpConfig(num_experts=16, hidden=256, max_tokens_per_rank=64, num_topk=4,
                          enable_low_latency=False, group=jax_ep.EpGroup(num_sms=8))
LL_ONLY = jax_ep.EpConfig(num_experts=32, hidden=128, max_tokens_per_rank=512, num_topk=8,
                          low_latency_max_tokens_per_rank=16, enable_high_throughput=False,
                          group=jax_ep.EpGroup(num_sms=8), fallback="error", debug_checks=True)


def test_the_buffers_are_sized_for_the_largest_of_each_size():
  """E, H, K: the largest of any config; T from the HT configs only, T_ll from
  the LL ones; a family when any config has it; per-call options reset."""
  sizing = sizing_config((HT_ONLY, LL_ONLY))
  assert (sizing.num_experts, sizing.hidden, sizing.num_topk) == (32, 256, 8)
  assert sizing.max_tokens_per_rank == 64  # LL_ONLY's 512 needs no HT buffers
  assert sizing.ll_max_tokens == 16
  assert sizing.enable_low_latency and sizing.enable_high_throughput
  assert sizing.num_sms == 8 and sizing.fallback == "warn" and not sizing.debug_checks
  assert sizing_config(HT_ONLY) == dataclasses.replace(
      HT_ONLY, low_latency_max_tokens_per_rank=HT_ONLY.ll_max_tokens)
  together = jax_ep.buffer_bytes((HT_ONLY, LL_ONLY), R)
  assert together == jax_ep.buffer_bytes(sizing, R)
  assert together >= jax_ep.buffer_bytes(HT_ONLY, R) + jax_ep.buffer_bytes(LL_ONLY, R)
  module = _extension.cuda_module()
  if module is None:
    pytest.skip(f"CUDA extension not built: {_extension.cuda_module_status()}")
  for rdma in (False, True):
    layout = module.buffer_layout(R, sizing.num_experts, sizing.hidden,
                                  sizing.max_tokens_per_rank, sizing.ll_max_tokens,
                                  sizing.num_topk, True, True, rdma)
    assert layout["total"] == jax_ep.buffer_bytes((HT_ONLY, LL_ONLY), R, rdma_staging=rdma)


def _allocated(config: jax_ep.EpConfig) -> tuple[int, ...]:
  return (R, config.num_experts, config.hidden, config.max_tokens_per_rank, config.ll_max_tokens,
          config.num_topk)


def _traced(config: jax_ep.EpConfig, num_ranks: int = R) -> dict[str, int]:
  return {name: int(value) for name, value in config_attr(config, num_ranks).items()}


def _cuda_module():
  module = _extension.cuda_module()
  if module is None:
    pytest.skip(f"CUDA extension not built: {_extension.cuda_module_status()}")
  return module


@pytest.mark.parametrize("config", [HT_ONLY, LL_ONLY], ids=["ht", "ll"])
def test_the_handlers_run_each_call_with_its_own_dims(config):
  """xla_ffi/cuda/handler_common.cc CallDims, through the compiled module: a
  call of either config on the buffers of both runs with its own dims."""
  module = _cuda_module()
  allocated = _allocated(sizing_config((HT_ONLY, LL_ONLY)))
  ht, ll = config.enable_high_throughput, config.enable_low_latency
  dims = module.call_dims(*allocated, _traced(config), ll, ht)
  assert dims == dict(num_ranks=R, rank=0, num_experts=config.num_experts,
                      experts_per_rank=config.num_experts // R, hidden=config.hidden,
                      max_tokens=config.max_tokens_per_rank, ll_max_tokens=config.ll_max_tokens,
                      num_topk=config.num_topk)


def test_the_handlers_refuse_a_call_the_buffers_cannot_serve():
  module = _cuda_module()
  allocated = _allocated(sizing_config((HT_ONLY, LL_ONLY)))
  wide = dataclasses.replace(HT_ONLY, hidden=512)
  with pytest.raises(ValueError) as error:
    module.call_dims(*allocated, _traced(wide), False, True)
  message = str(error.value)
  assert "compiled for R=4 E=16 H=512 T=64" in message
  assert "allocated for at most R=4 E=32 H=256 T=64 T_ll=16 K=8" in message
  assert message.count(" > ") == 1 and ": H 512 > 256." in message
  assert "Pass this config to jax_ep.initialize with the others" in message
  # LL_ONLY's T (512) exceeds the HT buffers' 64: only an HT op would need it.
  module.call_dims(*allocated, _traced(LL_ONLY), True, False)
  with pytest.raises(ValueError, match=r": T 512 > 64\."):
    module.call_dims(*allocated, _traced(LL_ONLY), False, True)
  with pytest.raises(ValueError, match=r": T_ll 32 > 16\."):
    module.call_dims(*allocated, _traced(dataclasses.replace(
        LL_ONLY, low_latency_max_tokens_per_rank=32)), True, False)
  with pytest.raises(ValueError, match="compiled for an EP group of 8 ranks, but the runtime's "
                                       "group has 4"):
    module.call_dims(*allocated, _traced(HT_ONLY, num_ranks=8), False, True)


# ------------------------------------------------------------------ the CUDA runtime's decisions
class _FakeCudaModule:
  """The compiled module's runtime entry points, recording the allocations (one PE)."""

  def __init__(self):
    self.up = False
    self.allocations = []  # the allocate() arguments, in order
    self.buffers = False

  def initialized(self): return self.up  # noqa: E704
  def nvshmem_already_initialized(self): return False  # noqa: E704
  def get_unique_id(self): return b"\0" * 128  # noqa: E704
  def init(self, pe, npes, uid, device): self.up = True  # noqa: E704
  def my_pe(self): return 0  # noqa: E704
  def joined(self): return False  # noqa: E704
  def set_rdma_only_peers(self, pes): pass  # noqa: E704
  def probe_peers(self): return [True]  # noqa: E704
  def set_mask_on_timeout(self, on): pass  # noqa: E704
  def allocated(self): return self.buffers  # noqa: E704
  def masked(self): return []  # noqa: E704
  def set_masked(self, ranks): pass  # noqa: E704
  def status(self): return dict(code=0, op=0, peer=0, detail=0, fault_count=0)  # noqa: E704
  def release_buffers(self): self.buffers = False  # noqa: E704

  def allocate(self, *args):
    self.allocations.append(args)
    self.buffers = True

  def finalize(self):
    self.up = self.buffers = False
    return ""


def test_the_cuda_runtime_allocates_once_for_the_largest_sizes(monkeypatch):
  """jax_ep.initialize on the CUDA path (jax_ep/cuda_runtime.py) with the
  compiled module replaced: one allocation for the element-wise maximum of the
  configs; a later set with the same sizing keeps the buffers (and JAX's caches,
  unless it drops a config); a larger one re-allocates after clearing them."""
  from jax_ep import cuda_runtime, groups  # pylint: disable=import-outside-toplevel
  module = _FakeCudaModule()
  monkeypatch.setattr(_extension, "cuda_module", lambda: module)
  # One EP rank per process and one PE: the mesh's one device is this process's.
  monkeypatch.setattr(cuda_runtime, "_process_group", lambda config, mesh: groups.group_of(
      mesh, config.axis_names, mesh.devices.flat[0].id))
  monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1")  # kept as is, restored after the test
  cleared = []
  monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
  mesh = make_mesh(1)
  small = jax_ep.EpConfig(num_experts=8, hidden=64, max_tokens_per_rank=16, num_topk=2)
  wide = dataclasses.replace(small, hidden=256, num_topk=4, fallback="allow")
  jax_ep.initialize((small, wide), mesh, backend="cuda")
  state = jax_ep.runtime_state()
  assert state.backend_name == "cuda" and state.configs == (small, wide)
  assert state.cuda.config == sizing_config((small, wide))
  # (group_pes, rank, E, H, T, T_ll, K, LL, HT, RDMA staging, timeout_s, num_sms)
  assert module.allocations == [([0], 0, 8, 256, 16, 16, 4, True, True, False, 30.0, 0)]
  jax_ep.initialize((small, wide, dataclasses.replace(small, debug_checks=True)), mesh,
                    backend="cuda")  # same sizing, a superset: nothing moves
  assert len(module.allocations) == 1 and not cleared
  jax_ep.initialize(wide, mesh, backend="cuda")  # same sizing, drops configs
  assert len(module.allocations) == 1 and len(cleared) == 1
  long = dataclasses.replace(small, max_tokens_per_rank=64)
  jax_ep.initialize((wide, long), mesh, backend="cuda")  # larger: re-allocated
  assert module.allocations[-1] == ([0], 0, 8, 256, 64, 64, 4, True, True, False, 30.0, 0)
  assert len(module.allocations) == 2 and len(cleared) == 2  # cleared before the move
  jax_ep.mask_rank(0)
  jax_ep.initialize((wide, long), mesh, backend="cuda")  # after a mask: fresh buffers
  assert len(module.allocations) == 3 and jax_ep.masked_ranks() == ()
