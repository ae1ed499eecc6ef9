"""The PNG of examples/moe_transformer.py: the loss curve and the experts' load."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")   # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def write_png(path: str, losses: np.ndarray, load_steps: np.ndarray, loads: np.ndarray, *,
              entropy_rate: float, unigram_entropy: float, title: str) -> None:
  """Writes the training curves.

  Args:
    losses: float [steps]: the cross-entropy of every step (nats).
    load_steps: int [n]: the steps at which ``loads`` were taken.
    loads: int [n, layers, E]: pairs each expert received, summed over ranks.
    entropy_rate, unigram_entropy: the task's bounds (markov_task), drawn as lines.
  """
  num_layers, num_experts = loads.shape[1:]
  fig, (ax_loss, ax_load) = plt.subplots(1, 2, figsize=(12, 4.5),
                                         gridspec_kw=dict(width_ratios=[1, 1.2]))
  ax_loss.plot(np.arange(len(losses)), losses, lw=1, label="training cross-entropy")
  ax_loss.axhline(unigram_entropy, color="gray", ls="--", lw=1,
                  label=f"unigram entropy {unigram_entropy:.2f} (no context)")
  ax_loss.axhline(entropy_rate, color="k", ls=":", lw=1,
                  label=f"entropy rate {entropy_rate:.2f} (best possible)")
  ax_loss.set(xlabel="step", ylabel="nats per token", title="loss")
  ax_loss.legend(fontsize=8)

  # Each expert's share of its layer's pairs: 1/E is a perfect balance.
  share = loads / np.maximum(loads.sum(axis=2, keepdims=True), 1)
  rows = share.transpose(1, 2, 0).reshape(num_layers * num_experts, -1)
  image = ax_load.imshow(rows, aspect="auto", interpolation="nearest", cmap="viridis",
                         extent=(load_steps[0], load_steps[-1], rows.shape[0] - 0.5, -0.5))
  for layer in range(1, num_layers):
    ax_load.axhline(layer * num_experts - 0.5, color="w", lw=1)
  ax_load.set_yticks([(layer + 0.5) * num_experts - 0.5 for layer in range(num_layers)],
                     [f"layer {layer}" for layer in range(num_layers)])
  ax_load.set(xlabel="step", ylabel=f"experts 0 to {num_experts - 1}, top to bottom",
              title=f"expert load: each expert's share of its layer's pairs (1/E = "
                    f"{1 / num_experts:.3f})")
  fig.colorbar(image, ax=ax_load)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
