"""python -m jax_ep.launch -n 2 -m jax_ep.bench --mode ll|ht [--out results.json]."""

from __future__ import annotations

import datetime
import os
import sys

from absl import app, flags

from jax_ep import launch

flags.DEFINE_enum("mode", "ll", ["ll", "ht"], "which kernels to benchmark")
flags.DEFINE_integer("tokens", None, "tokens per rank (default: 128 for ll, 4096 for ht)")
flags.DEFINE_integer("hidden", 7168, "hidden size")
flags.DEFINE_integer("num_experts", 256, "experts")
flags.DEFINE_integer("topk", 8, "experts per token")
flags.DEFINE_integer("num_calls", 50, "calls per timed executable")
flags.DEFINE_integer("repeats", 7, "timed executions (median reported)")
flags.DEFINE_integer("seed", 0, "routing/data seed")
flags.DEFINE_string("out", None, "write results as JSON here")
flags.DEFINE_bool("sweep", False, "ht: also sweep tokens per rank 128..8192 (JSON + PNG)")
flags.DEFINE_string("plot", None, "ht --sweep: write the plot PNG here")
flags.DEFINE_bool("ragged", False, "ht: time only the ragged_all_to_all (MaxText) baseline")
flags.DEFINE_bool("baselines", True, "ht: also time the all_to_all baselines (--nobaselines: "
                  "jax_ep only, for quick A/B runs of kernel variants)")
flags.DEFINE_list("sm_sweep", [], "ht: also time jax_ep at these SM budgets (EpConfig.num_sms)")
FLAGS = flags.FLAGS


# MaxText-style ragged_all_to_all across processes (one GPU each) needs XLA's
# NCCL send/recv path, which XLA refuses unless asked; must be set before the
# GPU backend starts.
_RAGGED_FLAG = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"


def main(argv):
  del argv
  if FLAGS.mode == "ht" and _RAGGED_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _RAGGED_FLAG).strip()
  launch.initialize_distributed_from_env()
  import jax  # pylint: disable=import-outside-toplevel
  import jax_ep  # pylint: disable=import-outside-toplevel
  from jax_ep.bench import common  # pylint: disable=import-outside-toplevel

  results = dict(mode=FLAGS.mode, device=common.device_description(),
                 date=datetime.datetime.now().isoformat(timespec="seconds"),
                 timing="in-graph: one executable of num_calls unrolled calls, median of "
                        "repeats, max over ranks")
  if FLAGS.mode == "ll":
    from jax_ep.bench import ll  # pylint: disable=import-outside-toplevel
    rows, meta = ll.run(FLAGS.tokens or 128, FLAGS.hidden, FLAGS.num_experts, FLAGS.topk,
                        FLAGS.num_calls, FLAGS.repeats, FLAGS.seed)
  else:
    from jax_ep.bench import ht  # pylint: disable=import-outside-toplevel
    rows, meta = ht.run(FLAGS.tokens or 4096, FLAGS.hidden, FLAGS.num_experts, FLAGS.topk,
                        FLAGS.num_calls, FLAGS.repeats, FLAGS.seed, sweep=FLAGS.sweep,
                        plot=FLAGS.plot, ragged=FLAGS.ragged,
                        sm_sweep=tuple(int(n) for n in FLAGS.sm_sweep),
                        baselines=FLAGS.baselines)
  results.update(meta=meta, rows=rows)
  if jax.process_index() == 0:
    if FLAGS.out:  # first: a failure while printing must not lose the numbers
      common.write_json(FLAGS.out, results)
    brief = {k: v for k, v in meta.items() if k not in ("sweep", "kernel_profile", "sm_sweep")}
    common.print_table(rows, f"jax_ep bench --mode {FLAGS.mode} on {results['device']} "
                             f"({results['date']}): {brief}")
    if meta.get("kernel_profile"):
      print("in-kernel profile (rank 0, us per call):")
      for label, kernels in meta["kernel_profile"].items():
        print(f"  {label}: " + "; ".join(
            f"{k} kernel {v['kernel_us']:.1f} wait {v['wait_us']:.1f}"
            + (f" gap {v['gap_after_send_us']:.1f}" if "gap_after_send_us" in v else "")
            for k, v in kernels.items() if k != "timeline_us"))
        if "timeline_us" in kernels:
          print("    timeline (medians): " + ", ".join(
              f"{k} {v:.1f}" for k, v in kernels["timeline_us"].items()))
    for point in meta.get("sm_sweep", []):
      print("SM budget " + ", ".join(f"{k}: {v:.1f} us" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in point.items()))
  jax_ep.finalize()
  sys.stdout.flush()


if __name__ == "__main__":
  app.run(main)
