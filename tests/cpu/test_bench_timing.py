"""The benchmark's timing harness (jax_ep/bench/timing.py): the slope arithmetic on
synthetic timings, its wiring to the executables, and the loop's consumption of
every output."""

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.bench import ragged, timing

# The slope is a difference of medians of float64 seconds, divided once: a few ulps.
REL = 8 * np.finfo(np.float64).eps


class FakeClock:
  """A clock that only moves when a fake execution of n calls runs."""

  def __init__(self, cost):
    self.now = 1000.0  # nonzero, as perf_counter is
    self.cost = cost   # (n, i-th execution of n) -> seconds
    self.executions: list[int] = []

  def __call__(self) -> float:
    return self.now

  def run(self, n: int) -> None:
    self.now += self.cost(n, self.executions.count(n))
    self.executions.append(n)


def test_slope_is_the_difference_of_medians_over_the_difference_of_calls():
  long_s = [0.0105, 0.0103, 0.5, 0.0104, 0.0102]   # one host hiccup
  short_s = [0.0025, 0.0026, 0.0024, 0.1, 0.0023]
  expected = (0.0104 - 0.0025) / (50 - 10) * 1e6   # medians, not means
  assert timing.slope_us(long_s, short_s, 50, 10) == pytest.approx(expected, rel=REL)
  mean_based = (statistics.mean(long_s) - statistics.mean(short_s)) / 40 * 1e6
  assert abs(mean_based - expected) > 1000  # the outliers would show with means


def test_slope_refuses_loops_of_equal_length_and_empty_samples():
  with pytest.raises(ValueError):
    timing.slope_us([1.0], [1.0], 10, 10)
  with pytest.raises(ValueError):
    timing.slope_us([], [1.0], 10, 2)


def test_short_loop_is_a_fifth_of_the_long_one():
  assert [timing.short_calls_of(n) for n in (2, 4, 5, 50, 51)] == [1, 1, 1, 10, 10]


def test_time_loops_recovers_the_per_call_cost_and_drops_the_fixed_cost():
  # T(n) = 3 ms fixed + 40 us per call; the 2nd long and the 3rd short execution
  # are 20 ms slower (a hiccup the medians must ignore).
  per_call, fixed = 40e-6, 3e-3

  def cost(n, i):
    hiccup = 20e-3 if (n == 50 and i == 1) or (n == 10 and i == 2) else 0.0
    return fixed + per_call * n + hiccup

  clock = FakeClock(cost)
  result = timing.time_loops(clock.run, num_calls=50, repeats=5, clock=clock)
  assert clock.executions == [50, 10] * 5  # alternately, long first
  assert result.median_us == pytest.approx(per_call * 1e6, rel=1e-9)
  assert (result.calls_per_loop, result.short_calls, result.repeats) == (50, 10, 5)
  # min/max: whole long executions over their calls (fixed cost included).
  assert result.min_us == pytest.approx((fixed + per_call * 50) / 50 * 1e6, rel=1e-9)
  assert result.max_us == pytest.approx((fixed + per_call * 50 + 20e-3) / 50 * 1e6, rel=1e-9)


def test_slope_noise_is_the_samples_spread_over_the_difference_of_calls():
  long_s = [1.0e-3, 1.2e-3, 1.1e-3, 1.4e-3, 1.3e-3]  # IQR (inclusive quartiles) 0.2 ms
  short_s = [0.5e-3, 0.5e-3, 0.6e-3, 0.5e-3, 0.6e-3]  # IQR 0.1 ms
  assert timing.slope_noise_us(long_s, short_s, 50, 10) == pytest.approx(300.0 / 40, rel=1e-9)
  assert np.isnan(timing.slope_noise_us([1.0], [0.5], 50, 10))  # one sample: no estimate


@pytest.mark.parametrize("slope, noise, stable", [
    (4.6, 1.0, True), (4.6, 5.0, False), (-0.3, 0.1, False), (0.0, 0.0, False),
    (4.6, float("nan"), None), (None, 1.0, None)])
def test_a_slope_is_stable_when_positive_and_above_its_noise(slope, noise, stable):
  assert timing.slope_is_stable(slope, noise) is stable


