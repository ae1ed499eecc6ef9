"""The checks of examples/moe_transformer.py: jax_ep against dense routing, and learning.

The dense check trains two copies of the model for a few AdamW steps in
float32 from the same parameters on the same batches. One runs its MoE FFNs on
jax_ep (expert-major dispatch, ragged_dot experts, combine), the other densely
(every expert on every token, then the top-k mix) with the experts the jax_ep
copy chose at that step, so that near-ties of the router cannot send a token
to different experts. float32 keeps the rounding bound tight; training itself
runs in bfloat16.

The bounds (rounding_budget; compare_with_dense applies them). Both copies compute the
same function; they differ only in the order of float32 sums: the experts'
matmuls (ragged_dot over pair rows against an einsum over all tokens), each
token's mix (the combine's per-rank partials in rank order against k order),
the weight gradients' sums over tokens (per rank, then over ranks), and
whatever XLA orders differently in two separately compiled programs. Take every
sum on the longest path from the parameters to the loss and back to a
gradient as reordered: a float32 sum of n terms errs by at most
gamma_n = n u / (1 - n u) (u = 2^-24) of its terms' magnitudes, and the
errors along a path add, so with n the summed lengths and D the elementwise
roundings on the path, a loss or gradient differs by at most

  rho = D u + gamma_n                   relative (norm-wise for a gradient),

taking the terms' magnitudes as the result's (pre-norm residual blocks keep
activations of the order of 1: first order, no cancellation beyond that).
An AdamW step moves parameter element i by lr m_i / (sqrt(v_i) + eps) (plus
the decay): m and sqrt(v) scale with the gradient, so a relative change rho of
the gradient moves the direction by at most 2 rho (first order), and storing
theta + update in float32 rounds once on each side:

  |theta_ep - theta_dense| after s steps <= sum over steps j < s of
      2 u |theta_j+1| + 2 rho |theta_j+1 - theta_j|        (norm-wise per array),

leaving out what the parameters' own difference does to the next gradients
and to the decay (of the order of lr times that difference). The loss at step
s moves with the parameters' measured difference d_s (Cauchy-Schwarz, first
order) and by its own rounding:

  |loss_ep - loss_dense| <= rho |loss_dense| + |grad_dense| |d_s|.

These are worst cases: on 8 CPU devices (preset small, 5 steps, 2026-12-01)
the gradients differ by 2e-7 relative (under 0.001 of rho), the parameters by
under 0.002 of their bound, and the losses not at all. Yet every gate 0.1% too
large fails the check (tests/cpu/test_moe_transformer.py): the gradients then
move by about 1e-3 relative, above rho.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import markov_task
import moe_transformer_model as model
from moe_transformer_step import BATCH_AXES, make_train_step, place, to_host

U32 = 2.0**-24
# Elementwise float32 roundings on one path through a block, forward:
# attention (norm, q/k/v, scores' scale, softmax exp and division, output
# projection, residual add) 8, MoE FFN (norm, router softmax, gate, GELU, gate
# product, shared expert's GELU, shared + routed, residual add) 8; outside the
# blocks (embedding sum, final norm, log-sum-exp, the mean) 4. The backward
# pass rounds as often again.
ROUNDINGS_PER_BLOCK = 16
ROUNDINGS_OUTSIDE = 4


def gamma(n: int) -> float:
  return n * U32 / (1 - n * U32)


def sum_lengths(config: model.ModelConfig, num_tokens: int, ep_ranks: int) -> int:
  """n: terms of all the sums on the longest path from the first block's
  parameters to the loss (forward) and back to their gradient (the backward's
  transposed matmuls, then the weight gradient's sum over all num_tokens)."""
  h, f, fs, s, k = config.hidden, config.ffn, config.shared_ffn, config.seq_len, config.topk
  dh, e, v = h // config.heads, config.experts, config.vocab
  # Forward: norm, q/k/v, scores, softmax, mix, output projection; norm,
  # router, gate softmax, w1, w2, the mix (k pairs, then the ranks' partials),
  # shared expert w1, w2.
  block_forward = h + h + dh + s + s + h + h + h + k + h + f + k + ep_ranks + h + fs
  # Backward, the transposes: q/k/v (3h), scores (dh), mix (s), output (h);
  # router (E), gates (k), w1 (f), w2 (h), shared w1 (fs), w2 (h), the norms (h
  # each). The combine's backward copies rows (no sum).
  block_backward = 3 * h + dh + s + h + e + k + f + h + fs + h + 2 * h
  outside_forward = h + h + v + num_tokens        # final norm, logits, log-sum-exp, mean
  outside_backward = v + h                        # logits' transpose, final norm
  weight_gradient = num_tokens                    # per rank, then over the ranks
  return (config.layers * (block_forward + block_backward) + outside_forward +
          outside_backward + weight_gradient)


def rounding_budget(config: model.ModelConfig, num_tokens: int, ep_ranks: int) -> float:
  """rho of the module docstring: the relative float32 difference allowed
  between the two copies' losses or gradients at the same parameters."""
  roundings = 2 * (ROUNDINGS_PER_BLOCK * config.layers + ROUNDINGS_OUTSIDE)
  return roundings * U32 + gamma(sum_lengths(config, num_tokens, ep_ranks))


def _norms(tree) -> dict[str, float]:
  return {jax.tree_util.keystr(path): float(np.linalg.norm(np.asarray(a, np.float64)))
          for path, a in jax.tree_util.tree_leaves_with_path(tree)}


def _diff(a, b):
  return jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)


