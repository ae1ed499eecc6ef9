"""python -m jax_ep.launch -n 2 -m jax_ep.bench --mode ll|ht [--out_dir DIR | --out FILE].

``--mode gmm`` and ``--mode layer`` run in one process on one device (EP1):
the expert GEMMs' products on each grouped-GEMM implementation (gmm.py), and
a whole MoE layer against MaxText's algorithm and the dense floor (layer.py).

Prints the results table (a system that failed is a FAILED row with its
error; one whose time was not positive says "below noise": no time is printed
that is not one) and writes the JSON: run settings, rows, machine, commit, date,
versions and the command line (provenance.py). The exit status is 1 when any
system failed, 0 otherwise.

Charts, medians over runs, in-kernel profiles and timelines are not part of the
bench: the repository's benchmarks/ draws and summarizes from the JSON (the bench
prints the chart commands after writing it) and runs the bench with its probes
(benchmarks/README.md).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import TYPE_CHECKING, Callable, Sequence

from absl import app, flags

from jax_ep import launch

if TYPE_CHECKING:
  from jax_ep.bench import measure

flags.DEFINE_enum("mode", "ll", ["ll", "ht", "gmm", "layer", "network"],
                  "which kernels to benchmark: the exchange's (ll, ht), the expert GEMMs' "
                  "(gmm) or a whole MoE layer's (layer); gmm and layer: one device, EP1; "
                  "network: no device, the copies per token the HT exchange would send "
                  "across nodes against a flat exchange's (network.py)")
flags.DEFINE_integer("tokens", None, "tokens per rank (default: 128 for ll, DeepEP's LL "
                     "setting; 4096 for ht)")
flags.DEFINE_integer("hidden", 7168, "hidden size")
flags.DEFINE_integer("num_experts", 256, "experts (gmm and layer: default 32, a DeepSeek-V3 "
                     "rank's share)")
flags.DEFINE_integer("ffn", 2048, "gmm, layer: each expert's FFN width")
flags.DEFINE_bool("layer_lax_backward", False, "layer: also time the forward+backward of "
                  "MaxText's algorithm on jax.lax.ragged_dot (XLA's dense lowering of its "
                  "weight gradient: at DeepSeek shapes it runs out of memory or waits in "
                  "XLA's allocator for minutes)")
flags.DEFINE_bool("layer_lax_forward", True, "layer: time the forward of MaxText's algorithm "
                  "on jax.lax.ragged_dot (about 140 ms a call at the default shapes on an H100)")
flags.DEFINE_list("gmm_implementations", ["xla", "pallas", "worklist", "tokamax"],
                  "gmm: the implementations timed beside the floor (pallas and worklist on "
                  "sm_90 GPUs only; tokamax when it imports)")
flags.DEFINE_list("layer_gmm", ["auto"], "layer: the grouped_matmul implementations of "
                  "jax_ep.moe's rows (auto, pallas, worklist, tokamax, xla), each a layer row "
                  "and an experts-alone row")
flags.DEFINE_list("layer_num_sms", [], "layer: also time jax_ep.moe (auto) at these HT SM "
                  "budgets (EpGroup.num_sms; default: the group's default only)")
flags.DEFINE_list("nodes", ["2", "8"], "network: node counts of the EP groups")
flags.DEFINE_integer("ranks_per_node", 8, "network: GPUs per node (one NVLink domain)")
flags.DEFINE_bool("gmm_sweep", False, "gmm: also time the Pallas and work-list kernels at "
                  "other tiles")
flags.DEFINE_integer("topk", 8, "experts per token")
flags.DEFINE_integer("num_calls", 50, "calls per long timed executable (the short one: 1/5)")
flags.DEFINE_integer("repeats", 7, "timed executions of each loop length (medians)")
flags.DEFINE_integer("warmup_calls", 5000, "calls of warm-up executions of the long loop before "
                     "each system's timed ones (jax_ep/bench/timing.py)")
flags.DEFINE_integer("seed", 0, "routing/data seed")
flags.DEFINE_string("out_dir", None, "write the JSON here as <mode>_<date>_<commit>.json")
flags.DEFINE_string("out", None, "write the JSON to exactly this file")
flags.DEFINE_bool("sweep", False, "ht: also sweep tokens per rank 128..8192 (the JSON's "
                  "meta.sweep)")
flags.DEFINE_bool("ragged", False, "ht: time only the ragged_all_to_all (MaxText) baseline "
                  "and the bare all_to_all")
flags.DEFINE_bool("baselines", True, "also time the portable all_to_all paths "
                  "(--nobaselines: jax_ep and the bare all_to_all only, for quick A/B runs)")
flags.DEFINE_bool("layouts", False, "ht: also time the expert-major layout (BF16 and FP8 "
                  "dispatch, BF16 combine; A=1 and 128) against the token-major one and the "
                  "token-major one followed by a jnp sort, each expert-major row with its floor "
                  "(an XLA copy of its pair rows, the ratio in the row's note)")
flags.DEFINE_list("sm_sweep", [], "ht: also time jax_ep at these SM budgets (EpGroup.num_sms)")
FLAGS = flags.FLAGS

TIMING = ("in-graph slope: (median T(N) - median T(N/5)) / (N - N/5), T = wall time of one "
          "execution of an executable of N dependent unrolled calls, after warm-up executions "
          "of the long loop (meta.warmup_calls calls); max over ranks")

# MaxText-style ragged_all_to_all across processes (one GPU each) needs XLA's
# NCCL send/recv path, which XLA refuses unless asked; must be set before the
# GPU backend starts.
_RAGGED_FLAG = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"


def file_mode() -> str:
  """The <mode> part of the JSON's name: ll, ht, or ht-ragged."""
  return "ht-ragged" if FLAGS.mode == "ht" and FLAGS.ragged else FLAGS.mode


