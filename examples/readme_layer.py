import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep import launch, moe

if __name__ == "__main__":
  launch.initialize_distributed_from_env()  # under python -m jax_ep.launch; else no-op
  ep = jax_ep.EpConfig(num_experts=32, hidden=256, max_tokens_per_rank=64, num_topk=4,
                       group=jax_ep.EpGroup(axis_name="ep"))
  config = moe.MoeConfig(ep=ep, ffn_size=128, activation="swiglu", shared_ffn_size=128,
                         router=moe.RouterConfig(score_function="softmax"))
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  jax_ep.initialize(ep, mesh)
  specs = moe.param_specs(config)          # expert weights over "ep", the rest replicated
  params = {k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in moe.init_params(config, jax.random.key(0), jnp.bfloat16).items()}
  x = jax.device_put(
      jax.random.normal(jax.random.key(1), (mesh.size * 64, 256), jnp.bfloat16),
      NamedSharding(mesh, P("ep")))

  @jax.jit
  @jax.value_and_grad
  def loss(params, x):
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(specs, P("ep")),
                       out_specs=(P("ep"), P()))
    def layer(params, x):
      out = moe.moe_layer(params, x, config=config)   # out.y [T, H] bf16, per shard
      aux = jax.lax.pmean(out.load_balancing_loss, "ep")
      return out.y, aux

    y, aux = layer(params, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32))) + 0.01 * aux

  value, grads = loss(params, x)
  print(f"{jax_ep.runtime_state().backend_name} backend: loss {float(value):.4f}, "
        f"|grad w_in| {float(jnp.abs(grads['w_in'].astype(jnp.float32)).max()):.3g}")
