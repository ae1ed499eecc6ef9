"""jax_ep.moe.grouped_matmul on the CPU (jax.lax.ragged_dot underneath): its three
products against the float64 oracle with derived bounds (tests/gpu/gmm_oracle.py),
in float32 and bfloat16, over empty groups, one full group, sizes off any tile,
no rows in any group; how "auto" chooses; and its trace-time errors."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu"))

import gmm_oracle  # noqa: E402
from jax_ep.errors import EpConfigError  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax_ep.moe import GroupedMatmulConfig, gmm_impls, grouped_matmul, grouped_matmul_plan  # noqa: E402


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,sizes,rows", gmm_oracle.CASES, ids=[c[0] for c in gmm_oracle.CASES])
def test_products_within_their_bounds(name, sizes, rows, dtype):
  del name
  x, w, d_out = gmm_oracle.operands(rows, len(sizes), 64, 48, dtype)
  gmm_oracle.check_grouped_matmul(jax.jit(grouped_matmul), x, w, sizes, d_out)


def test_products_equal_lax_ragged_dot_and_its_autodiff_in_float32():
  x, w, d_out = gmm_oracle.operands(300, 6, 64, 48, jnp.float32)
  sizes = jnp.asarray(gmm_oracle.CASES[0][1], jnp.int32)
  ours = jax.vjp(lambda a, b: grouped_matmul(a, b, sizes), x, w)
  lax = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x, w)
  np.testing.assert_array_equal(ours[0], lax[0])
  for got, want in zip(ours[1](d_out), lax[1](d_out)):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_auto_takes_lax_ragged_dot_on_cpu_and_explicit_choices_are_checked():
  x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16)
  plan = grouped_matmul_plan(GroupedMatmulConfig(), x, w)
  assert (plan.forward, plan.input_grad, plan.weight_grad) == ("xla", "xla", "xla")
  with pytest.raises(EpConfigError, match="needs Hopper GPUs"):
    grouped_matmul_plan(GroupedMatmulConfig(implementation="pallas"), x, w)
  with pytest.raises(EpConfigError, match="implementation must be one of"):
    GroupedMatmulConfig(implementation="cutlass")
  assert GroupedMatmulConfig().row_alignment == 128


def test_bad_operands_are_refused_at_trace_time():
  sizes = jnp.zeros(4, jnp.int32)
  with pytest.raises(EpConfigError, match="rows are bfloat16 but w is float32"):
    grouped_matmul(jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((4, 16, 8)), sizes)
  with pytest.raises(EpConfigError, match=r"rows \[M, K\] and w \[G, K, N\]"):
    grouped_matmul(jnp.zeros((8, 16)), jnp.zeros((4, 12, 8)), sizes)
  with pytest.raises(EpConfigError, match="group_sizes must be an int array"):
    grouped_matmul(jnp.zeros((8, 16)), jnp.zeros((4, 16, 8)), jnp.zeros(3, jnp.int32))


def test_pallas_refusals_name_the_reason():
  from jax_ep.moe import gmm_impls  # pylint: disable=import-outside-toplevel
  tiles = GroupedMatmulConfig().tiles
  assert gmm_impls.pallas_refusal((8, 128), (2, 128, 256), jnp.bfloat16, jnp.bfloat16,
                                  tiles) is None
  assert "float32 operands" in gmm_impls.pallas_refusal((8, 128), (2, 128, 256), jnp.float32,
                                                        jnp.float32, tiles)
  assert "not a multiple" in gmm_impls.pallas_refusal((8, 100), (2, 100, 256), jnp.bfloat16,
                                                      jnp.bfloat16, tiles)


def test_rows_padded_pads_to_the_tile_and_changes_no_product():
  """The Pallas products pad M to their row tiling (the kernels refuse M = 300 with
  a tiling of 8); with lax's products underneath, padding must change no row
  product, and the weight gradient only by float32 summation order: two orders of
  a sum of n products differ by at most 2 n u sum|a b| (u = 2^-24)."""
  x, w, d_out = gmm_oracle.operands(300, 6, 64, 48, jnp.float32)
  sizes = jnp.asarray(gmm_oracle.CASES[0][1], jnp.int32)
  seen_rows = []

  def spy(product):
    def run(*operands):
      seen_rows.append(operands[0].shape[0])
      return product(*operands)
    return run

  for product, operands, num_row_operands, row_result in (
      (gmm_impls.xla_forward, (x, w, sizes), 1, True),
      (gmm_impls.xla_input_grad, (d_out, w, sizes), 1, True),
      (gmm_impls.xla_weight_grad, (x, d_out, sizes), 2, False)):
    padded = gmm_impls.rows_padded(spy(product), 128, num_row_operands, row_result)
    if row_result:
      np.testing.assert_array_equal(padded(*operands), product(*operands))
    else:
      bound = 2 * 300 * 2.0**-24 * product(jnp.abs(x), jnp.abs(d_out), sizes)
      assert bool(jnp.all(jnp.abs(padded(*operands) - product(*operands)) <= bound))
  assert seen_rows == [384, 384, 384]


def test_cotangents_vary_like_their_primals_when_a_kernel_returns_invariant_results(
    monkeypatch):
  """Inside shard_map, a Pallas kernel's result varies over no manual axis; the
  custom VJP must still return cotangents typed like its inputs (seen on sm_90:
  "the bwd rule produced an output of type bfloat16[8,128,256] corresponding to
  an input of type bfloat16[8,128,256]{V:ep}")."""
  real_products = gmm_impls.products

  def invariant(product):  # psum over the one-device axis: same values, no vma
    return lambda *operands: jax.lax.psum(product(*operands), "ep")

  def products(implementation, tiles):
    return {name: invariant(fn) for name, fn in real_products(implementation, tiles).items()}

  monkeypatch.setattr(gmm_impls, "products", products)
  x, w, d_out = gmm_oracle.operands(300, 6, 64, 48, jnp.float32)
  sizes = jnp.asarray(gmm_oracle.CASES[0][1], jnp.int32)
  mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])

  def loss(a, b):
    return jnp.sum(grouped_matmul(a, b, sizes) * d_out)

  sharded = jax.shard_map(jax.grad(loss, argnums=(0, 1)), mesh=mesh,
                          in_specs=(P("ep"), P("ep")), out_specs=(P("ep"), P("ep")))
  placed = [jax.device_put(a, jax.sharding.NamedSharding(mesh, P("ep"))) for a in (x, w)]
  d_x, d_w = jax.jit(sharded)(*placed)
  want_x, want_w = jax.grad(
      lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes) * d_out), argnums=(0, 1))(x, w)
  np.testing.assert_allclose(d_x, want_x, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want_x))))
  np.testing.assert_allclose(d_w, want_w, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(want_w))))
