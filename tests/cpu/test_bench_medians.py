"""benchmarks/medians.py: the median over runs of each row, and the refusals."""

import glob
import json
import os

import pytest

from benchmarks import medians


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


RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "docs", "results")


def test_rows_of_files_before_the_op_key_are_read_by_their_name():
  """The 2026-11-30 JSONs name a row's op ``name``; both forms give one median."""
  runs = [_run({"a": 3.0}), _run({"a": 1.0}), _run({"a": 2.0})]
  for row in runs[1]["rows"]:
    row["name"] = row.pop("op")
  row = medians.summarize(runs, ["r1", "r2", "r3"])["rows"][0]
  assert (row["op"], row["runs"], row["median_us"]) == ("a", 3, 2.0)
  del runs[2]["rows"][0]["op"]
  with pytest.raises(ValueError, match="r3: a row without an op or name"):
    medians.summarize(runs, ["r1", "r2", "r3"])


def test_the_published_runs_of_2026_11_30_have_medians():
  """The five LL runs at 7c8c933 (docs/benchmarks.md, "Low latency: 128 tokens per
  rank"): each run's FP8 dispatch is one of the six published times, and their
  median is the middle one of the five."""
  paths = sorted(glob.glob(os.path.join(RESULTS, "ll_2026-11-30_7c8c933*.json")))
  assert len(paths) == 5
  rows = {(row["op"], row["system"]): row for row in medians.load(paths)["rows"]}
  fp8 = rows[("LL dispatch FP8", "jax_ep (cuda backend)")]
  published = (24.1, 26.0, 27.3, 27.6, 30.3, 31.2)  # the six runs, sorted (one at 4884eb5)
  assert all(round(us, 1) in published for us in fp8["us"]) and fp8["runs"] == 5
  assert fp8["median_us"] == sorted(fp8["us"])[2]


def _sweep_point(num_sms, us_by_key, failed=(), below_noise=()):
  """One meta.sm_sweep point as ht._point writes it."""
  us = {key: None if key in failed or key in below_noise else t for key, t in us_by_key.items()}
  return dict(tokens=4096, num_sms=num_sms, us=us, gbps={key: None for key in us},
              errors={key: "RuntimeError: boom" for key in failed},
              below_noise=[key for key in below_noise])


def _swept(points):
  run = _run({"HT dispatch BF16": 80.0})
  run["mode"] = "ht"
  run["meta"]["sm_sweep"] = points
  return run


BF16, FP8, COMBINE = "dispatch BF16 jax_ep", "dispatch FP8 jax_ep", "combine BF16 jax_ep"


def test_sm_sweep_medians_leave_out_and_count_failed_and_below_noise_points():
  runs = [_swept([_sweep_point(6, {BF16: 130.0, FP8: 90.0}), _sweep_point(8, {BF16: 100.0})]),
          _swept([_sweep_point(6, {BF16: 120.0, FP8: 88.0}, failed=(FP8,)),
                  _sweep_point(8, {BF16: 96.0})]),
          _swept([_sweep_point(6, {BF16: 125.0, FP8: 86.0}),
                  _sweep_point(8, {BF16: 98.0}, below_noise=(BF16,))])]
  runs[2]["meta"]["sm_sweep"][0]["us"][BF16] = -1.0  # a time that is not positive: noise
  summary = medians.summarize(runs, ["r1", "r2", "r3"])
  assert [p["num_sms"] for p in summary["sm_sweep"]] == [6, 8]
  six = {op["key"]: op for op in summary["sm_sweep"][0]["ops"]}
  assert list(six) == [BF16, FP8]  # the runs' key order
  assert six[BF16]["us"] == [130.0, 120.0] and six[BF16]["median_us"] == 125.0
  assert (six[BF16]["failed_runs"], six[BF16]["below_noise_runs"]) == (0, 1)
  assert six[FP8]["us"] == [90.0, 86.0] and six[FP8]["runs"] == 2
  assert (six[FP8]["min_us"], six[FP8]["median_us"], six[FP8]["max_us"]) == (86.0, 88.0, 90.0)
  assert (six[FP8]["failed_runs"], six[FP8]["below_noise_runs"]) == (1, 0)
  eight = summary["sm_sweep"][1]["ops"][0]
  assert eight["key"] == BF16 and eight["us"] == [100.0, 96.0] and eight["median_us"] == 98.0
  assert eight["below_noise_runs"] == 1 and eight["failed_runs"] == 0
  lines = medians.format_summary(summary).splitlines()
  sweep_lines = [line for line in lines if "SM budget" in line]
  assert len(sweep_lines) == 3 and lines[-3:] == sweep_lines  # after the rows
  assert "SM budget 6" in sweep_lines[0] and BF16 in sweep_lines[0]
  assert "125.0 us" in sweep_lines[0] and "1 below noise" in sweep_lines[0]
  assert "88.0 us" in sweep_lines[1] and "1 failed" in sweep_lines[1]


