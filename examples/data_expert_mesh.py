"""An MoE layer on a (data, expert) mesh: expert parallelism on one axis, data
parallelism on the other.

Every coordinate of the data axis is an EP group of its own: its devices
exchange tokens only among themselves, over the expert axis. The batch is
sharded over both axes, the experts' weights over the expert axis only (each
data replica holds every expert once). The layer runs in one shard_map over the
whole mesh, as MaxText runs its MoE.

The script checks that each data replica's output equals the same layer run on
that replica's devices alone (a one-axis mesh), bit for bit, and prints OK.

    python examples/data_expert_mesh.py                          # 8 CPU devices: (2, 4)
    python -m jax_ep.launch -n 8 examples/data_expert_mesh.py    # 8 GPUs, one process each
    python -m jax_ep.launch -n 4 --devices 0,0,0,0 examples/data_expert_mesh.py  # one GPU
"""

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _devices  # noqa: E402  (8 host devices when there is no GPU; the launcher's env)

_devices.set_up()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import launch  # noqa: E402
from readme_use import expert_mlp  # noqa: E402

NUM_DATA = 2


def moe_layer(config: jax_ep.EpConfig, mesh: jax.sharding.Mesh, batch_axes):
  """jit(shard_map) of the layer: x [tokens, H] sharded over batch_axes."""

  @jax.jit
  @functools.partial(jax.shard_map, mesh=mesh, out_specs=P(batch_axes),
                     in_specs=(P(batch_axes), P(), P("expert"), P("expert")))
  def layer(x, router, w1, w2):
    scores = jax.nn.softmax(x.astype(jnp.float32) @ router)
    topk_weights, topk_idx = jax.lax.top_k(scores, config.num_topk)
    d = jax_ep.dispatch(x, topk_idx, topk_weights, config=config)
    y = expert_mlp(d.x, d.topk_idx, d.topk_weights, w1, w2)
    return jax_ep.combine(y, d.handle, config=config)

  return layer


def main() -> None:
  launch.initialize_distributed_from_env()  # under python -m jax_ep.launch; else no-op
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if len(devices) < 2 * NUM_DATA:
    sys.exit(f"needs at least {2 * NUM_DATA} devices (processes), found {len(devices)}")
  num_expert = len(devices) // NUM_DATA
  mesh = jax.make_mesh((NUM_DATA, num_expert), ("data", "expert"), devices=devices)
  config = jax_ep.EpConfig(num_experts=4 * num_expert, hidden=128, max_tokens_per_rank=32,
                           num_topk=2, group=jax_ep.EpGroup(axis_name="expert"))
  tokens, ffn = len(devices) * config.max_tokens_per_rank, 256
  rng = np.random.default_rng(0)
  host = dict(
      x=rng.standard_normal((tokens, config.hidden)),
      router=rng.standard_normal((config.hidden, config.num_experts)) / config.hidden**0.5,
      w1=rng.standard_normal((config.num_experts, config.hidden, ffn)) / config.hidden**0.5,
      w2=rng.standard_normal((config.num_experts, ffn, config.hidden)) / ffn**0.5)
  dtypes = dict(x=jnp.bfloat16, router=jnp.float32, w1=jnp.bfloat16, w2=jnp.bfloat16)
  host = {k: np.asarray(jnp.asarray(v, dtypes[k])) for k, v in host.items()}

  def place(mesh, batch_axes):
    specs = dict(x=P(batch_axes), router=P(), w1=P("expert"), w2=P("expert"))
    return [jax.make_array_from_callback(host[k].shape, NamedSharding(mesh, specs[k]),
                                         lambda index, k=k: host[k][index])
            for k in ("x", "router", "w1", "w2")]

  jax_ep.initialize(config, mesh)
  batch = ("data", "expert")
  out = moe_layer(config, mesh, batch)(*place(mesh, batch))
  print(f"jax_ep backend: {jax_ep.runtime_state().backend_name}; mesh {dict(mesh.shape)}, "
        f"EP over 'expert': {NUM_DATA} groups of {num_expert}")
  mine = {s.index[0].start or 0: np.asarray(s.data) for s in out.addressable_shards}

  # Each data replica alone, on a one-axis mesh of its own devices.
  rows = tokens // NUM_DATA
  for replica in range(NUM_DATA):
    alone = jax.make_mesh((num_expert,), ("expert",),
                          devices=list(mesh.devices[replica]))
    jax_ep.initialize(config, alone)
    expected = host["x"][replica * rows:(replica + 1) * rows]
    saved = host["x"]
    host["x"] = expected
    ref = moe_layer(config, alone, "expert")(*place(alone, "expert"))
    host["x"] = saved
    for shard in ref.addressable_shards:
      start = replica * rows + (shard.index[0].start or 0)
      if start in mine:
        np.testing.assert_array_equal(np.asarray(mine[start]).view(np.uint16),
                                      np.asarray(shard.data).view(np.uint16))
  jax_ep.finalize()
  print("OK: each data replica equals its EP group alone")


if __name__ == "__main__":
  main()
