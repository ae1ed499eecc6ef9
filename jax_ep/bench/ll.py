"""LL benchmark: decoding-size batches (DeepEP's LL test settings by default).

Systems, all timed the same way in the same run (timing.py):
  * jax_ep: FP8 and BF16 dispatch, BF16 combine with the weights at the combine
    and, pre-summed per rank, at the dispatch (the CUDA kernels on GPUs);
  * all_to_all (portable): the same exchange on the portable backend, the
    per-expert padded [R, E_local*T, ...] jax.lax.all_to_all plus its packing;
    FP8 against FP8 (rows and scales, quantized inside, as jax_ep does);
  * the bare all_to_all of the padded [R, T, ...] buffer (bare.py), bf16 and
    FP8, and every system's time over it;
  * jax_ep's calls that move no rows (all top-k entries -1): the fixed cost;
  * the HBM floors of the local path (floors.py): one tiny kernel, the pair
    rows' gather, copy and sum in plain XLA.
Bytes and GB/s: traffic.py (DeepEP's count and the bytes that cross the links).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import numpy as np

import jax_ep
from jax_ep.backends.xla import XlaBackend
from jax_ep.bench import bare, floors, measure, timing, traffic
from jax_ep.bench.common import deepep_routing, random_rows
from jax_ep.bench.results import Row, row_of
from jax_ep.types import LowLatencyHandle

PORTABLE = "all_to_all (portable)"
BARE = "jax.lax.all_to_all"


def config_for(tokens: int, hidden: int, num_experts: int, num_topk: int) -> jax_ep.EpConfig:
  """LL-only config whose LL buffers hold exactly ``tokens`` per rank.

  The LL token cap is set explicitly where EpConfig has one
  (``low_latency_max_tokens_per_rank``), so the bench (128 tokens by default,
  DeepEP's LL setting) does not depend on that field's default."""
  kwargs = dict(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=tokens,
                num_topk=num_topk, enable_high_throughput=False)
  if "low_latency_max_tokens_per_rank" in {f.name for f in dataclasses.fields(jax_ep.EpConfig)}:
    kwargs["low_latency_max_tokens_per_rank"] = tokens
  return jax_ep.EpConfig(**kwargs)


def portable_dispatch_op(config: jax_ep.EpConfig, fp8: bool) -> Callable:
  """The portable LL dispatch the bench times, per shard: (x, idx) -> its whole
  result (rows, scales for FP8, counts, layout), so no part of it is left out."""
  portable = XlaBackend()
  return lambda x, idx: portable.ll_dispatch(x, idx, config, fp8)


def run(tokens: int, hidden: int, num_experts: int, num_topk: int, num_calls: int,
        repeats: int, seed: int, baselines: bool = True,
        warmup_calls: int = timing.WARMUP_CALLS, probes: Sequence[measure.Probe] = ()
        ) -> tuple[list[Row], dict]:
  """The LL table at ``tokens`` per rank; (rows, meta) with meta's run settings
  and each probe's results under its key (measure.Probe).
  ``baselines=False``: no portable all_to_all rows (quick A/B runs).
  ``warmup_calls``: calls of warm-up executions before each system (timing.py)."""
  num_ranks = jax.device_count()
  rank = jax.process_index()
  mesh = jax.make_mesh((num_ranks,), ("ep",))
  config = config_for(tokens, hidden, num_experts, num_topk)
  jax_ep.initialize(config, mesh)
  portable = XlaBackend()
  ours = f"jax_ep ({jax_ep.runtime_state().backend_name} backend)"
  # This process's inputs: the parts of its ranks one after the other (one rank per
  # process on GPUs; all of them with several CPU devices in one process).
  here = timing.ranks_here(mesh)
  rng = np.random.default_rng(seed + rank)
  x = random_rows(rng, (here * tokens, hidden))
  idx = deepep_routing(rng, here * tokens, num_experts, num_topk)
  w = rng.random((here * tokens, num_topk)).astype(np.float32)
  counts = traffic.routing_counts(
      measure.allgather(idx).reshape(num_ranks, tokens, num_topk), num_experts)

  # The process's part of the [E_local, R*T, ...] blocks of its ranks.
  y_shape = (here * (num_experts // num_ranks), num_ranks * tokens)

  @functools.cache
  def dispatched() -> list:
    """y, recv_src, count, row_weights: one dispatch's rows, layout and rows'
    weights (topk_weights given to it), made once (on first use, inside the
    combine rows' timers, so a failing dispatch fails those rows), outside
    every timed loop."""
    def dispatch_once(x, idx, w):
      d = jax_ep.low_latency_dispatch(x, idx, config=config, topk_weights=w)
      return d.x, d.handle.recv_src, d.count, d.weights
    once = jax.jit(jax.shard_map(dispatch_once, mesh=mesh, in_specs=jax.P("ep"),
                                 out_specs=jax.P("ep")))
    glob = functools.partial(timing.global_array, mesh)
    y, recv_src, count, row_weights = (timing.local_part(o)
                                       for o in once(glob(x), glob(idx), glob(w)))
    return [y.reshape(y_shape + (hidden,)), recv_src, count, row_weights.reshape(y_shape)]

  def combine_inputs() -> list:
    """y, idx, w, recv_src, count (the weights at the combine)."""
    y, recv_src, count, _ = dispatched()
    return [y, idx, w, recv_src, count]

  def presummed_inputs() -> list:
    """y, idx, recv_src, count, row_weights (the weights at the dispatch)."""
    y, recv_src, count, row_weights = dispatched()
    return [y, idx, recv_src, count, row_weights]

  def handle(recv_src, count, row_weights=None):
    return LowLatencyHandle(recv_src=recv_src, count=count, config=config, num_tokens=tokens,
                            row_weights=row_weights)

  def ours_dispatch(fp8):
    return lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config, use_fp8=fp8)

  def ours_combine(y, i, w, s, c):
    return jax_ep.low_latency_combine(y, i, w, handle(s, c), config=config)

  def ours_combine_presummed(y, i, s, c, row_weights):
    return jax_ep.low_latency_combine(y, i, None, handle(s, c, row_weights), config=config)

  runner = measure.Runner(mesh, num_calls, repeats, warmup_calls=warmup_calls, probes=probes)
  bare_of = {label: runner.time(f"bare all_to_all {label}",
                                functools.partial(bare.exchange, num_ranks=num_ranks),
                                bare.inputs(x, num_ranks, fp8, here))
             for fp8, label in ((True, "FP8"), (False, "BF16"))}
  rows: list[Row] = []
  def with_baseline(op: str, moved: traffic.Traffic, mine, portable_op, args, bare,
                    note: str = "") -> list[Row]:
    """jax_ep's row of ``op`` and, with baselines, the portable path's, timed the same way."""
    if not baselines:
      return [row_of(op, ours, mine, moved, bare, note=note)]
    base = runner.time(f"{op}, all_to_all", portable_op, args)
    return [row_of(op, ours, mine, moved, bare, base, note=note),
            row_of(op, PORTABLE, base, moved.received_only(), bare)]

  for fp8, label in ((True, "FP8"), (False, "BF16")):
    op = f"LL dispatch {label}"
    mine = runner.time(f"{op}, jax_ep", ours_dispatch(fp8), [x, idx], profile=True)
    rows += with_baseline(op, traffic.ll_dispatch(counts, hidden, fp8), mine,
                          portable_dispatch_op(config, fp8), [x, idx], bare_of[label])
  mine = runner.time("LL combine BF16, jax_ep", ours_combine, combine_inputs, profile=True)
  rows += with_baseline("LL combine BF16", traffic.ll_combine(counts, hidden), mine,
                        lambda y, i, w, s, c: portable.ll_combine(y, i, w, handle(s, c)),
                        combine_inputs, bare_of["BF16"])
  # The weights given to the dispatch: one pre-summed row per (token, rank) back. No
  # portable row: at DeepEP's LL shape its per-slot gather over every local expert
  # ([R*T, E_local] rows per call) did not finish within 7 minutes on one H200
  # (2026-12-01, d74090e); the per-pair combine above is its comparison.
  op = "LL combine BF16, pre-summed"
  rows.append(row_of(op, ours, runner.time(f"{op}, jax_ep", ours_combine_presummed,
                                           presummed_inputs, profile=True),
                     traffic.ll_combine_presummed(counts, hidden), bare_of["BF16"],
                     note="topk_weights given to the dispatch"))
  # The protocol's fixed cost: the same calls moving no rows.
  nothing = np.full_like(idx, -1)
  rows.append(row_of("LL dispatch, no rows", ours,
                     runner.time("LL dispatch, no rows", ours_dispatch(False), [x, nothing],
                                 profile=True),
                     note="all top-k entries -1: launch, flags and waits only"))
  rows.append(row_of("LL combine, no rows", ours,
                     runner.time("LL combine, no rows", ours_combine,
                                 [np.zeros(y_shape + (hidden,), x.dtype), nothing, w,
                                  np.full(y_shape, -1, np.int32),
                                  np.zeros(y_shape[:1], np.int32)], profile=True),
                     note="no rows: launch, flags and waits only"))
  for fp8, label in ((True, "FP8"), (False, "BF16")):
    rows.append(row_of(f"bare all_to_all {label} [R,{tokens},H]", BARE, bare_of[label],
                       traffic.bare_all_to_all(num_ranks, tokens, hidden, fp8), bare_of[label],
                       note="each token once per rank, no routing or packing"))
  rows += floors.ll_rows(runner, x, idx, here)
  meta = dict(tokens_per_rank=tokens, hidden=hidden, num_experts=num_experts, topk=num_topk,
              num_ranks=num_ranks, num_calls=num_calls,
              short_calls=timing.short_calls_of(max(num_calls, 2)), repeats=repeats, seed=seed,
              warmup_calls=warmup_calls, ll_max_tokens_per_rank=tokens,
              routing=dict(pairs=counts.pairs.tolist(), tokens=counts.tokens.tolist()),
              **runner.probed)
  return rows, meta
