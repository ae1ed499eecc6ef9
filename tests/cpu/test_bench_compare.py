"""benchmarks/compare.py: two commits' medians side by side, the rows more than the
tolerance slower, and the runs it refuses to compare."""

import json

from benchmarks import compare


def _run(us_by_op, commit, tokens=128, failed=()):
  rows = [dict(op=op, system="jax_ep", us=us, failed=op in failed, stable_slope=True)
          for op, us in us_by_op.items()]
  return dict(mode="ht", ragged=False, commit=dict(short=commit, dirty=False), date="2026-12-07",
              machine=dict(device_kind="H200", device_count=1),
              meta=dict(tokens_per_rank=tokens, hidden=7168), rows=rows)


def _write(tmp_path, name, run):
  path = tmp_path / name
  path.write_text(json.dumps(run))
  return str(path)


def test_rows_within_and_over_the_tolerance(tmp_path, capsys):
  base = [_write(tmp_path, f"b{i}.json", _run({"dispatch": us, "combine": 50.0}, "aaaaaaa"))
          for i, us in enumerate((100.0, 101.0, 99.0))]
  head = [_write(tmp_path, f"h{i}.json", _run({"dispatch": us, "combine": 52.0}, "bbbbbbb"))
          for i, us in enumerate((102.0, 103.5, 101.0))]
  out = tmp_path / "cmp.json"
  # dispatch 102.0 / 100.0 = 1.02: within 3%; combine 52 / 50 = 1.04: SLOWER.
  assert compare.main(["--base", *base, "--head", *head, "--out", str(out)]) == 1
  rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
  assert rows["dispatch"]["ratio"] == 1.02 and not rows["dispatch"]["slower"]
  assert rows["combine"]["slower"]
  printed = capsys.readouterr().out
  assert "SLOWER" in printed and "base aaaaaaa (3 runs) vs head bbbbbbb (3 runs)" in printed
  assert compare.main(["--base", *base, "--head", *head, "--tolerance", "0.05"]) == 0


def test_a_row_without_a_time_in_the_head_fails(tmp_path):
  base = [_write(tmp_path, "b.json", _run({"dispatch": 100.0}, "aaaaaaa"))]
  head = [_write(tmp_path, "h.json", _run({"dispatch": 100.0}, "bbbbbbb", failed=("dispatch",)))]
  assert compare.main(["--base", *base, "--head", *head]) == 1


def test_different_settings_or_mixed_commits_are_refused(tmp_path, capsys):
  base = [_write(tmp_path, "b.json", _run({"dispatch": 100.0}, "aaaaaaa"))]
  other_size = [_write(tmp_path, "h.json", _run({"dispatch": 100.0}, "bbbbbbb", tokens=256))]
  assert compare.main(["--base", *base, "--head", *other_size]) == 2
  assert "tokens_per_rank" in capsys.readouterr().err
  mixed = base + [_write(tmp_path, "c.json", _run({"dispatch": 100.0}, "ccccccc"))]
  assert compare.main(["--base", *mixed, "--head", *base]) == 2
