"""The bench runs end to end under the launcher on 2 CPU processes (portable backend)
at tiny sizes: tables, JSON with provenance, FAILED rows and the exit status.
CPU times are noise at these sizes; only the structure is checked."""

import glob
import json
import os
import subprocess
import sys

import pytest

import cpu_flags
from jax_ep import expert_major
from jax_ep.bench import floors, layouts, results

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--tokens", "16", "--hidden", "256", "--num_experts", "8", "--topk", "2",
        "--num_calls", "2", "--repeats", "1", "--warmup_calls", "2"]


def _bench(tmp_path, *flags):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = cpu_flags.FAST_COMPILE  # one CPU device per process, as on the GPU machine
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.launch", "-n", "2", "-m", "jax_ep.bench", *flags, *TINY,
       "--out_dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=300)
  files = glob.glob(str(tmp_path / "*.json"))
  assert len(files) == 1, result.stdout[-3000:] + result.stderr[-3000:]
  with open(files[0]) as f:
    return result, os.path.basename(files[0]), json.load(f)


def _check_provenance(name, data, mode):
  commit = data["commit"]
  dirty = "-dirty" if commit["dirty"] else ""
  assert name == f"{mode}_{data['date'][:10]}_{commit['short']}{dirty}.json"
  assert data["machine"]["device_count"] == 2 and data["machine"]["process_count"] == 2
  assert data["machine"]["device_kind"] and data["machine"]["hostname"]
  assert data["versions"]["jax"] and data["versions"]["jaxlib"]
  assert data["command"].startswith("python -m jax_ep.launch -n 2 -m jax_ep.bench --mode ")
  assert data["meta"]["warmup_calls"] == 2  # --warmup_calls reached the harness


@pytest.mark.parametrize("mode", ["ll", "ht"])
def test_bench_runs_and_compares_every_system_with_the_bare_exchange(tmp_path, mode):
  result, name, data = _bench(tmp_path, "--mode", mode)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  _check_provenance(name, data, mode)
  assert not data["any_failed"]
  rows = data["rows"]
  assert not any(r["failed"] for r in rows)
  bare = {r["op"].split()[2]: r for r in rows if r["op"].startswith("bare all_to_all")}
  assert set(bare) == {"BF16", "FP8"}
  moving = [r for r in rows if r["traffic"] is not None and r["system"] != "jax.lax.all_to_all"]
  assert {r["system"] for r in moving} == {"jax_ep (xla backend)", "all_to_all (portable)"}
  for r in moving:
    payload = "FP8" if "FP8" in r["op"] else "BF16"
    assert r["bare_us"] == bare[payload]["us"], r
  fp8 = [r for r in rows if r["system"].startswith("jax_ep") and "FP8" in r["op"]]
  portable_fp8 = [r for r in rows if r["system"] == "all_to_all (portable)" and "FP8" in r["op"]]
  assert len(fp8) == 1 and fp8[0]["portable_us"] == portable_fp8[0]["us"]
  floors = {r["op"] for r in rows if r["system"] == "XLA (HBM floor)"}
  assert floors == ({"one tiny kernel", "LL dispatch: row gather", "LL dispatch: copy of the rows",
                     "LL combine: sum of pair rows"} if mode == "ll" else
                    {"one tiny kernel", "HT BF16: copy of the rows",
                     "HT FP8: quantize of the rows"}), floors
  if mode == "ll":  # both combines: the weights at the combine and at the dispatch
    combines = {(r["op"], r["system"].split()[0]) for r in rows if "combine BF16" in r["op"]}
    assert combines == {("LL combine BF16", "jax_ep"), ("LL combine BF16", "all_to_all"),
                        ("LL combine BF16, pre-summed", "jax_ep")}, combines
  assert "[rank 0] op " in result.stdout  # the table


def test_a_system_that_cannot_run_is_a_failed_row_and_the_status_says_so(tmp_path):
  """XLA:CPU has no ragged_all_to_all: both ragged rows fail, with XLA's error, the
  bare rows still run, and the bench exits non-zero."""
  result, name, data = _bench(tmp_path, "--mode", "ht", "--ragged")
  assert result.returncode == 1, result.stdout[-3000:]
  _check_provenance(name, data, "ht-ragged")
  rows = {(r["op"], r["system"]): r for r in data["rows"]}
  for op in ("HT dispatch BF16", "HT combine BF16"):
    row = rows[op, "ragged_all_to_all"]
    assert row["failed"] and row["us"] is None and "ragged-all-to-all" in row["error"]
  assert not rows["bare all_to_all BF16 [R,16,H]", "jax.lax.all_to_all"]["failed"]
  assert data["any_failed"]
  failed_lines = [line for line in result.stdout.splitlines()
                  if line.startswith("[rank 0] HT ") and "FAILED" in line]
  assert len(failed_lines) == 2


