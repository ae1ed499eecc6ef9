"""HT benchmark: training/prefill batches (DeepEP's intranode test settings by default).

Systems, all timed the same way in the same run (timing.py):
  * jax_ep: BF16 and FP8 dispatch, BF16 combine (the CUDA kernels on GPUs),
    and get_dispatch_layout;
  * all_to_all (portable): the same exchange on the portable backend
    (capacity-padded [R, T, ...] jax.lax.all_to_all plus packing); FP8 against
    FP8 (the e4m3 rows plus their scales);
  * ragged_all_to_all (--ragged, its own run): MaxText's dropless EP path
    (ragged.py); its combine timed alone;
  * the bare all_to_all of the padded [R, T, ...] buffer (bare.py), bf16 and
    FP8, and every system's time over it;
  * (--layouts) rows grouped by expert for a grouped matmul: the expert-major
    layout (BF16 and FP8 dispatch, BF16 combine) against the token-major one and
    the user's sort after it, each expert-major row with its floor, an XLA copy
    of the same pair rows (layouts.py);
  * the HBM floors of the local path (floors.py): one tiny kernel, a copy and an
    FP8 quantize of the rows in plain XLA.
Bytes and GB/s: traffic.py (DeepEP's count and the bytes that cross NVLink).
The token sweep's chart is drawn from the JSON (benchmarks/plot_sweep.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import numpy as np

import jax_ep
from jax_ep.backends.xla import XlaBackend
from jax_ep.bench import bare, floors, measure, ragged, timing, traffic
from jax_ep.bench import layouts as layout_rows
from jax_ep.bench.common import deepep_routing, random_rows
from jax_ep.bench.results import Row, row_of
from jax_ep.types import DispatchHandle

PORTABLE = "all_to_all (portable)"
RAGGED = "ragged_all_to_all"
BARE = "jax.lax.all_to_all"
SWEEP_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """One token count's inputs on this process (numpy: its ranks' parts one after the
  other along axis 0, L = timing.ranks_here ranks) and the routing's counts."""

  config: jax_ep.EpConfig
  x: np.ndarray                 # bf16 [L*T, H]
  q: np.ndarray                 # float8_e4m3fn [L*T, H]
  scales: np.ndarray            # float32 [L*T, H/128]
  idx: np.ndarray               # int32 [L*T, K]
  w: np.ndarray                 # float32 [L*T, K]
  counts: traffic.RoutingCounts
  ranks_here: int               # L
  # The combine's inputs, y [C, H], recv_src [C], send_row [T, R], num_tokens [1]:
  # one jax_ep dispatch's rows and layout, made once (on first use, inside the
  # combine rows' timers, so a failing dispatch fails those rows), outside
  # every timed loop.
  combine_inputs: Callable[[], list]


def _setup(mesh, tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int,
           num_sms: int | None) -> _Setup:
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=tokens,
                           num_topk=num_topk, enable_low_latency=False,
                           group=jax_ep.EpGroup(num_sms=num_sms))
  jax_ep.initialize(config, mesh)
  here = timing.ranks_here(mesh)
  rng = np.random.default_rng(seed + jax.process_index())
  x = random_rows(rng, (here * tokens, hidden))
  idx = deepep_routing(rng, here * tokens, num_experts, num_topk)
  w = rng.random((here * tokens, num_topk)).astype(np.float32)
  q, scales = (np.asarray(a) for a in jax.jit(jax_ep.fp8.quantize)(x))

  @functools.cache
  def combine_inputs() -> list:
    def dispatch_once(x, idx, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      return d.x, d.handle.recv_src, d.handle.send_row, d.num_tokens[None]
    once = jax.jit(jax.shard_map(dispatch_once, mesh=mesh, in_specs=jax.P("ep"),
                                 out_specs=jax.P("ep")))
    glob = functools.partial(timing.global_array, mesh)
    return [timing.local_part(o) for o in once(glob(x), glob(idx), glob(w))]

  every_idx = measure.allgather(idx).reshape(jax.device_count(), tokens, num_topk)
  return _Setup(config, x, q, scales, idx, w, traffic.routing_counts(every_idx, num_experts),
                here, combine_inputs)


def _handle(config, recv_src, send_row, kept):
  return DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=kept[0], config=config)