def chart_commands(path: str) -> list[str]:
  """The commands (from the repository's root) that draw the charts of the JSON at
  ``path`` of this run: the ops against their floors or the bare exchange (ll, ht),
  the token sweep and the SM sweep (ht --sweep, --sm_sweep), the layer's TFLOP/s."""
  # (benchmarks module, what the PNG's name adds to the JSON's)
  charts = {"ll": [("plot", "")], "ht": [("plot", "")],
            "layer": [("plot_layer", "")]}.get(FLAGS.mode, [])
  if FLAGS.mode == "ht" and FLAGS.sweep:
    charts.append(("plot_sweep", "_sweep"))
  if FLAGS.mode == "ht" and FLAGS.sm_sweep:
    charts.append(("plot_sm_sweep", "_sm_sweep"))
  stem = os.path.splitext(path)[0]
  return [f"python -m benchmarks.{chart} {shlex.quote(path)} --out "
          f"{shlex.quote(stem + suffix + '.png')}" for chart, suffix in charts]


def network_main(run_as: str) -> int:
  """--mode network: pure numpy, no device; the table and the JSON."""
  from jax_ep.bench import network, provenance, results  # pylint: disable=import-outside-toplevel
  record = provenance.record(sys.argv, module=run_as)
  rows, meta = network.run([int(n) for n in FLAGS.nodes], FLAGS.ranks_per_node,
                           FLAGS.tokens or 4096, FLAGS.hidden, FLAGS.num_experts, FLAGS.topk,
                           FLAGS.seed)
  print(network.format_rows(rows, FLAGS.hidden))
  path = FLAGS.out
  if path is None and FLAGS.out_dir:
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    path = provenance.free_path(FLAGS.out_dir, provenance.default_name(
        "network", record["date"], record["commit"]["short"], record["commit"]["dirty"]))
  if path:
    results.write_json(path, dict(mode="network", **record, any_failed=False, meta=meta,
                                  rows=rows))
    print(f"results: {path}")
  return 0


