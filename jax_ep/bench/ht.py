"""HT benchmark: training/prefill batches (DeepEP's intranode test settings by default).

Systems, all timed the same way in the same run (timing.py):
  * jax_ep: CUDA kernels (BF16 and FP8 dispatch, BF16 combine);
  * all_to_all: the same exchange on the portable backend (capacity-padded
    [R, T, H] jax.lax.all_to_all plus packing);
  * ragged_all_to_all: MaxText's dropless EP path (rows sorted by destination,
    sizes exchanged, jax.lax.ragged_all_to_all);
  * the bare all_to_all of one [R, T, H] bf16 buffer (no routing or packing).
GB/s as DeepEP reports it (bytes of all received rows, local ones included,
over time) and the bytes that crossed NVLink per direction.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep.backends.xla import XlaBackend
from jax_ep.bench import timing
from jax_ep.bench.common import Row, deepep_routing, random_rows
from jax_ep.types import DispatchHandle


RAGGED_DECOMPOSER_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def _ragged_needs_single_shot() -> bool:
  """Whether ragged_all_to_all must be timed by single executions.

  XLA's multi-process NCCL send/recv fallback (jax 0.11.2) never returned from a
  second execution of a ragged program on 2x H200; under XLA's dense decomposer
  (RAGGED_DECOMPOSER_FLAG in XLA_FLAGS, which tools/gpu_check.sh sets) repeated
  executions return (tools/ragged_probe.sh, 2026-11-30), so the baseline gets the
  same slope harness as every other system.
  """
  return RAGGED_DECOMPOSER_FLAG not in os.environ.get("XLA_FLAGS", "")


def _ragged_dispatch(x, idx, config: jax_ep.EpConfig):
  """MaxText-style: sort per-destination copies, exchange sizes, ragged_all_to_all."""
  axis = config.axis_name
  num_ranks = jax.lax.axis_size(axis)
  num_tokens = x.shape[0]
  experts_per_rank = config.num_experts // num_ranks
  owner = jnp.where(idx >= 0, idx // experts_per_rank, num_ranks)
  in_rank = jnp.any(owner[:, :, None] == jnp.arange(num_ranks), axis=1)      # [T, R]
  key = jnp.where(in_rank.T, jnp.arange(num_ranks)[:, None] * num_tokens
                  + jnp.arange(num_tokens)[None], num_ranks * num_tokens)  # [R, T]
  order = jnp.argsort(key.reshape(-1))
  operand = x[order % num_tokens]                                          # [R*T, H]
  send_sizes = jnp.sum(in_rank, axis=0, dtype=jnp.int32)
  input_offsets = jnp.cumsum(send_sizes) - send_sizes
  counts = jax.lax.all_gather(send_sizes, axis)                            # [src, dst]
  me = jax.lax.axis_index(axis)
  output_offsets = jnp.sum(jnp.where(jnp.arange(num_ranks)[:, None] < me, counts, 0), axis=0,
                           dtype=jnp.int32)
  recv_sizes = counts[:, me]
  output = jnp.zeros((num_ranks * num_tokens, x.shape[1]), x.dtype)
  return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                   recv_sizes, axis_name=axis), (send_sizes, input_offsets,
                                                                 output_offsets, recv_sizes,
                                                                 order)


def _ragged_combine(y, layout, num_tokens: int, config: jax_ep.EpConfig):
  """The reverse ragged_all_to_all, then a sum of each token's copies."""
  send_sizes, input_offsets, output_offsets, recv_sizes, order = layout
  axis = config.axis_name
  num_ranks = jax.lax.axis_size(axis)
  # Rows go back: what we received from s (at recv offsets) returns to s's input offsets.
  recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
  back_offsets = jax.lax.all_to_all(input_offsets, axis, 0, 0, tiled=True)
  returned = jax.lax.ragged_all_to_all(
      y, jnp.zeros((num_ranks * num_tokens, y.shape[1]), y.dtype), recv_offsets, recv_sizes,
      back_offsets, send_sizes, axis_name=axis)
  out = jnp.zeros((num_tokens, y.shape[1]), jnp.float32).at[order % num_tokens].add(
      returned.astype(jnp.float32))
  return out.astype(y.dtype)