def jax_ep_ops(config: jax_ep.EpConfig) -> dict[str, Callable]:
  """The per-shard ops timed for jax_ep, by op name; inputs: _inputs(). Each
  returns its whole result, so nothing of it can be left uncomputed."""
  return {
      "dispatch BF16": lambda x, i, w: jax_ep.dispatch(x, i, w, config=config),
      "dispatch FP8": lambda q, sc, i, w: jax_ep.dispatch((q, sc), i, w, config=config),
      "combine BF16": lambda y, r, sr, k: jax_ep.combine(y, _handle(config, r, sr, k),
                                                         config=config),
  }


def portable_ops(config: jax_ep.EpConfig, capacity: int) -> dict[str, Callable]:
  """The portable all_to_all path of the same ops (FP8: the e4m3 rows and their
  scales through the capacity-padded all_to_all), whole results returned."""
  portable = XlaBackend()
  return {
      "dispatch BF16": lambda x, i, w: portable.ht_dispatch((x,), i, w, config, capacity),
      "dispatch FP8": lambda q, sc, i, w: portable.ht_dispatch((q, sc), i, w, config, capacity),
      "combine BF16": lambda y, r, sr, k: portable.ht_combine(y, _handle(config, r, sr, k)),
  }


def _inputs(s: _Setup) -> dict:
  """Each op's inputs on this rank (a list, or a function that makes it)."""
  return {"dispatch BF16": [s.x, s.idx, s.w], "dispatch FP8": [s.q, s.scales, s.idx, s.w],
          "combine BF16": s.combine_inputs}


def _jax_ep_systems(runner: measure.Runner, s: _Setup) -> dict[str, measure.Outcome]:
  inputs = _inputs(s)
  return {name: runner.time(f"{name}, jax_ep", op, inputs[name], profile=True)
          for name, op in jax_ep_ops(s.config).items()}


def _portable_systems(runner: measure.Runner, s: _Setup) -> dict[str, measure.Outcome]:
  inputs = _inputs(s)
  ops = portable_ops(s.config, s.config.capacity(jax.device_count()))
  return {name: runner.time(f"{name}, all_to_all", op, inputs[name]) for name, op in ops.items()}


def _bare_system(runner: measure.Runner, s: _Setup, fp8: bool) -> measure.Outcome:
  num_ranks = jax.device_count()
  return runner.time(f"bare all_to_all {'FP8' if fp8 else 'BF16'}",
                     functools.partial(bare.exchange, num_ranks=num_ranks),
                     bare.inputs(s.x, num_ranks, fp8, s.ranks_here))


def _ragged_systems(runner: measure.Runner, s: _Setup, calls: int) -> dict[str, measure.Outcome]:
  """MaxText's ragged exchange; the combine alone, on a layout made beforehand."""
  mesh, config = runner.mesh, s.config
  single_shot = ragged.needs_single_shot()

  def combine_inputs():  # run inside the combine's timer, so its failure is that row's
    fn = jax.jit(jax.shard_map(ragged.prepare_op(config), mesh=mesh, in_specs=jax.P("ep"),
                               out_specs=jax.P("ep")))
    glob = functools.partial(timing.global_array, mesh)
    return [timing.local_part(o) for o in fn(glob(s.x), glob(s.idx))]

  return {
      "dispatch BF16": runner.time(
          "dispatch BF16, ragged_all_to_all", ragged.dispatch_op(config), [s.x, s.idx],
          single_shot=single_shot, num_calls=calls),
      "combine BF16": runner.time(
          "combine BF16 (alone), ragged_all_to_all", ragged.combine_op(config.axis_name),
          combine_inputs, single_shot=single_shot, num_calls=calls),
  }


