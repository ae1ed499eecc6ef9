"""A small MoE transformer trained with jax_ep, checked against dense routing.

A decoder-only transformer (moe_transformer_model.py) whose FFNs are MoE
layers on jax_ep: the expert-major dispatch hands each rank its (token,
expert) pairs grouped by expert, the experts run as jax.lax.ragged_dot, the
combine sums the weighted pair rows back per token. Trained with optax's AdamW
(float32 parameters, bfloat16 compute) on a synthetic language, a fixed random
Markov chain made from the seed (markov_task.py).

The mesh is ("data", "expert"): the batch is split over both axes, the experts
over "expert" (EpGroup(axis_name="expert")); every coordinate of "data" is an
EP group of its own. --data 1 (the default) puts every device on the EP axis.

It prints the setup, then every --log_every steps the loss, tokens/s, the
pairs each expert received (summed over ranks) and the dropped pairs; with
--plot PATH it writes a PNG of the loss curve and the experts' load there (it
writes no file unless asked). Two checks end
it with OK (exit 0), or MISMATCH / NO LEARNING (exit 1):
  * dense: the first --check_steps steps, in float32, against the same model
    whose MoE FFNs run densely (every expert on every token, then the top-k mix
    of the experts the jax_ep run chose), both from the same parameters with
    the same optimizer: the first step's gradients, every step's loss and the
    last parameters must agree within float32 rounding bounds derived in
    moe_transformer_check.py, and the pairs per expert must equal the dense
    counts;
  * learning: the mean loss of the last 10% of the steps must be below the
    midpoint between the task's entropy rate and its unigram entropy
    (moe_transformer_check.learning_threshold).

Where it runs:
  no GPU     8 CPU devices (examples/_devices.py), portable backend, --preset small
  one GPU    one process, a 1-device mesh (EP1) on the CUDA backend, --preset gpu
  N GPUs     python -m jax_ep.launch -n N examples/moe_transformer.py (one process per GPU)
The data-parallel gradients and the loss are XLA collectives (psum), so
several processes sharing one GPU (jax_ep.launch --devices 0,0) cannot run it.
On GPUs it also fails (FAILED) unless the compiled bfloat16 step contains
jax_ep's HT kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import _devices

if __name__ == "__main__":
  _devices.set_up()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import moe  # noqa: E402
from jax_ep import expert_major  # noqa: E402
from jax_ep import launch  # noqa: E402
from _kernels import jax_ep_custom_calls, missing_kernels  # noqa: E402
import markov_task  # noqa: E402
import moe_transformer_check as check  # noqa: E402
import moe_transformer_model as model  # noqa: E402
from moe_transformer_step import (BATCH_AXES, make_optimizer, make_train_step, place,  # noqa: E402
                                  to_host)


# Sizes by preset; every one can be overridden by its flag.
PRESETS = {
    # tests/cpu/test_moe_transformer.py: about 10 s on 2 CPU cores.
    "tiny": dict(vocab=32, successors=2, seq_len=16, hidden=32, heads=2, layers=1,
                 experts_per_rank=1, topk=2, ffn=64, shared_ffn=32, batch_per_rank=2, steps=60,
                 learning_rate=1e-2, warmup=5, log_every=10, check_steps=3),
    # The default without a GPU (8 CPU devices): about a minute on 2 CPU cores.
    "small": dict(vocab=64, successors=4, seq_len=64, hidden=64, heads=4, layers=2,
                  experts_per_rank=2, topk=2, ffn=128, shared_ffn=64, batch_per_rank=2,
                  steps=300, learning_rate=3e-3, warmup=20, log_every=20, check_steps=5),
    # The default on GPUs.
    "gpu": dict(vocab=128, successors=4, seq_len=128, hidden=256, heads=8, layers=4,
                experts_per_rank=8, topk=2, ffn=512, shared_ffn=512, batch_per_rank=16,
                steps=300, learning_rate=3e-3, warmup=20, log_every=20, check_steps=5),
}


@dataclasses.dataclass(frozen=True)
class Args:
  """The command line, presets resolved."""

  preset: str
  vocab: int
  successors: int
  seq_len: int
  hidden: int
  heads: int
  layers: int
  experts_per_rank: int
  topk: int
  ffn: int
  shared_ffn: int
  batch_per_rank: int
  steps: int
  learning_rate: float
  warmup: int
  log_every: int
  check_steps: int
  data: int
  expert_alignment: int
  grouped_matmul: str
  capacity_factor: float
  weight_decay: float
  aux_loss_weight: float
  dtype: str
  seed: int
  plot: str | None


def parse_args(argv: list[str], platform: str) -> Args:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                      help="sizes; auto: gpu on GPUs, else small")
  for name, value in PRESETS["small"].items():
    parser.add_argument(f"--{name}", type=type(value), default=None,
                        help=f"default from --preset (small: {value})")
  parser.add_argument("--data", type=int, default=1,
                      help="size of the mesh's data axis; the expert axis gets the rest")
  parser.add_argument("--expert_alignment", type=int, default=8,
                      help="rows of each expert's group are a multiple of this")
  parser.add_argument("--capacity_factor", type=float, default=0.0,
                      help="pair rows per rank = this x (tokens per rank x K), rounded up to the "
                           "alignment; pairs past them are dropped; 0: room for every pair")
  parser.add_argument("--grouped_matmul", choices=["auto", "xla"], default="auto",
                      help="the experts' GEMMs: auto (the Pallas Hopper kernels on sm_90) or "
                           "xla (jax.lax.ragged_dot), jax_ep.moe.GroupedMatmulConfig")
  parser.add_argument("--weight_decay", type=float, default=0.01, help="AdamW, matrices only")
  parser.add_argument("--aux_loss_weight", type=float, default=0.01,
                      help="weight of the load-balancing loss")
  parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                      help="compute dtype of training (the dense check runs float32)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of the loss curve and the experts' load here "
                           "(default: no file)")
  ns = vars(parser.parse_args(argv))
  preset = ns["preset"] if ns["preset"] != "auto" else ("gpu" if platform == "gpu" else "small")
  for name, value in PRESETS[preset].items():
    if ns[name] is None:
      ns[name] = value
  ns["preset"] = preset
  return Args(**ns)


def pair_capacity(args: Args, tokens_per_rank: int, ep_ranks: int) -> int | None:
  """M for --capacity_factor: that many times a rank's mean share of pairs
  (tokens per rank x K), rounded up to the alignment, at most jax_ep's
  default; None (no --capacity_factor): the default, room for every pair."""
  if args.capacity_factor <= 0:
    return None
  a = args.expert_alignment
  rows = -(-int(np.ceil(args.capacity_factor * tokens_per_rank * args.topk)) // a) * a
  return min(rows, expert_major.default_rows(ep_ranks, tokens_per_rank, args.topk,
                                             args.experts_per_rank, a))


def build(args: Args, mesh) -> tuple[model.ModelConfig, jax_ep.EpConfig]:
  """The model and the EpConfig for ``mesh`` (E = experts_per_rank x the expert axis)."""
  num_experts = args.experts_per_rank * mesh.shape["expert"]
  config = model.ModelConfig(
      vocab=args.vocab, seq_len=args.seq_len, hidden=args.hidden, heads=args.heads,
      layers=args.layers, experts=num_experts, topk=args.topk, ffn=args.ffn,
      shared_ffn=args.shared_ffn, compute_dtype=args.dtype, aux_loss_weight=args.aux_loss_weight)
  ep_config = jax_ep.EpConfig(num_experts=num_experts, hidden=args.hidden,
                              max_tokens_per_rank=args.batch_per_rank * args.seq_len,
                              num_topk=args.topk, group=jax_ep.EpGroup(axis_name="expert"),
                              enable_low_latency=False)
  return config, ep_config


def make_mesh(num_data: int):
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  if num_data < 1 or len(devices) % num_data:
    sys.exit(f"--data {num_data} does not divide the {len(devices)} devices")
  return jax.make_mesh((num_data, len(devices) // num_data), BATCH_AXES, devices=devices)


def train(args: Args, config, ep_config, mesh, host_params, batches, capacity, say):
  """The main run: jax_ep's MoE in args.dtype. Returns (cross-entropy per step,
  the steps of the logs, load [logs, layers, E], dropped pairs in all, the
  compiled step's jax_ep custom calls)."""
  optimizer = make_optimizer(args.learning_rate, args.warmup, args.steps, args.weight_decay)
  specs = model.param_specs(host_params, "expert")
  gmm = moe.GroupedMatmulConfig(implementation=args.grouped_matmul)
  step = make_train_step(config, mesh, model.moe_ffn_ep(ep_config, args.expert_alignment,
                                                        capacity, gmm),
                         specs, optimizer, experts_split=True)
  params = place(mesh, host_params, specs)
  opt_state = jax.jit(optimizer.init)(params)
  start = time.perf_counter()
  compiled = step.lower(params, opt_state, place(mesh, batches[0], P(BATCH_AXES))).compile()
  calls = jax_ep_custom_calls(compiled.as_text())
  say(f"compiled the {config.compute_dtype} step in {time.perf_counter() - start:.1f} s; jax_ep "
      "custom calls: " + (", ".join(f"{n} x{c}" for n, c in sorted(calls.items())) or "none"))
  tokens_per_step = batches.shape[1] * args.seq_len
  pending, losses, load_steps, loads, dropped = [], [], [], [], 0
  last_time, last_step = time.perf_counter(), 0
  for s in range(args.steps):
    params, opt_state, metrics = compiled(params, opt_state,
                                          place(mesh, batches[s], P(BATCH_AXES)))
    pending.append({k: metrics[k] for k in ("loss", "cross_entropy", "load", "dropped")})
    if (s + 1) % args.log_every and s + 1 != args.steps:
      continue
    fetched = to_host(pending)
    pending = []
    now = time.perf_counter()
    rate = (s + 1 - last_step) * tokens_per_step / (now - last_time)
    last_time, last_step = now, s + 1
    losses += [float(m["cross_entropy"]) for m in fetched]
    dropped += sum(int(np.sum(m["dropped"])) for m in fetched)
    load = fetched[-1]["load"]                                       # [layers, E]
    load_steps.append(s)
    loads.append(load)
    say(f"step {s + 1:4d}/{args.steps}  loss {float(fetched[-1]['loss']):.4f} "
        f"(cross-entropy {losses[-1]:.4f})  {rate:,.0f} tokens/s  dropped "
        f"{int(np.sum(fetched[-1]['dropped']))}  pairs per expert: " +
        " | ".join(" ".join(str(int(c)) for c in layer) for layer in load))
  return np.asarray(losses), np.asarray(load_steps), np.asarray(loads), dropped, calls