@dataclasses.dataclass(frozen=True)
class DenseCheck:
  """What the dense check measured, and its verdict.

  Attributes:
    rho: the relative rounding budget (rounding_budget).
    losses: float64 [steps, 2]: jax_ep's and the dense copy's loss per step.
    loss_bounds: float64 [steps]: loss_bound per step.
    grad_errors: per array, |grad_ep - grad_dense| / |grad_dense| at step 0.
    param_errors: per array, |theta_ep - theta_dense| after the last step.
    param_bounds: per array, its bound (module docstring).
    same_load: every step's pairs per expert equal the dense copy's counts.
  """

  rho: float
  losses: np.ndarray
  loss_bounds: np.ndarray
  grad_errors: dict[str, float]
  param_errors: dict[str, float]
  param_bounds: dict[str, float]
  same_load: bool

  def worst(self) -> dict[str, float]:
    """Each measure's largest fraction of its bound."""
    return dict(
        loss=float(np.max(np.abs(self.losses[:, 0] - self.losses[:, 1]) / self.loss_bounds)),
        grads=max(self.grad_errors.values()) / self.rho,
        params=max(self.param_errors[k] / self.param_bounds[k] for k in self.param_errors))

  @property
  def ok(self) -> bool:
    return self.same_load and max(self.worst().values()) <= 1


def compare_with_dense(config32: model.ModelConfig, ep_ffn: model.MoeFfn, mesh, host_params,
                       batches: np.ndarray, optimizer, ep_ranks: int) -> DenseCheck:
  """Trains both copies for len(batches) steps (module docstring).

  config32: the model in float32 compute; ep_ffn: model.moe_ffn_ep(...);
  host_params: numpy float32 (model.init_params); batches int32 [steps, B, S + 1].
  """
  ep_specs = model.param_specs(host_params, "expert")
  dense_specs = model.param_specs(host_params, None)
  ep_step = make_train_step(config32, mesh, ep_ffn, ep_specs, optimizer, experts_split=True,
                            return_grads=True)
  dense_step = make_train_step(config32, mesh, model.moe_ffn_dense, dense_specs, optimizer,
                               experts_split=False, routing_input=True, return_grads=True)
  p_ep, p_dense = place(mesh, host_params, ep_specs), place(mesh, host_params, dense_specs)
  s_ep, s_dense = jax.jit(optimizer.init)(p_ep), jax.jit(optimizer.init)(p_dense)
  num_tokens = batches.shape[1] * (batches.shape[2] - 1)
  rho = rounding_budget(config32, num_tokens, ep_ranks)
  previous = jax.tree.map(np.asarray, host_params)
  param_bounds = {k: 0.0 for k in _norms(host_params)}
  losses, loss_bounds, same_load, grad_errors = [], [], True, {}
  gap = 0.0                                    # |theta_ep - theta_dense| before this step
  with jax.default_matmul_precision("highest"):   # float32 matmuls, not TF32 on GPUs
    for s, batch in enumerate(batches):
      tokens = place(mesh, batch, P(BATCH_AXES))
      p_ep, s_ep, m_ep = ep_step(p_ep, s_ep, tokens)
      p_dense, s_dense, m_dense = dense_step(p_dense, s_dense, tokens, m_ep["routing"])
      h_ep, h_dense = to_host((m_ep, p_ep)), to_host((m_dense, p_dense))
      (m_ep, theta_ep), (m_dense, theta_dense) = h_ep, h_dense
      same_load = same_load and np.array_equal(m_ep["load"], m_dense["load"])
      loss_ep, loss_dense = float(m_ep["loss"]), float(m_dense["loss"])
      grad_norm = float(np.sqrt(sum(v**2 for v in _norms(m_dense["grads"]).values())))
      losses.append((loss_ep, loss_dense))
      loss_bounds.append(rho * abs(loss_dense) + grad_norm * gap)
      if s == 0:
        dense_norms = _norms(m_dense["grads"])
        grad_diffs = _norms(_diff(m_ep["grads"], m_dense["grads"]))
        grad_errors = {k: grad_diffs[k] / dense_norms[k] for k in grad_diffs if dense_norms[k] > 0}
      sizes, steps = _norms(theta_dense), _norms(_diff(theta_dense, previous))
      for k in param_bounds:
        param_bounds[k] += 2 * U32 * sizes[k] + 2 * rho * steps[k]
      previous = theta_dense
      param_errors = _norms(_diff(theta_ep, theta_dense))
      gap = float(np.sqrt(sum(v**2 for v in param_errors.values())))
  return DenseCheck(rho=rho, losses=np.asarray(losses), loss_bounds=np.asarray(loss_bounds),
                    grad_errors=grad_errors, param_errors=param_errors, param_bounds=param_bounds,
                    same_load=same_load)


def learning_threshold(task: markov_task.MarkovTask) -> float:
  """The loss the last 10% of the steps must average below.

  No model beats the entropy rate; one that ignores its context cannot beat
  the unigram entropy (and starts near log V, above it). Below the midpoint,
  the model predicts with more than half of the information the previous token
  holds about the next: it has learned the chain, not only the tokens'
  frequencies.
  """
  return task.entropy_rate + 0.5 * (task.unigram_entropy - task.entropy_rate)


def mean_of_last_tenth(losses: np.ndarray) -> float:
  return float(np.mean(losses[-max(1, len(losses) // 10):]))
