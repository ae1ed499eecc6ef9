"""jax_ep.moe.grouped_matmul on this device, as "auto" runs it (the Pallas Hopper
kernels on sm_90, jax.lax.ragged_dot elsewhere), against the float64 oracle
(gmm_oracle: derived bounds). Local to each process: no collective."""

import functools

import jax
import jax.numpy as jnp
import pytest

import gmm_oracle
from jax_ep.moe.grouped_matmul import AUTO_ON_SM90
from jax_ep.moe import GroupedMatmulConfig, grouped_matmul, grouped_matmul_plan


@pytest.mark.parametrize("name,sizes,rows", gmm_oracle.CASES, ids=[c[0] for c in gmm_oracle.CASES])
@pytest.mark.parametrize("k,n", [(256, 384), (128, 256)])
def test_grouped_matmul_products_bf16(name, sizes, rows, k, n):
  del name
  config = GroupedMatmulConfig()
  x, w, d_out = gmm_oracle.operands(rows, len(sizes), k, n, jnp.bfloat16)
  if jax.devices()[0].platform == "gpu":  # the kernels this test is about
    plan = grouped_matmul_plan(config, x, w)
    assert (plan.forward, plan.input_grad, plan.weight_grad) == tuple(
        AUTO_ON_SM90[p] for p in ("forward", "input_grad", "weight_grad"))
  gmm_oracle.check_grouped_matmul(jax.jit(functools.partial(grouped_matmul, config=config)),
                                  x, w, sizes, d_out)