def single_device_main(run_as: str, probes: Sequence[measure.Probe] = ()) -> int:
  """--mode gmm / layer: one process, one device; the table as it runs, and the
  JSON rewritten after every row ("complete": false until the last), so a run
  stopped by a time limit keeps the rows it measured."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax_ep.bench import provenance, results  # pylint: disable=import-outside-toplevel
  record = provenance.record(sys.argv, module=run_as)
  experts = FLAGS.num_experts if FLAGS["num_experts"].present else 32
  tokens = FLAGS.tokens or (8192 if "H200" in jax.devices()[0].device_kind else 4096)
  path = FLAGS.out
  if path is None and FLAGS.out_dir:
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    path = provenance.free_path(FLAGS.out_dir, provenance.default_name(
        FLAGS.mode, record["date"], record["commit"]["short"], record["commit"]["dirty"]))

  shape = dict(tokens=tokens, hidden=FLAGS.hidden, ffn=FLAGS.ffn, experts=experts,
               topk=FLAGS.topk, seed=FLAGS.seed)

  def save(rows: list[dict], meta: dict | None) -> bool:
    # A row below the harness's noise has no time but did not fail (as in ll / ht).
    failed = any(r["error"] is not None and not r.get("expected_failure") for r in rows)
    if path:
      results.write_json(path, dict(mode=FLAGS.mode, **record, timing=TIMING_ONE_DEVICE,
                                    complete=meta is not None, any_failed=failed,
                                    meta=meta or shape, rows=rows))
    return failed

  def save_partial(rows: list[dict]) -> None:
    save(rows, None)

  if FLAGS.mode == "gmm":
    from jax_ep.bench import gmm  # pylint: disable=import-outside-toplevel
    rows, meta = gmm.run(tokens, FLAGS.hidden, FLAGS.ffn, experts, FLAGS.topk, FLAGS.seed,
                         FLAGS.gmm_sweep, FLAGS.repeats, on_row=save_partial,
                         implementations=FLAGS.gmm_implementations)
  else:
    from jax_ep.bench import layer  # pylint: disable=import-outside-toplevel
    rows, meta = layer.run(tokens, FLAGS.hidden, FLAGS.ffn, experts, FLAGS.topk, FLAGS.seed,
                           FLAGS.repeats, lax_backward=FLAGS.layer_lax_backward,
                           lax_forward=FLAGS.layer_lax_forward, on_row=save_partial,
                           gmm_implementations=FLAGS.layer_gmm, probes=probes,
                           num_sms=[int(n) for n in FLAGS.layer_num_sms])
  failed = save(rows, meta)
  if path:
    print(f"results: {path}")
    for command in chart_commands(path):
      print(f"chart: {command}")
  return 1 if failed else 0


TIMING_ONE_DEVICE = ("in-graph slope on one device (jax_ep/bench/single_device.py): "
                     "(median T(N) - median T(N/5)) / (N - N/5), N = num_calls of the gmm/layer "
                     "modes (5), medians of --repeats executions of each length")


def main(argv: Sequence[str], run_as: str = "jax_ep.bench",
         probes: Sequence[measure.Probe] = ()) -> int:
  """The bench (absl's main: ``argv`` are the arguments left after the flags).

  ``run_as``: the module ``python -m`` ran, for the JSON's command line.
  ``probes``: looks inside each timing of ll, ht and layer (measure.Probe; the
  repository's benchmarks/probe.py passes them), their results printed after the
  table and kept in the JSON's meta under their keys.
  """
  del argv
  if FLAGS.mode in ("gmm", "layer"):
    return single_device_main(run_as, probes)
  if FLAGS.mode == "network":
    return network_main(run_as)
  if FLAGS.mode == "ht" and _RAGGED_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _RAGGED_FLAG).strip()
  launch.initialize_distributed_from_env()
  import jax  # pylint: disable=import-outside-toplevel
  import jax_ep  # pylint: disable=import-outside-toplevel
  from jax_ep.bench import provenance, results  # pylint: disable=import-outside-toplevel

  record = provenance.record(sys.argv, module=run_as)
  if FLAGS.mode == "ll":
    from jax_ep.bench import ll  # pylint: disable=import-outside-toplevel
    rows, meta = ll.run(FLAGS.tokens or 128, FLAGS.hidden, FLAGS.num_experts, FLAGS.topk,
                        FLAGS.num_calls, FLAGS.repeats, FLAGS.seed, baselines=FLAGS.baselines,
                        warmup_calls=FLAGS.warmup_calls, probes=probes)
  else:
    from jax_ep.bench import ht  # pylint: disable=import-outside-toplevel
    rows, meta = ht.run(FLAGS.tokens or 4096, FLAGS.hidden, FLAGS.num_experts, FLAGS.topk,
                        FLAGS.num_calls, FLAGS.repeats, FLAGS.seed, sweep=FLAGS.sweep,
                        ragged_only=FLAGS.ragged,
                        sm_sweep=tuple(int(n) for n in FLAGS.sm_sweep),
                        baselines=FLAGS.baselines, layouts=FLAGS.layouts,
                        warmup_calls=FLAGS.warmup_calls, probes=probes)
  failed = results.any_failed(rows) or any(
      point.get("errors") for key in ("sweep", "sm_sweep") for point in meta.get(key, []))
  payload = dict(mode=FLAGS.mode, ragged=FLAGS.ragged, **record, timing=TIMING,
                 any_failed=failed, meta=meta, rows=rows)
  if jax.process_index() == 0:
    path = FLAGS.out
    if path is None and FLAGS.out_dir:
      os.makedirs(FLAGS.out_dir, exist_ok=True)
      path = provenance.free_path(FLAGS.out_dir, provenance.default_name(
          file_mode(), record["date"], record["commit"]["short"], record["commit"]["dirty"]))
    if path:  # first: a failure while printing must not lose the numbers
      results.write_json(path, payload)
    long_entries = {"sweep", "sm_sweep", "routing"} | {probe.key for probe in probes}
    brief = {k: v for k, v in meta.items() if k not in long_entries}
    machine = record["machine"]
    print("\n" + results.format_table(
        rows, f"jax_ep bench --mode {FLAGS.mode} on {machine['device_count']}x "
              f"{machine['device_kind']} ({record['date']}, commit {record['commit']['short']}"
              f"{' dirty' if record['commit']['dirty'] else ''}): {brief}"))
    for probe in probes:
      for label, result in meta.get(probe.key, {}).items():
        print(f"{probe.title} (rank 0): {label}: {probe.format(result)}")
    for point in meta.get("sm_sweep", []):
      print(f"SM budget {point['num_sms']}: " + ", ".join(
          f"{k}: {v:.1f} us" if v is not None else
          f"{k}: FAILED" if k in point["errors"] else f"{k}: below noise"
          for k, v in point["us"].items()))
    if path:
      print(f"results: {path}")
      for command in chart_commands(path):
        print(f"chart: {command}")
    if failed:
      print("bench: at least one system FAILED (see the table / the JSON's rows)")
  jax_ep.finalize()
  sys.stdout.flush()
  return 1 if failed else 0


HELP_ARGS = ("-h", "--help", "-?", "--helpshort")


def cli(main_fn: Callable[[list[str]], int], doc: str) -> None:
  """Runs ``main_fn`` under absl. Asked for help (HELP_ARGS): prints ``doc`` and the
  bench's flags and exits 0 (absl's own --help exits with status 1; asking for
  help is not a failure)."""
  if any(arg in HELP_ARGS for arg in sys.argv[1:]):
    FLAGS(sys.argv[:1])
    # absl files flags under the module that defined them: this file's path when it
    # runs as __main__, else its module name (benchmarks/probe.py imports it).
    print(doc.strip() + "\n\nflags:\n" +
          FLAGS.module_help(sys.argv[0] if __name__ == "__main__" else __name__))
    sys.exit(0)
  app.run(main_fn)


if __name__ == "__main__":
  cli(main, __doc__ or "")
