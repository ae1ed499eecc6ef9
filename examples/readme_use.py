import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import launch


def expert_mlp(rows, local_idx, weights, w1, w2):
  """This rank's experts (a GELU MLP each) on the rows a dispatch delivered.

  rows [C, H]: one row per received token, in (source rank, source token)
  order, each token once however many of its experts live here; padding past
  d.num_tokens. local_idx int32 [C, K]: the token's experts as local ids, -1
  where the expert lives on another rank (and on padding rows). weights f32
  [C, K]. w1 [E_local, H, F], w2 [E_local, F, H].
  Returns [C, H] of rows.dtype: sum over the row's local experts of weight * MLP(row).
  """
  num_rows, num_topk = local_idx.shape
  num_local = w1.shape[0]
  # ragged_dot wants each expert's rows contiguous: sort the (row, k) pairs by
  # expert; pairs without a local expert sort last, outside every group.
  pair_expert = jnp.where(local_idx >= 0, local_idx, num_local).reshape(-1)
  order = jnp.argsort(pair_expert, stable=True)
  pair_row = order // num_topk
  group_sizes = jnp.bincount(pair_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
  h = jax.lax.ragged_dot(rows[pair_row], w1, group_sizes, preferred_element_type=jnp.float32)
  g = jax.nn.gelu(h).astype(rows.dtype)
  y = jax.lax.ragged_dot(g, w2, group_sizes, preferred_element_type=jnp.float32)
  # Un-sort: weight each pair and add it to its row (pairs outside the groups weigh 0).
  pair_weight = jnp.where(local_idx >= 0, weights, 0.0).reshape(-1)[order]
  out = jnp.zeros((num_rows, rows.shape[1]), jnp.float32).at[pair_row].add(
      y * pair_weight[:, None])
  return out.astype(rows.dtype)


if __name__ == "__main__":
  launch.initialize_distributed_from_env()  # under python -m jax_ep.launch; else no-op
  config = jax_ep.EpConfig(num_experts=32, hidden=256, max_tokens_per_rank=64, num_topk=4,
                           group=jax_ep.EpGroup(axis_name="ep"))
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))   # one EP rank per device
  jax_ep.initialize(config, mesh)   # before jit, on every process; picks the backend
  num_ranks, ffn = mesh.shape["ep"], 512
  tokens = num_ranks * config.max_tokens_per_rank

  # Global arrays, placed on the mesh: jax.make_mesh gives Explicit axes, so
  # shard_map's inputs must carry the sharding its in_specs name.
  rng = np.random.default_rng(0)
  host = dict(
      x=rng.standard_normal((tokens, config.hidden)),
      router=rng.standard_normal((config.hidden, config.num_experts)) / config.hidden**0.5,
      w1=rng.standard_normal((config.num_experts, config.hidden, ffn)) / config.hidden**0.5,
      w2=rng.standard_normal((config.num_experts, ffn, config.hidden)) / ffn**0.5)
  dtypes = dict(x=jnp.bfloat16, router=jnp.float32, w1=jnp.bfloat16, w2=jnp.bfloat16)
  specs = dict(x=P("ep"), router=P(), w1=P("ep"), w2=P("ep"))   # experts split over ranks
  args = {k: jax.device_put(jnp.asarray(v, dtypes[k]), NamedSharding(mesh, specs[k]))
          for k, v in host.items()}

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, out_specs=P("ep"),
                     in_specs=(specs["x"], specs["router"], specs["w1"], specs["w2"]))
  def moe(x, router, w1, w2):
    # Per shard: x bf16 [T, H], router f32 [H, E], w1/w2 this rank's E_local experts.
    scores = jax.nn.softmax(x.astype(jnp.float32) @ router)
    topk_weights, topk_idx = jax.lax.top_k(scores, config.num_topk)   # f32, int32 [T, K]
    d = jax_ep.dispatch(x, topk_idx, topk_weights, config=config)
    # d.x [R*T, H] bf16; d.topk_idx [R*T, K] local expert ids (-1: elsewhere);
    # d.topk_weights [R*T, K]; d.num_tokens rows valid.
    y = expert_mlp(d.x, d.topk_idx, d.topk_weights, w1, w2)
    # Each token's rows come back from every rank that received it and are
    # summed in float32; the result has y's dtype (bf16 here), [T, H].
    return jax_ep.combine(y, d.handle, config=config)

  out = moe(args["x"], args["router"], args["w1"], args["w2"])
  shard = out.addressable_shards[0]   # this process's first shard (with one process, rank 0's)
  first = np.asarray(shard.data[0, :4], np.float32)
  print(f"{jax_ep.runtime_state().backend_name} backend, R={num_ranks}: out {out.dtype}"
        f"{list(out.shape)}; out[{shard.index[0].start or 0}, :4] = {first}")
