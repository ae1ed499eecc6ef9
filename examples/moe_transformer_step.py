"""The training step of examples/moe_transformer.py: AdamW on a ("data", "expert") mesh."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import moe_transformer_model as model

BATCH_AXES = ("data", "expert")   # the batch is split over both; the experts over "expert"


def make_optimizer(learning_rate: float, warmup: int, steps: int,
                   weight_decay: float) -> optax.GradientTransformation:
  """AdamW with a linear warmup and a cosine decay to a tenth; no weight decay on
  vectors (the norms' scales)."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup,
                                                max(steps, warmup + 1),
                                                end_value=learning_rate / 10)
  return optax.adamw(schedule, weight_decay=weight_decay,
                     mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params))


def make_train_step(config: model.ModelConfig, mesh, moe_ffn: model.MoeFfn, specs,
                    optimizer: optax.GradientTransformation, *, experts_split: bool,
                    routing_input: bool = False, return_grads: bool = False):
  """jit(params, opt_state, tokens[, routing]) -> (params, opt_state, metrics).

  params float32 as ``specs`` (model.param_specs); tokens int32 [B, S + 1] split
  over BATCH_AXES; routing (with routing_input) int32 [layers, B * S, K], split
  over BATCH_AXES on dim 1. params and opt_state are donated.
  metrics: loss, cross_entropy float32 []; load int32 [layers, E] (pairs per
  expert, summed over ranks); dropped int32 [layers] (pairs over the capacity,
  summed over ranks); routing int32 [layers, B * S, K] (the experts used);
  grads (with return_grads) as params.
  ``experts_split``: moe_ffn counts the pairs of this rank's experts (jax_ep),
  not of all E (the dense reference).
  """

  def body(params, tokens, *routing):
    loss, aux = model.local_loss(params, tokens, config, moe_ffn, BATCH_AXES, *routing)
    counts = aux["stats"]["tokens_per_expert"]                         # [layers, E or E_local]
    if experts_split:   # rank r of the expert axis holds experts r*E_local ... (r+1)*E_local-1
      start = jax.lax.axis_index("expert") * counts.shape[1]
      counts = jax.lax.dynamic_update_slice(
          jnp.zeros((config.layers, config.experts), counts.dtype), counts, (0, start))
    return loss, dict(cross_entropy=aux["cross_entropy"],
                      load=jax.lax.psum(counts, BATCH_AXES),
                      dropped=jax.lax.psum(aux["stats"]["dropped"], BATCH_AXES),
                      routing=aux["routing"])

  routing_spec = P(None, BATCH_AXES)
  loss_fn = jax.shard_map(
      body, mesh=mesh,
      in_specs=(specs, P(BATCH_AXES)) + ((routing_spec,) if routing_input else ()),
      out_specs=(P(), dict(cross_entropy=P(), load=P(), dropped=P(), routing=routing_spec)))

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens, *routing):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, *routing)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = dict(loss=loss, **aux)
    if return_grads:
      metrics["grads"] = grads
    return optax.apply_updates(params, updates), opt_state, metrics

  return step


def place(mesh, host, specs):
  """Host numpy pytree -> global arrays on the mesh; every process passes the
  same host values and keeps its devices' parts."""
  return jax.tree.map(
      lambda a, s: jax.make_array_from_callback(a.shape, NamedSharding(mesh, s),
                                                lambda index, a=a: a[index]), host, specs)


def to_host(tree):
  """Global arrays (replicated or split) -> numpy, the whole arrays on every process."""
  if jax.process_count() > 1:
    tree = multihost_utils.process_allgather(tree, tiled=True)
  return jax.tree.map(np.asarray, tree)