def test_sm_sweep_points_in_every_run_without_a_time_say_why():
  runs = [_swept([_sweep_point(4, {BF16: 1.0, COMBINE: 2.0}, failed=(BF16,),
                               below_noise=(COMBINE,))]) for _ in range(2)]
  summary = medians.summarize(runs, ["r1", "r2"])
  ops = {op["key"]: op for op in summary["sm_sweep"][0]["ops"]}
  assert ops[BF16]["median_us"] is None and ops[BF16]["failed_runs"] == 2
  assert ops[COMBINE]["median_us"] is None and ops[COMBINE]["below_noise_runs"] == 2
  text = medians.format_summary(summary)
  assert "FAILED in every run" in text and "below noise in every run" in text


def test_sm_sweep_points_of_older_files_hold_their_times_beside_num_sms():
  old = dict(num_sms=8, **{BF16: 800.0, FP8: None})
  assert medians.point_times(old) == {BF16: (800.0, ""), FP8: (None, "failed")}
  assert medians.point_times(_sweep_point(8, {BF16: 5.0, FP8: 0.0, COMBINE: 3.0},
                                          failed=(COMBINE,))) == {
      BF16: (5.0, ""), FP8: (None, "below noise"), COMBINE: (None, "failed")}


def test_runs_without_an_sm_sweep_have_none_in_their_summary():
  summary = medians.summarize([_run({"a": 1.0}), _run({"a": 2.0})], ["r1", "r2"])
  assert "sm_sweep" not in summary and summary["hidden"] == 7168
  assert "SM budget" not in medians.format_summary(summary)


@pytest.mark.parametrize("budgets", [(6, 10), (6,), ()])
def test_runs_of_different_sm_budgets_are_refused(budgets):
  one = _swept([_sweep_point(n, {BF16: 100.0}) for n in (6, 8)])
  other = _swept([_sweep_point(n, {BF16: 100.0}) for n in budgets])
  with pytest.raises(ValueError, match="one list of num_sms"):
    medians.summarize([one, other], ["r1", "r2"])


def test_main_writes_the_sm_sweep_medians(tmp_path, capsys):
  paths = []
  for i, us in enumerate((124.0, 120.0, 122.0)):
    path = tmp_path / f"ht_{i}.json"
    path.write_text(json.dumps(_swept([_sweep_point(6, {BF16: us})])))
    paths.append(str(path))
  out = tmp_path / "summary.json"
  assert medians.main(paths + ["--out", str(out)]) == 0
  assert "SM budget 6" in capsys.readouterr().out
  sweep = json.loads(out.read_text())["sm_sweep"]
  assert sweep == [dict(num_sms=6, ops=[dict(key=BF16, runs=3, failed_runs=0, below_noise_runs=0,
                                             us=[124.0, 120.0, 122.0], median_us=122.0,
                                             min_us=120.0, max_us=124.0)])]
  bad = tmp_path / "ht_other.json"
  bad.write_text(json.dumps(_swept([_sweep_point(8, {BF16: 90.0})])))
  assert medians.main(paths + [str(bad)]) == 2
  assert "one list of num_sms" in capsys.readouterr().err