def _check_layout_rows(data, num_ranks):
  """The --layouts rows of a run at TINY's sizes: every system's dispatch and
  combine, the expert-major FP8 dispatch, and each expert-major row paired with
  its floor (floors.FLOOR_OF: a copy of that alignment's M pair rows, in the same
  run), its note giving its time over the floor's; none failed."""
  rows = [r for r in data["rows"] if r["op"].startswith("layout: ")]
  assert rows and not any(r["failed"] for r in rows), rows
  by_op = {}
  for r in rows:
    by_op.setdefault(r["op"], []).append(r)
  for op in (layouts.DISPATCH_OP, layouts.COMBINE_OP):
    assert {r["system"] for r in by_op.pop(op)} == {"jax_ep token-major",
                                                    "jax_ep token-major + jnp sort"}
  experts_per_rank = 8 // num_ranks
  for a in (1, 128):
    m = expert_major.default_rows(num_ranks, 16, 2, experts_per_rank, a)
    floor_rows = {}
    for fp8 in (False, True):
      (floor,) = by_op.pop(floors.pair_rows_floor(a, fp8))
      assert floor["system"] == floors.SYSTEM
      assert f"the {m} {'e4m3' if fp8 else 'bf16'} pair rows of A={a}" in floor["note"], floor
      floor_rows[fp8] = floor
    for what in ("dispatch BF16", "dispatch FP8", "combine BF16"):
      op = floors.expert_major_op(what, a)
      (row,) = by_op.pop(op)
      assert row["system"] == f"jax_ep expert-major A={a}", row
      floor = floor_rows[what.endswith("FP8")]
      assert floors.FLOOR_OF[op] == floor["op"]
      if row["us"] is not None and floor["us"] is not None:
        assert (f"; {row['us'] / floor['us']:.2f}x its floor ({floor['op']}, "
                f"{floor['us']:.1f} us)") in row["note"], row
      else:
        assert f"no ratio to its floor ({floor['op']})" in row["note"], row
  assert not by_op, by_op  # nothing else
  assert data["meta"]["expert_alignments"] == [1, 128]


def test_bench_layout_rows(tmp_path):
  """--layouts: dispatch and combine for the expert-major layout (A=1 and 128, and its
  FP8 dispatch), the token-major one and the token-major one plus the user's jnp sort,
  each timed, none failed; each expert-major row with its floor."""
  result, _, data = _bench(tmp_path, "--mode", "ht", "--layouts", "--nobaselines")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  _check_layout_rows(data, num_ranks=2)


def test_ll_bench_without_baselines_times_only_jax_ep_and_the_floors(tmp_path):
  result, _, data = _bench(tmp_path, "--mode", "ll", "--nobaselines")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  systems = {r["system"] for r in data["rows"]}
  assert systems == {"jax_ep (xla backend)", "jax.lax.all_to_all", "XLA (HBM floor)"}, systems
  assert not any(r["failed"] for r in data["rows"])


def _times_are_positive_or_words(result, data):
  """The output's rule: every row has a positive time, or none (failed / below noise),
  in the JSON and in the table."""
  for r in data["rows"]:
    assert (r["us"] is not None and r["us"] > 0) or r["failed"] or r["below_noise"], r
    assert not (r["us"] is None and not r["failed"] and not r["below_noise"]), r
  table = result.stdout[result.stdout.index("us/call"):]
  time_at = results.OP_COLUMN + results.SYSTEM_COLUMN  # where the us/call cell starts
  for line in table.splitlines()[1:]:
    cells = line[time_at:time_at + 10].strip() if len(line) > time_at else ""
    assert not cells.startswith("-"), line