def main(argv: list[str]) -> None:
  launch.initialize_distributed_from_env()   # under python -m jax_ep.launch; else no-op
  platform = jax.devices()[0].platform
  args = parse_args(argv, platform)
  say = print if jax.process_index() == 0 else (lambda *_: None)   # the verdict: every rank
  mesh = make_mesh(args.data)
  config, ep_config = build(args, mesh)
  jax_ep.initialize(ep_config, mesh)
  backend = jax_ep.runtime_state().backend_name
  tokens_per_rank = ep_config.max_tokens_per_rank
  capacity = pair_capacity(args, tokens_per_rank, mesh.shape["expert"])
  task = markov_task.make_task(args.vocab, args.successors, args.seed)
  batches = task.sample(np.random.default_rng(args.seed + 1),
                        (args.steps, args.batch_per_rank * mesh.size), args.seq_len + 1)
  host_params = model.init_params(config, args.seed)
  num_params = sum(p.size for p in jax.tree.leaves(host_params))
  say(f"jax_ep backend: {backend}; {mesh.size} devices on {platform} ({jax.process_count()} "
      f"process(es)); mesh {dict(mesh.shape)}, EP over 'expert': {args.data} group(s) of "
      f"{mesh.shape['expert']}; preset {args.preset}")
  say(f"model: {args.layers} layers, H={args.hidden}, {args.heads} heads, E={config.experts} "
      f"(E_local={args.experts_per_rank}) K={args.topk} ffn={args.ffn} shared_ffn="
      f"{args.shared_ffn}; {num_params / 1e6:.2f}M float32 params, {args.dtype} compute; batch "
      f"{batches.shape[1]} x {args.seq_len} tokens ({tokens_per_rank} per rank); "
      f"expert_alignment {args.expert_alignment}, grouped GEMMs {args.grouped_matmul}, "
      f"pair rows per rank "
      f"{'for every pair' if capacity is None else capacity}")
  say(f"task: a Markov chain over {args.vocab} tokens, {args.successors} likely successors "
      f"each: entropy rate {task.entropy_rate:.3f} nats, unigram entropy "
      f"{task.unigram_entropy:.3f}, log V {np.log(args.vocab):.3f}")

  # 1. jax_ep against dense routing, the first steps in float32.
  say(f"dense check: {args.check_steps} AdamW steps in float32, jax_ep against every expert on "
      "every token (the experts jax_ep chose), from the same parameters" +
      (" (without --capacity_factor: dense routing drops nothing)" if capacity else ""))
  config32 = dataclasses.replace(config, compute_dtype="float32")
  with jax.set_mesh(mesh):
    dense = check.compare_with_dense(
        config32, model.moe_ffn_ep(ep_config, args.expert_alignment, None), mesh, host_params,
        batches[:args.check_steps],
        make_optimizer(args.learning_rate, args.warmup, args.steps, args.weight_decay),
        mesh.shape["expert"])
  for s, ((ep, ref), bound) in enumerate(zip(dense.losses, dense.loss_bounds)):
    say(f"  step {s}: loss {ep:.7f}, dense {ref:.7f}, |diff| {abs(ep - ref):.1e} <= {bound:.1e}")
  worst = dense.worst()
  say(f"  relative rounding budget rho {dense.rho:.2e}; gradients at step 0 within "
      f"{worst['grads']:.4f} of it (largest |grad - dense| / |dense| "
      f"{max(dense.grad_errors.values()):.1e}); parameters after {args.check_steps} steps within "
      f"{worst['params']:.4f} of their bound; losses within {worst['loss']:.4f}; pairs per "
      f"expert {'equal' if dense.same_load else 'DIFFERENT'}")

  # 2. Training.
  with jax.set_mesh(mesh):
    losses, load_steps, loads, dropped, calls = train(args, config, ep_config, mesh,
                                                      host_params, batches, capacity, say)
  threshold = check.learning_threshold(task)
  final = check.mean_of_last_tenth(losses)
  say(f"learning: the last 10% of the steps average {final:.4f} nats (first step "
      f"{losses[0]:.4f}); must be below {threshold:.4f}, the midpoint between the entropy rate "
      f"and the unigram entropy; {dropped} pairs dropped in all")
  if args.plot and jax.process_index() == 0:
    import moe_transformer_plot  # pylint: disable=import-outside-toplevel  # matplotlib: if asked
    moe_transformer_plot.write_png(
        args.plot, losses, load_steps, loads, entropy_rate=task.entropy_rate,
        unigram_entropy=task.unigram_entropy,
        title=f"{mesh.size} {platform} devices, mesh {dict(mesh.shape)}, {args.layers} layers, "
              f"E={config.experts}, K={args.topk}, {args.dtype}, jax_ep {backend} backend")
    say(f"wrote {args.plot}")

  failure = missing_kernels(calls, gpu_bf16=platform == "gpu" and args.dtype == "bfloat16",
                            backend=backend)
  jax_ep.finalize()
  if failure:
    print(failure)
    sys.exit(1)
  if not dense.ok:
    print("MISMATCH against dense routing")
    sys.exit(1)
  if not final < threshold:
    print("NO LEARNING")
    sys.exit(1)
  print("OK")


if __name__ == "__main__":
  main(sys.argv[1:])