def op_rows(ops: dict[str, dict[str, measure.Outcome]], counts: traffic.RoutingCounts,
            hidden: int, system_names: dict[str, str], bare_of: dict[str, measure.Outcome]
            ) -> list[Row]:
  """Rows of every measured (op, system): ``ops`` {system: {op name: Outcome}},
  ``bare_of`` {"BF16" | "FP8": Outcome}. Each row's time is compared with the
  bare exchange of the same payload and (jax_ep's) with the portable path of the
  same op: FP8 with FP8."""
  rows = []
  portable = ops.get("portable", {})
  for name in ("dispatch BF16", "dispatch FP8", "combine BF16"):
    fp8 = "FP8" in name
    moved = (traffic.ht_combine(counts, hidden) if name.startswith("combine")
             else traffic.ht_dispatch(counts, hidden, fp8))
    for system, outcomes in ops.items():
      if name in outcomes:
        rows.append(row_of(f"HT {name}", system_names[system], outcomes[name],
                           moved.received_only() if system == "portable" else moved,
                           bare_of["FP8" if fp8 else "BF16"],
                           portable.get(name) if system == "jax_ep" else None,
                           note="combine alone (layout made beforehand)"
                           if system == "ragged" and name.startswith("combine") else ""))
  return rows


def _bare_rows(bare_of: dict[str, measure.Outcome], tokens: int, hidden: int) -> list[Row]:
  num_ranks = jax.device_count()
  return [row_of(f"bare all_to_all {label} [R,{tokens},H]", BARE, bare_of[label],
                 traffic.bare_all_to_all(num_ranks, tokens, hidden, label == "FP8"),
                 bare_of[label], note="each token once per rank, no routing or packing")
          for label in bare_of]


