"""The README's "Use" snippet: it is examples/readme_use.py, and it computes the MoE layer.

The snippet runs as a script on 8 CPU devices; its output is checked against a
float64 numpy computation of the same layer, within the first-order bound of
the roundings the snippet makes (bf16 rows: the hidden activation, each rank's
weighted sum, the combined output; float32 sums elsewhere).
"""

import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
EXAMPLE = os.path.join(ROOT, "examples", "readme_use.py")
BF16_UNIT_ROUNDOFF = 2.0**-8
F32_UNIT_ROUNDOFF = 2.0**-24

# Runs the example as __main__ and saves its inputs and output (as float32: exact for bf16).
_HARNESS = """
import runpy, sys
import numpy as np
g = runpy.run_path(sys.argv[1], run_name="__main__")
arrays = {k: np.asarray(v, np.float32) for k, v in g["args"].items()}
np.savez(sys.argv[2], out=np.asarray(g["out"], np.float32), **arrays)
"""


def _section_python_block(title: str) -> str:
  """The first python block of the README's section ``## <title>``."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    readme = f.read()
  section = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", readme, re.S | re.M)
  assert section, f"README.md has no '## {title}' section"
  block = re.search(r"^```python\n(.*?)^```$", section.group(1), re.S | re.M)
  assert block, f"the {title} section has no python block"
  return block.group(1)


def _use_section_python_block() -> str:
  return _section_python_block("Use")


def test_readme_use_block_is_the_example_file():
  with open(EXAMPLE, encoding="utf-8") as f:
    assert _use_section_python_block() == f.read()


def _gelu(h):
  """jax.nn.gelu's default (tanh) form, and its derivative."""
  c = np.sqrt(2 / np.pi)
  t = np.tanh(c * (h + 0.044715 * h**3))
  return 0.5 * h * (1 + t), 0.5 * (1 + t) + 0.5 * h * (1 - t**2) * c * (1 + 3 * 0.044715 * h**2)


def _gamma(n: int) -> float:
  """Bound on the relative error of a float32 sum of n terms (of their magnitudes)."""
  return n * F32_UNIT_ROUNDOFF / (1 - n * F32_UNIT_ROUNDOFF)


def _routings(x, router, num_topk):
  """The float64 top-k, and where float32 logits may pick differently: the top-k
  with the k-th and (k+1)-th experts swapped, and the tokens whose margin between
  them is within the logits' error bound (either pick is then right)."""
  logits = x @ router
  logit_err = _gamma(x.shape[1]) * (np.abs(x) @ np.abs(router)).max(axis=1)
  order = np.argsort(-logits, axis=1)
  tokens = np.arange(len(x))
  ranked = logits[tokens[:, None], order]
  ambiguous = ranked[:, num_topk - 1] - ranked[:, num_topk] <= 2 * logit_err
  # A tie across more than the boundary pair would need more alternatives.
  assert np.all(ranked[:, num_topk - 2] - ranked[:, num_topk] > 2 * logit_err)
  assert np.all(ranked[:, num_topk - 1] - ranked[:, num_topk + 1] > 2 * logit_err)
  swapped = order[:, :num_topk].copy()
  swapped[:, -1] = order[:, num_topk]
  return order[:, :num_topk], swapped, ambiguous, logit_err


def _experts(x, w1, w2):
  """Per expert e, on every token, float64 [E, T, H]: the MLP's output y, and the
  magnitudes |g| @ |w2| and (|gelu'(h)| * (|x| @ |w1|)) @ |w2| that bound its error."""
  y, g_w2, h_w2 = (np.empty((len(w1),) + x.shape) for _ in range(3))
  for e in range(len(w1)):
    g, slope = _gelu(x @ w1[e])
    y[e] = g @ w2[e]
    g_w2[e] = np.abs(g) @ np.abs(w2[e])
    h_w2[e] = (slope * (np.abs(x) @ np.abs(w1[e]))) @ np.abs(w2[e])
  return y, g_w2, h_w2


def _dense_layer(x, router, experts, idx, logit_err, ffn):
  """(out, bound) in float64: the mix of the chosen experts' outputs (softmax weights),
  and the first-order bound on the snippet's error."""
  logits = x @ router
  probs = np.exp(logits - logits.max(axis=1, keepdims=True))
  probs /= probs.sum(axis=1, keepdims=True)
  weights = np.take_along_axis(probs, idx, axis=1)[..., None]
  tokens = np.arange(len(x))[:, None]
  y, g_w2, h_w2 = (a[idx, tokens] for a in experts)           # [T, K, H]
  out = np.sum(weights * y, axis=1)
  s_y, s_g, s_h = (np.sum(weights * np.abs(a), axis=1) for a in (y, g_w2, h_w2))
  # Sums: the two matmuls, each rank's weighted sum, the combine over ranks (<= E terms).
  gamma = _gamma(x.shape[1] + ffn + idx.shape[1] + router.shape[1])
  weight_err = 2 * logit_err[:, None] + 4 * F32_UNIT_ROUNDOFF   # softmax of the logits
  u = BF16_UNIT_ROUNDOFF
  bound = u * (np.abs(out) + s_y + s_g) + gamma * (s_y + s_g + s_h) + weight_err * s_y
  return out, bound * (1 + 4 * u)


def test_readme_use_runs_and_computes_the_layer(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  saved = tmp_path / "run.npz"
  result = subprocess.run([sys.executable, "-c", _HARNESS, EXAMPLE, str(saved)], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout + result.stderr
  printed = re.fullmatch(r"xla backend, R=8: out bfloat16\[512, 256\]; out\[0, :4\] = \[(.*)\]",
                         result.stdout.strip())
  assert printed, result.stdout
  run = {k: v.astype(np.float64) for k, v in np.load(saved).items()}
  np.testing.assert_allclose([float(v) for v in printed.group(1).split()], run["out"][0, :4],
                             rtol=1e-7)
  idx, swapped, ambiguous, logit_err = _routings(run["x"], run["router"], num_topk=4)
  experts = _experts(run["x"], run["w1"], run["w2"])
  ffn = run["w1"].shape[2]
  ref, bound = _dense_layer(run["x"], run["router"], experts, idx, logit_err, ffn)
  ratio = np.max(np.abs(run["out"] - ref) / bound, axis=1)
  alt, alt_bound = _dense_layer(run["x"], run["router"], experts, swapped, logit_err, ffn)
  alt_ratio = np.max(np.abs(run["out"] - alt) / alt_bound, axis=1)
  ratio = np.where(ambiguous, np.minimum(ratio, alt_ratio), ratio)
  assert np.all(ratio <= 1), f"max error / bound = {np.max(ratio):.3f}"
  assert np.max(np.abs(run["out"] - ref)) > 0  # bf16 rows: the comparison is not vacuous
  assert np.sum(ambiguous) < len(ambiguous) // 10   # the check covers the tokens


def test_readme_layer_block_is_the_example_file_and_runs():
  path = os.path.join(ROOT, "examples", "readme_layer.py")
  with open(path, encoding="utf-8") as f:
    assert _section_python_block("The MoE layer") == f.read()
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  result = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  match = re.search(r"xla backend: loss ([\d.]+), \|grad w_in\| ([\d.e+-]+)", result.stdout)
  assert match, result.stdout[-2000:]
  assert 0 < float(match.group(1)) < 10 and float(match.group(2)) > 0
