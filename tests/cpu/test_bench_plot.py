"""benchmarks/plot.py: each op against its floor (EP1) or the bare exchange (EP > 1),
from a run's rows or the medians of saved runs."""

import glob
import json
import os
import subprocess
import sys

from benchmarks import plot
from jax_ep.bench import floors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LL_RUNS = sorted(glob.glob(os.path.join(ROOT, "docs", "results", "ll_2026-12-03_67a9c6d*.json")))
PNG = b"\x89PNG\r\n\x1a\n"


def test_plot_of_saved_runs_writes_a_png(tmp_path):
  """The five EP1 LL runs of one commit (docs/results): one PNG of their medians."""
  assert len(LL_RUNS) == 5, LL_RUNS
  out = tmp_path / "ll.png"
  result = subprocess.run([sys.executable, "-m", "benchmarks.plot", *LL_RUNS, "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "(5 runs)" in result.stdout
  data = out.read_bytes()
  assert data.startswith(PNG) and len(data) > 10_000


def test_runs_that_cannot_share_a_median_are_refused(tmp_path):
  other = json.loads(open(LL_RUNS[0]).read())
  other["meta"]["tokens_per_rank"] = 64
  path = tmp_path / "other.json"
  path.write_text(json.dumps(other))
  out = tmp_path / "mixed.png"
  result = subprocess.run([sys.executable, "-m", "benchmarks.plot", LL_RUNS[0], str(path),
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 2 and "tokens_per_rank" in result.stderr, result.stderr
  assert not out.exists()


def _rows():
  def row(op, system, us, **kw):
    return dict(op=op, system=system, us=us, failed=kw.get("failed", False),
                below_noise=kw.get("below_noise", False))
  return [row("LL dispatch FP8", "jax_ep", 7.0), row("LL combine BF16", "jax_ep", 9.0),
          row("LL combine BF16", "all_to_all (portable)", None, failed=True),
          row("LL dispatch, no rows", "jax_ep", None, below_noise=True),
          row("bare all_to_all FP8 [R,128,H]", plot.BARE_SYSTEM, 3.5),
          row("bare all_to_all BF16 [R,128,H]", plot.BARE_SYSTEM, 4.5),
          row("one tiny kernel", "XLA (HBM floor)", 2.0),
          row("LL dispatch: row gather", "XLA (HBM floor)", 12.0),
          row("LL combine: sum of pair rows", "XLA (HBM floor)", 4.0)]


def test_each_op_is_read_against_its_floor_at_ep1_and_the_bare_exchange_beyond():
  bars = plot.bars_of_rows(_rows())
  assert [b.missing for b in bars[:4]] == ["", "", "failed", "below noise"]
  assert plot.reference("LL dispatch FP8", bars, 1) == ("floor: LL dispatch: row gather", 12.0)
  assert plot.reference("LL combine BF16", bars, 1) == (
      "floor: LL combine: sum of pair rows", 4.0)
  assert plot.reference("LL dispatch, no rows", bars, 1) == ("floor: one tiny kernel", 2.0)
  assert plot.reference("LL dispatch FP8", bars, 8) == ("bare all_to_all FP8", 3.5)
  assert plot.reference("LL combine BF16", bars, 8) == ("bare all_to_all BF16", 4.5)
  assert plot.reference("LL dispatch, no rows", bars, 8) is None  # moves no rows
  assert [plot.is_reference(b) for b in bars] == [False] * 4 + [True] * 5


def test_each_expert_major_layout_row_is_read_against_its_own_pair_rows_copy():
  """The layout rows at EP1: an expert-major row (dispatch BF16 or FP8, combine) against
  the copy of its alignment's pair rows, the token-major ones against the copy of the
  token rows; at EP > 1 none has a bare exchange of its own."""
  def row(op, system, us):
    return dict(op=op, system=system, us=us, failed=False, below_noise=False)
  rows = [row("layout: HT dispatch BF16", "jax_ep token-major", 3.0),
          row("HT BF16: copy of the rows", floors.SYSTEM, 1.0)]
  for a, us in ((1, 5.0), (128, 9.0)):
    rows += [row(floors.expert_major_op(what, a), f"jax_ep expert-major A={a}", 2 * us)
             for what in ("dispatch BF16", "dispatch FP8", "combine BF16")]
    rows += [row(floors.pair_rows_floor(a), floors.SYSTEM, us),
             row(floors.pair_rows_floor(a, fp8=True), floors.SYSTEM, us / 2)]
  bars = plot.bars_of_rows(rows)
  assert plot.reference("layout: HT dispatch BF16", bars, 1) == (
      "floor: HT BF16: copy of the rows", 1.0)
  for a, us in ((1, 5.0), (128, 9.0)):
    for what in ("dispatch BF16", "combine BF16"):
      assert plot.reference(floors.expert_major_op(what, a), bars, 1) == (
          f"floor: layout: copy of the pair rows, A={a}", us)
    assert plot.reference(floors.expert_major_op("dispatch FP8", a), bars, 1) == (
        f"floor: layout: copy of the FP8 pairs, A={a}", us / 2)
    assert plot.reference(floors.expert_major_op("dispatch BF16", a), bars, 8) is None
  assert [plot.is_reference(b) for b in bars] == [
      b.system == floors.SYSTEM for b in bars]


def test_draw_takes_rows_without_times(tmp_path):
  """Failed and below-noise rows are drawn as words, at EP1 and at EP8."""
  bars = plot.bars_of_rows(_rows())
  for num_ranks in (1, 8):
    out = tmp_path / f"ep{num_ranks}.png"
    plot.draw(bars, num_ranks, "title", str(out))
    assert out.read_bytes().startswith(PNG)
