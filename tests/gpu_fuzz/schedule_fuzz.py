"""Schedule fuzzer: random programs of jax_ep ops, checked against the host oracle.

    python -m jax_ep.launch -n N --devices 0,0,... tests/gpu_fuzz/schedule_fuzz.py \
        --budget_s 120 --seed S        # N processes on one GPU (or -n N on N GPUs)
    ... schedule_fuzz.py --replay SEED  # exactly the program printed under SEED
    JAX_EP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu ... # CPU processes, portable backend

Each program is ONE jit(shard_map(...)) computation holding several steps
(dispatches, back-to-back combines, split ops, gradients, results left
unused; fuzz_steps_ll.py, fuzz_steps_ht.py) on routings drawn per rank
(fuzz_routings.py), so that XLA, not the program's text, chooses the order in
which the kernels of its ops run, the same order on every rank. Some orders
left a group out of step (issue 30: jax.grad of an LL dispatch -> combine with
every token on rank 0's experts ran three combines back to back and lapped a
peer). Every returned result is compared with the host oracle
(tests/host_reference.py) with the tolerances of tests/gpu; after every program
jax_ep.status() must be ok.

Rank 0 prints each program with its seed before it runs; a failing check is
printed by the rank that saw it, with the seed, counted, and the fuzzer goes
on while the group is in step (no process recorded a fault); after a fault
it stops. The budget (--budget_s) is rank 0's clock; every process learns its
decision through jax.distributed's key-value store (fuzz_agreement.py), never
through an XLA collective, which cannot run where processes share a GPU.
Each process prints one line last,
`schedule fuzz: N=<R> programs run <n>, failed <m> (...)`, and exits 1 if
any program failed (on any rank).

--perturb_outputs (a self-test of the checks) flips the lowest bit of every
output element before the checks: every returned step must then fail.
"""

from __future__ import annotations

import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
# This folder, tests/gpu's helpers and the host oracle (tests/host_reference.py).
sys.path[:0] = [_HERE, os.path.join(os.path.dirname(_HERE), "gpu"), os.path.dirname(_HERE)]

# As tests/gpu/conftest.py: the host oracle rounds where the program says, so
# XLA must not keep intermediates in float32 beyond that. Set before JAX's
# backends start.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_allow_excess_precision=false").strip()

from absl import app, flags  # noqa: E402

from jax_ep import launch  # noqa: E402

launch.initialize_distributed_from_env()  # before any JAX computation

import jax_ep  # noqa: E402
import fuzz_agreement  # noqa: E402
from fuzz_programs import make_program, program_seeds  # noqa: E402
from fuzz_run import run_program  # noqa: E402
from gpu_testing import ON_CPU, missing_gpus, num_ranks, rank, setup  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("seed", 0, "master seed: the sequence of program seeds")
flags.DEFINE_float("budget_s", 120.0, "start no program after this many seconds (rank 0's "
                   "clock); the first program always runs")
flags.DEFINE_integer("replay", None, "run exactly the program of this seed, alone")
flags.DEFINE_integer("block", 6, "programs of one config in a row (each change of config "
                     "re-initialises jax_ep: a collective allocation)")
flags.DEFINE_integer("max_programs", 0, "stop after this many programs (0: the budget alone)")
flags.DEFINE_bool("perturb_outputs", False, "testing: flip the lowest bit of every output "
                  "element before the checks (every returned step must fail)")


def _settings() -> str:
  return (f"seed={FLAGS.seed} budget_s={FLAGS.budget_s} replay={FLAGS.replay} "
          f"block={FLAGS.block} max_programs={FLAGS.max_programs} "
          f"perturb={FLAGS.perturb_outputs} N={num_ranks()}")


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not ON_CPU:
    reason = missing_gpus()
    if reason:
      raise SystemExit(f"schedule fuzz: cannot run the kernels here: {reason} (on CPU "
                       "processes set JAX_EP_GPU_TESTS_ON_CPU=1 JAX_PLATFORMS=cpu)")
  fuzz_agreement.agree_on_settings(_settings())
  ranks, me = num_ranks(), rank()
  replay = FLAGS.replay is not None
  seeds = iter([FLAGS.replay]) if replay else program_seeds(FLAGS.seed, FLAGS.block)
  start = time.monotonic()
  programs_run = failed = 0
  initialised, config, mesh, stopped = None, None, None, ""
  for index, seed in enumerate(seeds):
    program = make_program(seed, ranks)
    if me == 0:
      print(f"program {index} seed {seed}: {program.describe()}", flush=True)
    if program.config != initialised:
      config, mesh = setup(**program.config.setup_kwargs(ranks))
      initialised = program.config
    outcome = run_program(program, config, mesh, perturb=FLAGS.perturb_outputs)
    for line in outcome.failures:
      print(f"FAILED program {index} seed {seed}: {line}", flush=True)
    programs_run += 1
    go_on = (not replay and time.monotonic() - start < FLAGS.budget_s
             and not 0 < FLAGS.max_programs <= programs_run)
    verdict = fuzz_agreement.after_program(index, outcome.kind, go_on)
    failed += verdict.failed
    if not verdict.in_step:
      stopped = (f"; stopped after program {index} (seed {seed}): a fault left the group out "
                 f"of step (outcomes per rank: {', '.join(verdict.outcomes)})")
      break
    if not verdict.go_on:
      break
  elapsed = time.monotonic() - start
  what = f"replay of seed {FLAGS.replay}" if replay else (
      f"seed {FLAGS.seed}, {elapsed:.0f} s of a {FLAGS.budget_s:g} s budget")
  print(f"schedule fuzz: N={ranks} programs run {programs_run}, failed {failed} ({what})"
        f"{stopped}", flush=True)
  jax_ep.finalize()
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  app.run(main)
