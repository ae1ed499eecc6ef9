"""jax_ep.bench.layouts asks for the in-kernel profile of every op it times
(JAX_EP_PROFILE=1 then covers the --layouts rows), and not of its floors, which
are XLA copies with no jax_ep kernel in them."""

import jax
import numpy as np

import jax_ep
from jax_ep.bench import layouts, measure


class _RecordingRunner:
  """Stands in for measure.Runner: records each label's profile flag, times nothing."""

  def __init__(self):
    self.mesh = jax.make_mesh((1,), ("ep",))
    self.profile_of: dict[str, bool] = {}

  def time(self, label, op, args, *, profile=False, single_shot=False, num_calls=None):
    del op, args, single_shot, num_calls
    self.profile_of[label] = profile
    return measure.Outcome(us=2.0, error=None)


def test_layout_ops_are_profiled_and_floors_are_not():
  config = jax_ep.EpConfig(num_experts=8, num_topk=2, hidden=256, max_tokens_per_rank=16)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 256)).astype(jax.numpy.bfloat16)
  q = rng.standard_normal((16, 256)).astype(jax.numpy.float8_e4m3fn)
  scales = np.ones((16, 2), np.float32)
  idx = np.stack([rng.permutation(8)[:2] for _ in range(16)]).astype(np.int32)
  w = np.full((16, 2), 0.5, np.float32)
  runner = _RecordingRunner()
  rows = layouts.rows(runner, config, x, q, scales, idx, w, "jax_ep")
  assert rows and len(runner.profile_of) == len(rows)
  floors_timed = {label for label in runner.profile_of if label.startswith("floor: ")}
  assert len(floors_timed) == 4  # bf16 and FP8 pair rows, A = 1 and 128
  for label, profile in runner.profile_of.items():
    assert profile == (label not in floors_timed), label
