"""The benchmark's timing helpers (jax_ep/bench/timing.py)."""

import jax
import numpy as np

from jax_ep.bench import timing


def test_single_shot_runs_each_program_once():
  """time_single_shot: a 2-call warm-up, then num_calls and 1 call, each executed
  once (a second execution of one ragged_all_to_all program hung on the GPUs)."""
  calls = []

  def op(x):
    jax.debug.callback(lambda: calls.append(1))
    return x * 2 + 1

  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  result = timing.time_single_shot(op, mesh, [np.ones((4 * jax.device_count(), 128), np.float32)], num_calls=5)
  jax.effects_barrier()
  assert len(calls) == (2 + 5 + 1) * jax.device_count()  # one callback per call and shard
  assert result.repeats == 1 and result.calls_per_loop == 5
  assert np.isfinite(result.median_us)


def test_ragged_baseline_is_single_shot_unless_the_decomposer_is_on(monkeypatch):
  """Without XLA's ragged_all_to_all decomposer the baseline runs single-shot (the
  NCCL send/recv fallback hung on a second execution); with it, the slope harness."""
  from jax_ep.bench import ht  # pylint: disable=import-outside-toplevel

  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert ht._ragged_needs_single_shot()  # pylint: disable=protected-access
  monkeypatch.setenv("XLA_FLAGS", f"--foo=1 {ht.RAGGED_DECOMPOSER_FLAG}")
  assert not ht._ragged_needs_single_shot()  # pylint: disable=protected-access
  monkeypatch.delenv("XLA_FLAGS")
  assert ht._ragged_needs_single_shot()  # pylint: disable=protected-access
