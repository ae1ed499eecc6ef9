"""A failing system is a FAILED row with its error; ratios; the JSON's provenance
(jax_ep/bench/measure.py, results.py, provenance.py, ht.op_rows)."""

import datetime
import json
import os
import re

import numpy as np
import pytest

from jax_ep.bench import ht, measure, provenance, results, traffic
from jax_ep.bench.timing import Timing


def _timing(us: float) -> Timing:
  return Timing(us, us, us, 50, 10, 7)


def _ranks(*values):
  """A gather that stacks this rank's value with the given other ranks' (rank 0 = here)."""
  def gather(local: np.ndarray) -> np.ndarray:
    others = [v(local) for v in values]
    return np.stack([local] + others)
  return gather


def _same(local):
  return local


def _raise():
  raise ValueError("boom: cannot compile here")


def test_a_raising_system_is_an_outcome_with_its_error():
  outcome = measure.run_system(_raise, gather=_ranks(_same))
  assert outcome.us is None
  assert outcome.error == "rank 0: ValueError: boom: cannot compile here"


def test_a_failure_on_another_rank_fails_the_system_everywhere():
  def other_failed(local):
    if local.dtype == np.uint8:
      return measure.encode_error("RuntimeError: peer timeout")
    return np.asarray([np.nan, np.nan])  # (time, noise) of a failed rank

  outcome = measure.run_system(lambda: _timing(5.0), gather=_ranks(other_failed))
  assert outcome.us is None and outcome.error == "rank 1: RuntimeError: peer timeout"
  assert outcome.timing.median_us == 5.0  # this rank's own time is kept


def test_the_time_is_the_slowest_rank():
  # Another rank: slower, and noisier; the gather carries (time, noise) per rank.
  slower = lambda local: np.asarray([7.5, 0.8]) if local.dtype != np.uint8 else local  # noqa: E731
  outcome = measure.run_system(lambda: _noisy_timing(5.0, 0.2), gather=_ranks(slower))
  assert (outcome.us, outcome.error) == (7.5, None)
  assert outcome.noise_us == 0.8 and outcome.stable  # the largest noise over ranks


def _noisy_timing(us: float, noise_us: float) -> Timing:
  return Timing(us, us, us, 50, 10, 7, noise_us)


def test_a_slope_inside_its_noise_is_kept_and_flagged(tmp_path):
  outcome = measure.run_system(lambda: _noisy_timing(1.5, 2.0), gather=_ranks(_same))
  assert outcome.us == 1.5 and outcome.error is None and outcome.stable is False
  assert not outcome.below_noise
  rows = [results.row_of("LL dispatch, no rows", "jax_ep", outcome),
          results.row_of("LL combine, no rows", "jax_ep",
                         measure.run_system(lambda: _noisy_timing(4.4, 0.5),
                                            gather=_ranks(_same))),
          results.row_of("no estimate", "jax_ep", measure.Outcome(us=3.0, error=None))]
  lines = results.format_table(rows, "title").splitlines()
  assert "unstable slope (noise 2.0 us)" in lines[2] and "unstable" not in lines[3]
  assert "unstable" not in lines[4]
  path = tmp_path / "out.json"
  results.write_json(str(path), dict(rows=rows))
  written = json.loads(path.read_text())["rows"]
  assert [r["stable_slope"] for r in written] == [False, True, None]
  assert [r["noise_us"] for r in written] == [2.0, 0.5, None]