def run(tokens: int, hidden: int, num_experts: int, num_topk: int, num_calls: int,
        repeats: int, seed: int, sweep: bool = False, ragged_only: bool = False,
        sm_sweep: tuple[int, ...] = (), baselines: bool = True, layouts: bool = False,
        warmup_calls: int = timing.WARMUP_CALLS, probes: Sequence[measure.Probe] = ()
        ) -> tuple[list[Row], dict]:
  """The HT table at ``tokens`` per rank; (rows, meta).

  ``ragged_only``: time the ragged_all_to_all baseline (and the bare exchange)
  instead; slow, so it runs as its own invocation and a stall there cannot cost
  the other numbers (single-shot unless XLA's decomposer is on, see
  ragged.needs_single_shot). ``sweep``: also jax_ep, the portable path and the
  bare exchange over tokens per rank 128..8192 (``meta.sweep``). ``sm_sweep``:
  also jax_ep at each of these SM budgets (EpGroup.num_sms). ``baselines=False``:
  jax_ep and the bare exchange only (quick A/B runs of kernel variants).
  ``layouts``: also the layout rows (layouts.py): expert-major (with the
  floors of its rows), token-major, and token-major followed by the user's jnp
  sort. ``warmup_calls``: calls of warm-up executions before each system
  (timing.py). ``probes``: looks inside each timing (measure.Probe), their
  results in ``meta`` under their keys (the table's runs only, not the sweeps').
  """
  num_ranks = jax.device_count()
  mesh = jax.make_mesh((num_ranks,), ("ep",))
  meta = dict(tokens_per_rank=tokens, hidden=hidden, num_experts=num_experts, topk=num_topk,
              num_ranks=num_ranks, num_calls=num_calls,
              short_calls=timing.short_calls_of(max(num_calls, 2)), repeats=repeats, seed=seed,
              warmup_calls=warmup_calls, capacity=num_ranks * tokens)
  runner = measure.Runner(mesh, num_calls, repeats, context=f"tokens={tokens} ",
                          warmup_calls=warmup_calls, probes=probes)
  s = _setup(mesh, tokens, hidden, num_experts, num_topk, seed, None)
  ours = f"jax_ep ({jax_ep.runtime_state().backend_name} backend)"
  names = dict(jax_ep=ours, portable=PORTABLE, ragged=RAGGED)
  meta["routing"] = dict(pairs=s.counts.pairs.tolist(), tokens=s.counts.tokens.tolist())
  bare_of = {"BF16": _bare_system(runner, s, False), "FP8": _bare_system(runner, s, True)}
  if ragged_only:
    ops = {"ragged": _ragged_systems(runner, s, max(2, num_calls // 10))}
    return (op_rows(ops, s.counts, hidden, names, bare_of) + _bare_rows(bare_of, tokens, hidden),
            meta)
  ops = {"jax_ep": _jax_ep_systems(runner, s)}
  if baselines:
    ops["portable"] = _portable_systems(runner, s)
  rows = op_rows(ops, s.counts, hidden, names, bare_of)
  config = s.config
  rows.append(row_of("get_dispatch_layout", ours, runner.time(
      "layout, jax_ep", lambda i: jax_ep.get_dispatch_layout(i, config=config), [s.idx])))
  if baselines:
    portable = XlaBackend()
    rows.append(row_of("get_dispatch_layout", "portable (jnp)", runner.time(
        "layout, portable", lambda i: portable.layout(i, config), [s.idx])))
  rows += _bare_rows(bare_of, tokens, hidden)
  rows += floors.ht_rows(runner, s.x, s.idx, s.ranks_here)
  if layouts:
    rows += layout_rows.rows(runner, config, s.x, s.q, s.scales, s.idx, s.w, "jax_ep",
                             s.ranks_here)
    meta["expert_alignments"] = list(layout_rows.ALIGNMENTS)
  meta.update(runner.probed)
  if sm_sweep:
    meta["sm_sweep"] = [_point(mesh, tokens, hidden, num_experts, num_topk, seed, n, num_calls,
                               repeats, baselines=False, warmup_calls=warmup_calls,
                               probes=probes)
                        for n in sm_sweep]
  if sweep:
    meta["sweep"] = [_point(mesh, t, hidden, num_experts, num_topk, seed, None, num_calls,
                            repeats, baselines=True, warmup_calls=warmup_calls, probes=probes)
                     for t in SWEEP_TOKENS]
  return rows, meta


def _point(mesh, tokens, hidden, num_experts, num_topk, seed, num_sms, num_calls, repeats,
           baselines: bool, warmup_calls: int = timing.WARMUP_CALLS,
           probes: Sequence[measure.Probe] = ()) -> dict:
  """One sweep point: {tokens, num_sms, us: {key: us or None}, gbps: {...}, errors: {...},
  below_noise: [key, ...]} with keys "<op> <system>" (jax_ep; with baselines also
  portable and bare); us is None where the key failed (errors) or was below noise.
  The probes look at its timings too (printed, not kept)."""
  runner = measure.Runner(mesh, num_calls, repeats,
                          context=f"tokens={tokens} num_sms={num_sms} ",
                          warmup_calls=warmup_calls, probes=probes)
  s = _setup(mesh, tokens, hidden, num_experts, num_topk, seed, num_sms)
  ops = {"jax_ep": _jax_ep_systems(runner, s)}
  if baselines:
    ops["portable"] = _portable_systems(runner, s)
    ops["bare"] = {"all_to_all BF16": _bare_system(runner, s, fp8=False)}
  point: dict = dict(tokens=tokens, num_sms=num_sms, us={}, gbps={}, errors={}, below_noise=[])
  for system, outcomes in ops.items():
    for name, outcome in outcomes.items():
      key = f"{name} {system}"
      fp8 = "FP8" in name
      moved = (traffic.bare_all_to_all(jax.device_count(), tokens, hidden, fp8)
               if system == "bare" else traffic.ht_combine(s.counts, hidden)
               if name.startswith("combine") else traffic.ht_dispatch(s.counts, hidden, fp8))
      point["us"][key] = outcome.us  # None when it failed or was below noise
      point["gbps"][key] = traffic.gbps(moved.deepep_bytes, outcome.us)
      if outcome.error:
        point["errors"][key] = outcome.error
      elif outcome.below_noise:
        point["below_noise"].append(key)
  return point