def run(tokens: int, hidden: int, num_experts: int, num_topk: int, num_calls: int,
        repeats: int, seed: int, sweep: bool = False, plot: str | None = None,
        ragged: bool = False, sm_sweep: tuple[int, ...] = (), baselines: bool = True):
  """The HT table (jax_ep, all_to_all, bare all_to_all) at ``tokens`` per rank.

  ``ragged``: time only the ragged_all_to_all baseline instead (slow: it runs as
  its own invocation so a stall there cannot cost the other numbers; timed
  single-shot unless XLA's decomposer is on, see _ragged_needs_single_shot).
  ``sweep``: also jax_ep and all_to_all over tokens per rank 128..8192 (+ PNG).
  ``sm_sweep``: also jax_ep at each of these SM budgets (EpConfig.num_sms).
  ``baselines``: False times jax_ep alone (quick A/B runs of kernel variants).
  """
  num_ranks = jax.device_count()
  rank = jax.process_index()
  mesh = jax.make_mesh((num_ranks,), ("ep",))
  portable = XlaBackend()
  rows: list[Row] = []
  meta = dict(tokens_per_rank=tokens, hidden=hidden, num_experts=num_experts, topk=num_topk,
              num_ranks=num_ranks, num_calls=num_calls, repeats=repeats)

  def measure(t: int, bare: bool, baselines: bool = True, num_sms: int | None = None):
    """jax_ep at t tokens; `baselines`: also the portable all_to_all path; `bare`: also
    the bare all_to_all. Returns ({(op, system): us}, received rows, remote rows)."""
    config = jax_ep.EpConfig(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=t,
                             num_topk=num_topk, enable_low_latency=False, num_sms=num_sms)
    jax_ep.initialize(config, mesh)
    rng = np.random.default_rng(seed + rank)
    x = random_rows(rng, (t, hidden))
    idx = deepep_routing(rng, t, num_experts, num_topk)
    w = rng.random((t, num_topk)).astype(np.float32)
    calls = lambda slow: max(2, num_calls // 10) if slow else num_calls  # noqa: E731

    def profiled(label, op, *args):
      """time(); with JAX_EP_PROFILE=1 also the in-kernel breakdown (rank 0's)."""
      cuda = jax_ep.runtime_state().cuda
      if cuda is None or os.environ.get("JAX_EP_PROFILE") != "1":
        return time(label, op, *args)
      cuda.module.read_profile()  # resets the counters
      us = time(label, op, *args)
      profile = cuda.module.read_profile()
      trace = profile.pop("ht_trace", None)
      if trace is not None and "dispatch" in label:
        profile["timeline_us"] = timeline(trace)
      profiles[f"tokens={t} num_sms={num_sms} {label}"] = profile
      # Every rank's own (the table shows rank 0's): a rank that waits for the
      # other in the count exchange shows where the other spends that time.
      print(f"profile rank {rank}: {label}: " + "; ".join(
          f"{k} kernel {v['kernel_us']:.1f} wait {v['wait_us']:.1f}"
          for k, v in profile.items() if k != "timeline_us"), flush=True)
      if "timeline_us" in profile:
        print(f"timeline rank {rank}: {label}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in profile["timeline_us"].items()), flush=True)
      return us

    def time(label, op, *args, slow=False):
      """Median us per call, or None if this system cannot run here (noted in the log).
      `slow`: the ragged_all_to_all baseline, timed by single executions
      (timing.time_single_shot says why)."""
      try:
        if slow:
          measured = timing.time_single_shot(op, mesh, args, calls(slow))
        else:
          measured = timing.time_per_call(op, mesh, args, calls(slow), repeats)
        us = timing.gather_max(measured.median_us)
        if rank == 0:
          print(f"bench: tokens={t} {label}: {us:.1f} us", flush=True)
        return us
      except Exception as e:  # pylint: disable=broad-except
        if rank == 0:
          print(f"bench: skipped one system: {str(e).splitlines()[0][:300]}")
        return None

    def dispatch_once(x, idx, w):
      d = jax_ep.dispatch(x, idx, w, config=config)
      return d.x, d.num_tokens[None], d.handle.recv_src, d.handle.send_row
    once = jax.jit(jax.shard_map(dispatch_once, mesh=mesh, in_specs=jax.P("ep"),
                                 out_specs=jax.P("ep")))
    glob = lambda a: timing.global_array(mesh, a)  # noqa: E731
    y, kept, recv_src, send_row = (np.asarray(o.addressable_shards[0].data)
                                   for o in once(glob(x), glob(idx), glob(w)))
    received = int(kept[0])
    remote = int(np.sum((recv_src[:received] // t) != rank))

    def handle(recv_src, send_row, kept):
      return DispatchHandle(recv_src=recv_src, send_row=send_row, num_tokens=kept[0],
                            config=config)

    results = {}
    if ragged:
      slow = _ragged_needs_single_shot()
      results["dispatch BF16", "ragged_all_to_all"] = time(
        "dispatch BF16, ragged_all_to_all",
          lambda x, i: _ragged_dispatch(x, i, config)[0], x, idx, slow=slow)
      results["combine BF16", "ragged_all_to_all"] = time(
        "combine BF16, ragged_all_to_all",
          lambda x, i: _ragged_combine(*_ragged_dispatch(x, i, config), t, config), x, idx,
          slow=slow)
      return results, received, remote
    results["dispatch BF16", "jax_ep"] = profiled(
        "dispatch BF16, jax_ep",
        lambda x, i, w: jax_ep.dispatch(x, i, w, config=config), x, idx, w)
    results["dispatch FP8", "jax_ep"] = profiled(
        "dispatch FP8, jax_ep",
        lambda q, s, i, w: jax_ep.dispatch((q, s), i, w, config=config),
        *[np.asarray(a) for a in jax.jit(jax_ep.fp8.quantize)(x)], idx, w)
    results["combine BF16", "jax_ep"] = profiled(
        "combine BF16, jax_ep",
        lambda y, s, r, k: jax_ep.combine(y, handle(s, r, k), config=config),
        y, recv_src, send_row, kept)
    if baselines:
      results["dispatch BF16", "all_to_all"] = time(
        "dispatch BF16, all_to_all",
          lambda x, i, w: portable.ht_dispatch((x,), i, w, config, num_ranks * t)[0], x, idx, w)
      results["combine BF16", "all_to_all"] = time(
        "combine BF16, all_to_all",
          lambda y, s, r, k: portable.ht_combine(y, handle(s, r, k)), y, recv_src, send_row, kept)
    if bare:
      results["layout", "jax_ep"] = time(
          "layout, jax_ep", lambda i: jax_ep.get_dispatch_layout(i, config=config), idx)
      results["layout", "all_to_all"] = time(
          "layout, portable", lambda i: portable.layout(i, config)[1:], idx)
      results["bare all_to_all", "jax.lax.all_to_all"] = time(
        "bare all_to_all, jax.lax.all_to_all",
          lambda x: jax.lax.all_to_all(x.reshape(num_ranks, -1, hidden), "ep", 0, 0, tiled=True),
          np.tile(x, (num_ranks, 1)))
    return results, received, remote

  profiles: dict = {}  # filled by measure() with JAX_EP_PROFILE=1
  results, received, remote = measure(tokens, bare=baselines, baselines=baselines)
  bytes_of = {"BF16": 2 * hidden, "FP8": hidden + 4 * (hidden // 128)}
  for (name, system), us in results.items():
    if us is None:
      continue
    width = bytes_of["FP8" if "FP8" in name else "BF16"]
    base = None
    if system == "jax_ep":
      base = results.get((name.replace("FP8", "BF16"), "all_to_all"))
    if name == "layout":  # no rows move: time only
      label = "get_dispatch_layout"
      rows.append(Row(label, f"jax_ep ({jax_ep.runtime_state().backend_name} backend)"
                      if system == "jax_ep" else "portable (jnp)",
                      us, gbps=None, nvlink_gbps=None, baseline_us=base))
      continue
    system = {"all_to_all": "all_to_all (portable)",
              "jax_ep": f"jax_ep ({jax_ep.runtime_state().backend_name} backend)"}.get(
                  system, system)
    label = f"HT {name}" if name != "bare all_to_all" else f"bare all_to_all [R,{tokens},H]"
    rows.append(Row(label, system, us,
                    gbps=(received if name != "bare all_to_all" else num_ranks * tokens)
                    * width / us / 1e3,
                    nvlink_gbps=remote * width / us / 1e3 if name != "bare all_to_all" else None,
                    baseline_us=base))
  meta.update(received_rows=received, remote_rows=remote)
  if profiles:
    meta["kernel_profile"] = profiles
  if ragged:
    return rows, meta
  if sm_sweep:
    budget = []
    for n in sm_sweep:
      res, _, _ = measure(tokens, bare=False, baselines=False, num_sms=n)
      budget.append(dict(num_sms=n, **{f"{k} {s}": us for (k, s), us in res.items()}))
    meta["sm_sweep"] = budget
  if sweep:
    curve = []
    for t in (128, 256, 512, 1024, 2048, 4096, 8192):
      res, rec, rem = measure(t, bare=False)
      curve.append(dict(tokens=t, received_rows=rec, remote_rows=rem,
                        **{f"{n} {s}": us for (n, s), us in res.items()}))
    meta["sweep"] = curve
    if plot and rank == 0:
      _plot(curve, hidden, plot)
  return rows, meta


def timeline(trace: list[list[int]]) -> dict[str, float]:
  """Median us of each step of an HT dispatch over the traced calls
  (DeviceProfile::ht_trace rows, events in cuda/ep_types.h HtTraceEvent order:
  start, masks, scan, plan built, counts in, send end, receive end, end).
  Medians, because the first call of each execution waits for the other
  process to launch it (milliseconds), which an average would spread over all."""
  rows = np.asarray(trace, dtype=np.int64)
  steps: dict[str, list[float]] = {}
  names = ("masks", "scan", "tile_bases", "count_exchange", "send_role", "recv_role", "kernel",
           "gap_to_next_call", "cycle")
  for i, row in enumerate(rows):
    nxt = rows[(i + 1) % len(rows)]
    if np.any(row == 0) or np.any(np.diff(row[[0, 1, 2, 3, 4, 7]]) < 0):
      continue
    values = [row[1] - row[0], row[2] - row[1], row[3] - row[2], row[4] - row[3],
              row[5] - row[0], row[6] - row[0], row[7] - row[0]]
    if nxt[0] > row[7]:
      values += [nxt[0] - row[7], nxt[0] - row[0]]
    for name, ns in zip(names, values):
      steps.setdefault(name, []).append(ns / 1e3)
  return {name: float(np.median(v)) for name, v in steps.items()}


def _plot(curve: list[dict], hidden: int, path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
  systems = [k for k in curve[0] if k not in ("tokens", "received_rows", "remote_rows")]
  for key in systems:
    width = hidden + 4 * (hidden // 128) if "FP8" in key else 2 * hidden
    points = [(c["tokens"], c[key], c["received_rows"]) for c in curve if c.get(key)]
    if not points:
      continue
    style = "-" if key.endswith("jax_ep") else "--"
    ax_t.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=key)
    ax_b.plot([p[0] for p in points], [rows * width / us / 1e3 for _, us, rows in points], style,
              marker="o", label=key)
  for ax, label in ((ax_t, "us per call"), (ax_b, "GB/s (received bytes / time)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(f"HT dispatch/combine vs tokens per rank (hidden {hidden})")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