@pytest.mark.parametrize("mode", ["ll", "ht"])
def test_bench_in_one_process_on_8_cpu_devices(tmp_path, mode):
  """One process holding all 8 EP ranks (no launcher): every rank gets its own T
  tokens, the combines' inputs (one dispatch's process-wide result) go back to the
  ranks they came from, and no row fails (the combine rows used to fail: the
  dispatch's result was cut to the first rank's part). The bench prints the
  command that draws its JSON's chart of the ops against the bare exchange
  (benchmarks/plot.py), which then writes it. ht also runs --layouts: the layout
  rows and their floors on the 8 ranks' parts."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_flags.xla_flags("--xla_force_host_platform_device_count=8"))
  out, png = tmp_path / "bench.json", tmp_path / "bench.png"
  extra = ["--layouts"] if mode == "ht" else []
  result = subprocess.run([sys.executable, "-m", "jax_ep.bench", "--mode", mode, *extra, *TINY,
                           "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  chart = f"python -m benchmarks.plot {out} --out {png}"
  assert f"chart: {chart}" in result.stdout, result.stdout[-2000:]
  drawn = subprocess.run([sys.executable, *chart.split()[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
  assert drawn.returncode == 0, drawn.stdout + drawn.stderr
  assert png.read_bytes().startswith(b"\x89PNG")
  data = json.loads(out.read_text())
  # No probe ran: the plain bench keeps none of their entries.
  assert not {"kernel_profile", "timeline"} & set(data["meta"]), sorted(data["meta"])
  assert data["machine"]["device_count"] == 8 and data["machine"]["process_count"] == 1
  assert not data["any_failed"] and not [r for r in data["rows"] if r["failed"]]
  combines = [r for r in data["rows"] if "combine" in r["op"] and r["system"].startswith("jax_ep")]
  assert combines and all(r["us"] or r["below_noise"] for r in combines), combines
  # The traffic counts see 8 ranks of 16 tokens with 2 experts each.
  pairs = data["meta"]["routing"]["pairs"]
  assert len(pairs) == 8 and sum(map(sum, pairs)) == 8 * 16 * 2, pairs
  _times_are_positive_or_words(result, data)
  if mode == "ht":
    _check_layout_rows(data, num_ranks=8)


def test_bench_help_exits_zero():
  result = subprocess.run([sys.executable, "-m", "jax_ep.bench", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--mode" in result.stdout and "layer" in result.stdout


@pytest.mark.parametrize("mode", ["gmm", "layer"])
def test_single_device_modes_write_their_rows(tmp_path, mode):
  out = tmp_path / f"{mode}.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = cpu_flags.FAST_COMPILE  # one CPU device per process
  result = subprocess.run(
      [sys.executable, "-m", "jax_ep.bench", "--mode", mode, "--tokens", "32", "--hidden", "128",
       "--ffn", "64", "--num_experts", "4", "--topk", "2", "--repeats", "2", "--out", str(out)]
      + (["--layer_gmm", "auto,xla", "--layer_num_sms", "8"] if mode == "layer" else []),
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  payload = json.loads(out.read_text())
  systems = {row["system"] for row in payload["rows"]}
  if mode == "gmm":
    assert {"floor (dense matmul)", "xla"} <= systems
    assert {row["product"] for row in payload["rows"]} == {"forward", "input_grad",
                                                          "weight_grad"}
  else:
    # --layer_gmm auto,xla: jax_ep.moe and its experts alone on each; --layer_num_sms 8:
    # jax_ep.moe once more, on a runtime initialised again with that SM budget.
    assert len(systems) == 8 and {"jax_ep.moe experts alone (grouped_matmul)",
                                  "jax_ep.moe (HT expert-major, grouped_matmul xla)",
                                  "jax_ep.moe experts alone (grouped_matmul xla)",
                                  "jax_ep.moe (HT expert-major, grouped_matmul, 8 SMs)"
                                  } <= systems
    assert payload["meta"]["num_sms"] == [8]
    assert {r["mode"] for r in payload["rows"]} == {"forward", "forward_backward"}
  assert payload["complete"] is True
  # The one row a run leaves out unless asked (--layer_lax_backward) says so.
  skipped = [r for r in payload["rows"] if r["error"] is not None]
  if mode == "layer":
    assert [(r["mode"], r["system"]) for r in skipped] == [
        ("forward_backward", "MaxText algorithm, jax.lax.ragged_dot")], payload["rows"]
    assert skipped[0]["error"].startswith("not run") and skipped[0]["expected_failure"]
  else:
    assert skipped == [], payload["rows"]
  # The layer's chart is drawn from its JSON (benchmarks/plot_layer.py); gmm has none.
  charts = [line[len("chart: "):] for line in result.stdout.splitlines()
            if line.startswith("chart: ")]
  if mode == "gmm":
    assert charts == []
  else:
    png = tmp_path / "layer.png"
    assert charts == [f"python -m benchmarks.plot_layer {out} --out {png}"]
    drawn = subprocess.run([sys.executable, *charts[0].split()[1:]], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    assert png.read_bytes().startswith(b"\x89PNG")
