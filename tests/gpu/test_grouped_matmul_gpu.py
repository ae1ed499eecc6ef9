"""jax_ep.moe.grouped_matmul on this device, as "auto" runs it (the Pallas Hopper
kernels on sm_90, jax.lax.ragged_dot elsewhere) and on jax_ep's work-list kernel
("worklist", sm_90 only), against the float64 oracle (gmm_oracle: derived
bounds); and the work-list kernel against JAX's Pallas kernel, bit for bit (the
same tiles, the same float32 accumulation order). Local to each process: no
collective."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmm_oracle
from jax_ep.errors import EpConfigError
from jax_ep.moe.grouped_matmul import AUTO_ON_SM90
from jax_ep.moe import GroupedMatmulConfig, grouped_matmul, grouped_matmul_plan


def _on_sm90() -> bool:
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


def _refused_off_sm90(implementation: str, x, w) -> bool:
  """Off sm_90 a Hopper-only implementation is refused at trace time (checked
  here); True when the caller has nothing more to run."""
  if implementation == "auto" or _on_sm90():
    return False
  with pytest.raises(EpConfigError, match="needs Hopper GPUs"):
    grouped_matmul_plan(GroupedMatmulConfig(implementation=implementation), x, w)
  return True


IMPLEMENTATIONS = ["auto", "worklist"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name,sizes,rows", gmm_oracle.CASES, ids=[c[0] for c in gmm_oracle.CASES])
@pytest.mark.parametrize("k,n", [(256, 384), (128, 256)])
def test_grouped_matmul_products_bf16(name, sizes, rows, k, n, implementation):
  del name
  config = GroupedMatmulConfig(implementation=implementation)
  x, w, d_out = gmm_oracle.operands(rows, len(sizes), k, n, jnp.bfloat16)
  if _refused_off_sm90(implementation, x, w):
    return
  if jax.devices()[0].platform == "gpu" and implementation == "auto":  # the kernels this test is about
    plan = grouped_matmul_plan(config, x, w)
    assert (plan.forward, plan.input_grad, plan.weight_grad) == tuple(
        AUTO_ON_SM90[p] for p in ("forward", "input_grad", "weight_grad"))
  gmm_oracle.check_grouped_matmul(jax.jit(functools.partial(grouped_matmul, config=config)),
                                  x, w, sizes, d_out)


# Many groups: boundaries inside blocks, several in one block, empty groups
# between, rows past the groups (an expert-major buffer's worst case).
WORKLIST_CASES = [
    ("aligned_many_groups", [128, 0, 256, 128, 0, 0, 384, 128], 1280),
    ("boundaries_inside_blocks", [3, 61, 129, 1, 0, 255, 7, 64], 768),
    ("one_row_per_group", [1] * 16, 128),
]


@pytest.mark.parametrize("name,sizes,rows", WORKLIST_CASES, ids=[c[0] for c in WORKLIST_CASES])
def test_worklist_equals_the_pallas_kernels_bitwise(name, sizes, rows):
  del name
  x, w, d_out = gmm_oracle.operands(rows, len(sizes), 256, 384, jnp.bfloat16, seed=3)
  if _refused_off_sm90("worklist", x, w) | _refused_off_sm90("pallas", x, w):
    return
  group_sizes = jnp.asarray(sizes, jnp.int32)

  def products(implementation):
    gmm = functools.partial(grouped_matmul, config=GroupedMatmulConfig(
        implementation=implementation))
    out, vjp = jax.vjp(lambda r, ww: gmm(r, ww, group_sizes), x, w)
    return (out,) + vjp(d_out)

  ours, theirs = jax.jit(lambda: products("worklist"))(), jax.jit(lambda: products("pallas"))()
  for what, a, b in zip(("forward", "input_grad", "weight_grad"), ours, theirs):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                  err_msg=what)
  gmm_oracle.check_grouped_matmul(
      jax.jit(functools.partial(grouped_matmul, config=GroupedMatmulConfig(
          implementation="worklist"))), x, w, sizes, d_out)