@pytest.mark.parametrize("slope", [-0.3, 0.0])
def test_a_slope_that_is_not_positive_is_below_noise_never_a_number(tmp_path, capsys, slope):
  """A negative (or zero) slope is no time: the outcome, the log line, the table and
  the JSON say "below noise", with no number in the time's place, and the rows
  compared with it get no ratio."""
  outcome = measure.run_system(lambda: _noisy_timing(slope, 2.0), gather=_ranks(_same))
  assert outcome.us is None and outcome.error is None and outcome.below_noise
  assert outcome.noise_us == 2.0
  assert measure.describe(outcome) == "below noise (noise 2.0 us per call)"
  ok = measure.Outcome(us=20.0, error=None)
  rows = [results.row_of("bare all_to_all BF16", "bare", outcome, bare=outcome),
          results.row_of("LL combine BF16", "jax_ep", ok, bare=outcome),
          results.Row("made directly", "jax_ep", slope)]  # the rule holds for any Row
  assert rows[2].us is None and rows[2].below_noise and not rows[2].failed
  lines = results.format_table(rows, "title").splitlines()
  for line in (lines[2], lines[4]):
    assert "below noise" in line and "FAILED" not in line, line
    assert not re.search(r"-\d|\b0\.0\b", line), line  # no negative or zero time
  assert "below noise (noise 2.0 us)" in lines[2]
  assert not results.any_failed(rows)
  path = tmp_path / "out.json"
  results.write_json(str(path), dict(rows=rows))
  written = json.loads(path.read_text())["rows"]
  assert [r["us"] for r in written] == [None, 20.0, None]
  assert [r["below_noise"] for r in written] == [True, False, True]
  assert [r["failed"] for r in written] == [False, False, False]
  assert written[1]["bare_us"] is None and written[1]["vs_bare"] is None
  failed = measure.describe(measure.Outcome(us=None, error="rank 1: boom\nmore"))
  assert failed == "FAILED: rank 1: boom"


def test_a_non_finite_time_is_a_failure():
  outcome = measure.run_system(lambda: _timing(float("nan")), gather=_ranks(_same))
  assert outcome.us is None and "non-finite" in outcome.error


def test_run_system_gathers_across_processes_in_one_process():
  """The real gather (one process here): the same outcome as the fake one."""
  outcome = measure.run_system(_raise)
  assert outcome.error == "rank 0: ValueError: boom: cannot compile here"
  assert measure.run_system(lambda: _timing(3.25)).us == 3.25


def test_failed_rows_show_in_the_table_and_the_json(tmp_path):
  ok = measure.Outcome(us=200.0, error=None)
  bad = measure.Outcome(us=None, error="rank 1: JaxRuntimeError: UNIMPLEMENTED: ragged\nmore")
  moved = traffic.Traffic(deepep_bytes=4e6, link_bytes=2e6)
  rows = [results.row_of("HT dispatch BF16", "jax_ep", ok, moved, bare=ok),
          results.row_of("HT dispatch BF16", "ragged_all_to_all", bad, moved, bare=ok)]
  table = results.format_table(rows, "title")
  failed_line = [line for line in table.splitlines() if "ragged_all_to_all" in line][0]
  assert "FAILED" in failed_line and "UNIMPLEMENTED: ragged" in failed_line
  assert "more" not in failed_line  # first line of the error only
  assert results.any_failed(rows) and not results.any_failed(rows[:1])
  path = tmp_path / "out.json"
  results.write_json(str(path), dict(rows=rows))
  written = json.loads(path.read_text())["rows"]
  assert written[1]["failed"] and written[1]["us"] is None
  assert written[1]["error"] == bad.error
  assert written[0]["gbps"] == 20.0 and written[0]["link_gbps"] == 10.0  # 4 MB / 200 us
  assert written[0]["vs_bare"] == 1.0 and written[1]["vs_bare"] is None


def test_fp8_rows_compare_with_fp8_baselines():
  """jax_ep's FP8 dispatch is compared with the portable FP8 path and the bare FP8
  exchange, never with the BF16 ones."""
  o = lambda us: measure.Outcome(us=us, error=None)  # noqa: E731
  ops = {"jax_ep": {"dispatch BF16": o(240.0), "dispatch FP8": o(150.0),
                    "combine BF16": o(280.0)},
         "portable": {"dispatch BF16": o(790.0), "dispatch FP8": o(600.0),
                      "combine BF16": o(750.0)}}
  bare_of = {"BF16": o(227.0), "FP8": o(120.0)}
  counts = traffic.routing_counts(np.array([[[0, 2]], [[1, 3]]], np.int32), 4)
  rows = ht.op_rows(ops, counts, 256, dict(jax_ep="jax_ep", portable="portable"), bare_of)
  by = {(r.op, r.system): r for r in rows}
  fp8 = by["HT dispatch FP8", "jax_ep"]
  assert (fp8.portable_us, fp8.bare_us) == (600.0, 120.0)
  assert fp8.speedup_vs_portable == 4.0 and fp8.vs_bare == 1.25
  assert by["HT dispatch FP8", "portable"].bare_us == 120.0
  assert by["HT combine BF16", "jax_ep"].bare_us == 227.0
  assert by["HT dispatch BF16", "portable"].traffic.link_bytes is None  # its own padded bytes
  assert by["HT dispatch BF16", "jax_ep"].traffic.link_bytes == 512.0  # 1 row each way


