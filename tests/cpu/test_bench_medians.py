"""jax_ep.bench.medians: the median over runs of each row, and the refusals."""

import json

import pytest

from jax_ep.bench import medians


def _run(us_by_op, commit="abc1234", tokens=128, failed=(), unstable=()):
  rows = [dict(op=op, system="jax_ep", us=us, failed=op in failed,
               stable_slope=False if op in unstable else True) for op, us in us_by_op.items()]
  return dict(mode="ll", ragged=False, commit=dict(short=commit, dirty=False), date="2026-12-01",
              machine=dict(device_kind="H200", device_count=1),
              meta=dict(tokens_per_rank=tokens, hidden=7168), rows=rows)


def test_median_min_max_over_runs():
  runs = [_run({"a": 3.0, "b": 10.0}), _run({"a": 1.0, "b": 30.0}), _run({"a": 2.0, "b": 20.0})]
  summary = medians.summarize(runs, ["r1", "r2", "r3"])
  rows = {row["op"]: row for row in summary["rows"]}
  assert rows["a"]["median_us"] == 2.0 and rows["a"]["min_us"] == 1.0
  assert rows["a"]["max_us"] == 3.0 and rows["a"]["runs"] == 3
  assert rows["b"]["median_us"] == 20.0
  assert [row["op"] for row in summary["rows"]] == ["a", "b"]  # the runs' row order


def test_failed_rows_are_left_out_and_counted():
  runs = [_run({"a": 5.0}), _run({"a": 1.0}, failed=("a",)), _run({"a": 7.0})]
  row = medians.summarize(runs, ["r1", "r2", "r3"])["rows"][0]
  assert row["runs"] == 2 and row["failed_runs"] == 1 and row["median_us"] == 6.0


def test_unstable_slopes_stay_in_the_median_and_are_counted(capsys):
  runs = [_run({"a": 4.6}), _run({"a": 0.3}, unstable=("a",)), _run({"a": 4.8})]
  summary = medians.summarize(runs, ["r1", "r2", "r3"])
  row = summary["rows"][0]
  assert row["runs"] == 3 and row["unstable_runs"] == 1 and row["median_us"] == 4.6
  assert "1 with an unstable slope" in medians.format_summary(summary)


def test_times_below_noise_are_left_out_and_counted_apart_from_failures():
  """A row below noise (the flag, or a time that is not positive, as older files
  hold) is no time: left out of the median, counted as below noise, not as failed."""
  runs = [_run({"a": 4.6, "b": 2.0}), _run({"a": -0.3, "b": 1.0}, unstable=("a",)),
          _run({"a": 4.8, "b": 3.0}), _run({"a": 5.0, "b": 0.0}), _run({"a": 1.0}, failed=("a",))]
  runs[2]["rows"][0].update(us=None, below_noise=True)
  summary = medians.summarize(runs, [f"r{i}" for i in range(5)])
  rows = {row["op"]: row for row in summary["rows"]}
  assert rows["a"]["us"] == [4.6, 5.0] and rows["a"]["median_us"] == 4.8
  assert (rows["a"]["below_noise_runs"], rows["a"]["failed_runs"]) == (2, 1)
  assert rows["a"]["unstable_runs"] == 0
  assert rows["b"]["us"] == [2.0, 1.0, 3.0] and rows["b"]["below_noise_runs"] == 1
  text = medians.format_summary(summary)
  assert "1 failed, 2 below noise" in text and "-0.3" not in text
  only_noise = medians.summarize([_run({"a": -1.0}), _run({"a": 0.0})], ["r1", "r2"])
  assert "below noise in every run" in medians.format_summary(only_noise)


@pytest.mark.parametrize("other", [dict(commit="def5678"), dict(tokens=256)])
def test_runs_of_different_commits_or_settings_are_refused(other):
  with pytest.raises(ValueError, match="one commit, mode and settings"):
    medians.summarize([_run({"a": 1.0}), _run({"a": 1.0}, **other)], ["r1", "r2"])


def test_main_writes_the_summary(tmp_path, capsys):
  paths = []
  for i, us in enumerate((4.0, 2.0, 3.0)):
    path = tmp_path / f"ll_{i}.json"
    path.write_text(json.dumps(_run({"LL dispatch, no rows": us})))
    paths.append(str(path))
  out = tmp_path / "summary.json"
  assert medians.main(paths + ["--out", str(out)]) == 0
  assert "3.0 us" in capsys.readouterr().out
  assert json.loads(out.read_text())["rows"][0]["median_us"] == 3.0
