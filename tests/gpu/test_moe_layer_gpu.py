"""jax_ep.moe.moe_layer on the kernels, one process per EP rank: each rank checks
its tokens' y, its chosen experts and its gradients against the dense float64
oracle (moe_oracle, on the host CPU). bfloat16 rows and weights: the expert
GEMMs run on the Pallas Hopper kernels (sm_90). No XLA collective: gradients
are taken inside the shard_map (moe_testing)."""

import jax.numpy as jnp
import pytest

import moe_testing
from gpu_testing import num_ranks, rank, setup

TOKENS = 16
CASES = [("softmax_swiglu_ht", "uniform"), ("softmax_swiglu_ht", "all_to_rank_0"),
         ("deepseek_sigmoid_groups_shared_ht", "all_to_one_expert"),
         ("softmax_swiglu_fp8_ht", "uniform"), ("softmax_swiglu_ll", "uniform")]


@pytest.mark.parametrize("name,routing", CASES, ids=[f"{n}-{r}" for n, r in CASES])
def test_moe_layer_matches_dense_float64(name, routing):
  r = num_ranks()
  # 8 experts per rank and hidden/FFN multiples of the Pallas tiles (128).
  ep, mesh = setup(num_experts=8 * r, hidden=256, max_tokens_per_rank=TOKENS, num_topk=4,
                   low_latency_max_tokens_per_rank=TOKENS)
  config = moe_testing.layer_config(name, ep, ffn_size=128)
  params, x, dy = moe_testing.make_problem(config, r, TOKENS, routing, jnp.bfloat16, seed=r)
  # Weights rounded to bf16 up front, as the layer casts them: the oracle sees the same.
  params = {k: (v if k in ("router", "router_bias") else
                jnp.asarray(v, jnp.bfloat16).astype(jnp.float32).__array__())
            for k, v in params.items()}
  y, idx, g_x, g_params = moe_testing.run_layer(config, mesh, params, x, dy, jnp.bfloat16)
  mine = {k: (v[0] if v.shape[0] == 1 and k not in ("w_in", "w_out") else v)
          for k, v in g_params.items()}
  tokens = slice(rank() * TOKENS, (rank() + 1) * TOKENS)
  moe_testing.check_shard(config, params, x, dy, (y, idx, g_x, mine), tokens, rank(), r,
                          jnp.bfloat16, replicated_summed=False)