def test_default_name_and_numbering(tmp_path):
  name = provenance.default_name("ht", "2026-12-01T18:03:04", "18c85d7", dirty=False)
  assert name == "ht_2026-12-01_18c85d7.json"
  assert provenance.default_name("ll", "2026-12-01T00:00:00", "abcdef0", True) == (
      "ll_2026-12-01_abcdef0-dirty.json")
  first = provenance.free_path(str(tmp_path), name)
  assert first == os.path.join(tmp_path, name)
  open(first, "w").close()
  assert provenance.free_path(str(tmp_path), name) == os.path.join(
      tmp_path, "ht_2026-12-01_18c85d7_2.json")


def test_command_line_in_the_launcher_form(monkeypatch):
  argv = ["/x/jax_ep/bench/__main__.py", "--mode", "ht", "--out", "a b.json"]
  monkeypatch.delenv("JAX_EP_LAUNCHED", raising=False)
  assert provenance.command_line(argv) == "python -m jax_ep.bench --mode ht --out 'a b.json'"
  monkeypatch.setenv("JAX_EP_LAUNCHED", "1")
  monkeypatch.setenv("JAX_EP_NUM_PROCESSES", "2")
  assert provenance.command_line(argv) == (
      "python -m jax_ep.launch -n 2 -m jax_ep.bench --mode ht --out 'a b.json'")
  # The bench run with its probes (benchmarks/probe.py) names that module.
  assert provenance.command_line(argv, "benchmarks.probe") == (
      "python -m jax_ep.launch -n 2 -m benchmarks.probe --mode ht --out 'a b.json'")


def test_record_holds_machine_commit_date_versions_and_command(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  # Knobs that change what is measured (the prepare-stage fault check's cost,
  # the timeline's extra execution) are recorded with the run.
  monkeypatch.setenv("JAX_EP_PREPARE_STATUS_CHECK", "0")
  monkeypatch.setenv("JAX_EP_TIMELINE", "1")
  record = provenance.record(["bench", "--mode", "ll"], now=datetime.datetime(2026, 12, 1, 9))
  assert record["environment"]["JAX_EP_PREPARE_STATUS_CHECK"] == "0"
  assert record["environment"]["JAX_EP_TIMELINE"] == "1"
  assert record["date"] == "2026-12-01T09:00:00"
  assert record["machine"]["device_kind"] and record["machine"]["device_count"] >= 1
  assert record["machine"]["hostname"]
  assert record["versions"]["jax"] and record["versions"]["jaxlib"]
  assert record["command"] == "python -m jax_ep.bench --mode ll"
  assert record["environment"]["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  commit = record["commit"]
  if commit["source"] == "git":
    assert len(commit["commit"]) == 40 and commit["short"] == commit["commit"][:7]
    assert isinstance(commit["dirty"], bool)


def test_commit_without_git_uses_the_named_commit(monkeypatch):
  monkeypatch.setattr(provenance, "REPO_ROOT", "/nonexistent-jax-ep-tree")
  monkeypatch.setenv(provenance.COMMIT_ENV, "0123456789abcdef")
  assert provenance.commit() == dict(commit="0123456789abcdef", short="0123456", dirty=None,
                                     source=f"${provenance.COMMIT_ENV}")
  monkeypatch.delenv(provenance.COMMIT_ENV)
  assert provenance.commit()["short"] == "unknown"


def test_the_named_commit_wins_over_a_git_checkout(monkeypatch):
  """A copy whose .git is not the tree's names the commit by the variable."""
  monkeypatch.setenv(provenance.COMMIT_ENV, "0123456789abcdef")
  record = provenance.commit()
  assert record["commit"] == "0123456789abcdef" and record["dirty"] is None
  assert record["source"].startswith(f"${provenance.COMMIT_ENV}")


@pytest.mark.parametrize("us,bare_us,expected", [(300.0, 200.0, 1.5), (300.0, None, None),
                                                 (300.0, -5.0, None), (None, 200.0, None)])
def test_ratio_to_the_bare_exchange(us, bare_us, expected):
  row = results.Row("op", "s", us, bare_us=bare_us)
  assert row.vs_bare == expected