def test_time_loops_flags_a_slope_lost_in_the_host_noise():
  # 1 us per call against executions that jitter by 100-300 us: the slope may
  # come out anywhere, even negative; its noise says it is not measured.
  jitter = {50: [0.0, 300e-6, 100e-6, 250e-6, 0.0], 10: [200e-6, 0.0, 300e-6, 0.0, 150e-6]}

  def cost(n, i):
    return 3e-3 + 1e-6 * n + jitter[n][i]

  clock = FakeClock(cost)
  result = timing.time_loops(clock.run, num_calls=50, repeats=5, clock=clock)
  assert result.noise_us > abs(result.median_us) and result.stable is False
  quiet = timing.time_loops(FakeClock(lambda n, i: 3e-3 + 40e-6 * n).run, 50, 5,
                            clock=FakeClock(lambda n, i: 0.0))
  assert quiet.noise_us == 0.0


def test_time_per_call_times_the_long_and_the_short_executable_with_the_clock():
  """The real executables run; the injected clock decides the durations: the k-th
  long / short execution takes long_s[k] / short_s[k]."""
  long_s, short_s = [0.9, 0.5, 0.7], [0.2, 0.1, 0.4]
  durations = iter([d for pair in zip(long_s, short_s) for d in pair])
  state = {"now": 0.0, "started": False}

  def clock():
    if state["started"]:  # a stop: this execution's scripted duration
      state["now"] += next(durations)
    state["started"] = not state["started"]
    return state["now"]

  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  x = np.ones((jax.device_count(), 8), np.float32)
  result = timing.time_per_call(lambda a: a * 2, mesh, [x], num_calls=10, repeats=3,
                                clock=clock)
  expected = (statistics.median(long_s) - statistics.median(short_s)) / (10 - 2) * 1e6
  assert result.median_us == pytest.approx(expected, rel=REL)
  assert result.short_calls == 2


def test_warm_up_runs_the_long_loop_for_a_fixed_number_of_calls():
  """Before the timed executions: WARMUP_CALLS calls' worth of long-loop
  executions, a count (the same on every rank), not a time."""
  assert timing.warmup_executions(50) == timing.WARMUP_CALLS // 50
  assert timing.warmup_executions(3000, 5000) == 2   # rounded up
  assert timing.warmup_executions(10, 1) == 1        # at least one
  calls = []

  def op(x):
    jax.debug.callback(lambda: calls.append(1))
    return x * 2

  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  x = np.ones((jax.device_count(), 8), np.float32)
  timing.time_per_call(op, mesh, [x], num_calls=10, repeats=3, warmup_calls=45)
  jax.effects_barrier()
  # compile + 1 more execution of each length, 5 warm-up executions of the long
  # one, then 3 timed executions of each: 10- and 2-call loops.
  long_runs, short_runs = 2 + 5 + 3, 2 + 3
  assert len(calls) == (10 * long_runs + 2 * short_runs) * jax.device_count()


def test_loop_keeps_every_output_leaf():
  """XLA drops a barrier output that nothing reads, and the work behind it: the
  loop must read one element of every leaf, or the second leaf's matmul goes."""
  def op(x):
    return x + 1, jnp.sin(x) @ x

  hlo = jax.jit(timing.loop_of(op, 3)).lower(jnp.ones((64, 64))).compile().as_text()
  assert hlo.count(" dot(") == 3


def test_single_shot_runs_each_program_once():
  """time_single_shot: a 2-call warm-up, then num_calls and 1 call, each executed
  once (a second execution of one ragged_all_to_all program hung on the GPUs)."""
  calls = []

  def op(x):
    jax.debug.callback(lambda: calls.append(1))
    return x * 2 + 1

  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  result = timing.time_single_shot(op, mesh, [np.ones((4 * jax.device_count(), 128),
                                                      np.float32)], num_calls=5)
  jax.effects_barrier()
  assert len(calls) == (2 + 5 + 1) * jax.device_count()  # one callback per call and shard
  assert result.repeats == 1 and result.calls_per_loop == 5
  assert np.isfinite(result.median_us)


def test_ragged_baseline_is_single_shot_unless_the_decomposer_is_on(monkeypatch):
  """Without XLA's ragged_all_to_all decomposer the baseline runs single-shot (the
  NCCL send/recv fallback hung on a second execution); with it, the slope harness."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert ragged.needs_single_shot()
  monkeypatch.setenv("XLA_FLAGS", f"--foo=1 {ragged.DECOMPOSER_FLAG}")
  assert not ragged.needs_single_shot()
  monkeypatch.delenv("XLA_FLAGS")
  assert ragged.needs_single_shot()
