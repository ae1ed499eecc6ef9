"""Helpers of the low-latency GPU tests (test_ll_gpu.py, test_ll_presummed_gpu.py):
the configs, and a device expert whose outputs the host reproduces bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from gpu_testing import BF16, F32, num_ranks, setup


def experts(e: int) -> int:
  """E for this R: the table's E, raised to a multiple of R (E_local >= 1)."""
  r = num_ranks()
  return -(-max(e, r) // r) * r


def ll_setup(e, k, t_ll, h):
  """HT buffers off; max_tokens_per_rank above T_ll, so that the LL shapes
  follow the LL cap (low_latency_max_tokens_per_rank)."""
  return setup(num_experts=e, hidden=h, max_tokens_per_rank=4 * t_ll, num_topk=k,
               low_latency_max_tokens_per_rank=t_ll, enable_high_throughput=False)


def expert_scale(num_local: int, rank_):
  """c[j] = 1 + j/8 + rank/16: a different positive factor per local expert
  and rank, exact in float32 with at most 12 significant bits."""
  return 1.0 + 0.125 * jnp.arange(num_local, dtype=jnp.float32) + 0.0625 * rank_


def expert(y):
  """Device expert: bf16(f32(row) * c[expert]); the product of a bf16 row and
  c is exact in float32 (8 + 12 bits), so the one rounding matches the host's."""
  c = expert_scale(y.shape[0], jax.lax.axis_index("ep").astype(jnp.float32))
  return (y.astype(jnp.float32) * c[:, None, None]).astype(jnp.bfloat16)


def host_scale(num_local: int) -> np.ndarray:
  """float32[R, E_local]: c of every rank's experts."""
  ranks = np.arange(num_ranks(), dtype=F32)[:, None]
  return (np.float32(1) + np.float32(0.125) * np.arange(num_local, dtype=F32)
          + np.float32(0.0625) * ranks).astype(F32)


def host_expert(x: np.ndarray, count: np.ndarray) -> np.ndarray:
  """[R, E_local, L, H] dispatched rows -> the experts' outputs (bf16).

  count: int[R, E_local], the rows each expert received (LlDispatch.count).
  Only those rows are computed: the host oracle's rows past the count are
  zeros, and so is their product (the same result as over every row, at a
  fraction of the cost: most of an LL buffer's L = R * T_ll rows are past the
  count)."""
  c = host_scale(x.shape[1])
  valid = valid_rows(count, x.shape[2])                       # [R, E_local, L]
  out = np.zeros(x.shape, BF16)
  scale = np.broadcast_to(c[:, :, None], valid.shape)[valid]
  out[valid] = (x[valid].astype(F32) * scale[:, None]).astype(BF16)
  return out


def valid_rows(count: np.ndarray, rows_: int) -> np.ndarray:
  return np.arange(rows_) < np.asarray(count)[..., None]
