"""LL benchmark: decoding-size batches (DeepEP's LL test settings by default).

Ours (CUDA kernels, FP8 and BF16 dispatch, BF16 combine) against the same
exchange on the portable backend (jax.lax.all_to_all plus the packing it
needs), timed the same way in the same run, plus the bare all_to_all of one
[R, T, H] bf16 buffer for scale.
"""

from __future__ import annotations

import os

import jax
import numpy as np

import jax_ep
from jax_ep.backends.xla import XlaBackend
from jax_ep.bench import timing
from jax_ep.bench.common import Row, deepep_routing, random_rows
from jax_ep.types import LowLatencyHandle


def run(tokens: int, hidden: int, num_experts: int, num_topk: int, num_calls: int,
        repeats: int, seed: int) -> tuple[list[Row], dict]:
  num_ranks = jax.device_count()
  rank = jax.process_index()
  mesh = jax.make_mesh((num_ranks,), ("ep",))
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=tokens,
                           num_topk=num_topk, enable_high_throughput=False)
  jax_ep.initialize(config, mesh)
  portable = XlaBackend()
  rng = np.random.default_rng(seed + rank)
  x = random_rows(rng, (tokens, hidden))
  idx = deepep_routing(rng, tokens, num_experts, num_topk)
  w = rng.random((tokens, num_topk)).astype(np.float32)

  # One dispatch for the row counts and the combine inputs.
  def dispatch_once(x, idx):
    d = jax_ep.low_latency_dispatch(x, idx, config=config)
    return d.x, d.count, d.handle.recv_src
  once = jax.jit(jax.shard_map(dispatch_once, mesh=mesh, in_specs=jax.P("ep"),
                               out_specs=jax.P("ep")))
  glob = lambda a: timing.global_array(mesh, a)  # noqa: E731
  y, count, recv_src = (np.asarray(o.addressable_shards[0].data) for o in once(glob(x), glob(idx)))
  recv_rows = int(count.sum())
  experts_per_rank = num_experts // num_ranks
  # Rows from other ranks: those whose source rank differs.
  valid = np.arange(recv_src.shape[1])[None, :] < count[:, None]
  remote_rows = int(np.sum(valid & (recv_src // tokens != rank)))

  def ours_dispatch(use_fp8):
    return lambda x, idx: jax_ep.low_latency_dispatch(x, idx, config=config, use_fp8=use_fp8)

  def base_dispatch(use_fp8):
    return lambda x, idx: portable.ll_dispatch(x, idx, config, use_fp8)[0]

  def handle(recv_src, count):
    return LowLatencyHandle(recv_src=recv_src, count=count, config=config, num_tokens=tokens)

  def ours_combine(y, idx, w, recv_src, count):
    return jax_ep.low_latency_combine(y, idx, w, handle(recv_src, count), config=config)

  def base_combine(y, idx, w, recv_src, count):
    return portable.ll_combine(y, idx, w, handle(recv_src, count))

  def bare_all_to_all(x):
    return jax.lax.all_to_all(x.reshape(num_ranks, -1, hidden), "ep", 0, 0, tiled=True)

  t = lambda op, *args: timing.time_per_call(op, mesh, args, num_calls, repeats)  # noqa: E731
  ours_name = f"jax_ep ({jax_ep.runtime_state().backend_name} backend)"
  profiles = {}

  def profiled(label, op, *args):
    """Times ours; with JAX_EP_PROFILE=1 also keeps the in-kernel breakdown."""
    cuda = jax_ep.runtime_state().cuda
    if cuda is None or os.environ.get("JAX_EP_PROFILE") != "1":
      return t(op, *args)
    result = timing.time_per_call(op, mesh, args, num_calls, repeats,
                                  after_warmup=cuda.module.read_profile)  # resets the counters
    profiles[label] = cuda.module.read_profile()
    return result
  bytes_fp8 = hidden + 4 * (hidden // 128)
  bytes_bf16 = 2 * hidden
  rows: list[Row] = []
  for use_fp8, row_bytes, label in ((True, bytes_fp8, "FP8"), (False, bytes_bf16, "BF16")):
    ours = profiled(f"dispatch {label}", ours_dispatch(use_fp8), x, idx)
    base = t(base_dispatch(use_fp8), x, idx)
    for system, res, baseline in ((ours_name, ours, base.median_us),
                                  ("all_to_all (portable)", base, None)):
      us = timing.gather_max(res.median_us)
      rows.append(Row(f"LL dispatch {label}", system, us,
                      gbps=recv_rows * row_bytes / us / 1e3,
                      nvlink_gbps=remote_rows * row_bytes / us / 1e3,
                      baseline_us=timing.gather_max(baseline) if baseline else None))
  y_local = y.reshape(experts_per_rank, num_ranks * tokens, hidden)
  ours = profiled("combine BF16", ours_combine, y_local, idx, w, recv_src, count)
  base = t(base_combine, y_local, idx, w, recv_src, count)
  for system, res, baseline in ((ours_name, ours, base.median_us),
                                ("all_to_all (portable)", base, None)):
    us = timing.gather_max(res.median_us)
    rows.append(Row("LL combine BF16", system, us, gbps=recv_rows * bytes_bf16 / us / 1e3,
                    nvlink_gbps=remote_rows * bytes_bf16 / us / 1e3,
                    baseline_us=timing.gather_max(baseline) if baseline else None))
  # The protocol's fixed cost: the same calls moving no rows.
  nothing = np.full_like(idx, -1)
  empty_dispatch = profiled("dispatch, no rows", ours_dispatch(False), x, nothing)
  rows.append(Row("LL dispatch, no rows", ours_name, timing.gather_max(empty_dispatch.median_us),
                  note="all top-k entries -1: launch, flags and waits only"))
  empty_recv_src = np.full_like(recv_src, -1)
  empty_combine = profiled("combine, no rows", ours_combine, y_local, nothing, w, empty_recv_src,
                           np.zeros_like(count))
  rows.append(Row("LL combine, no rows", ours_name, timing.gather_max(empty_combine.median_us),
                  note="no rows: launch, flags and waits only"))
  bare = t(bare_all_to_all, np.tile(x, (num_ranks, 1)))
  rows.append(Row(f"bare all_to_all [R,{tokens},H]", "jax.lax.all_to_all", 
                  timing.gather_max(bare.median_us),
                  gbps=num_ranks * tokens * bytes_bf16 / timing.gather_max(bare.median_us) / 1e3,
                  note="each token once per rank, no routing or packing"))
  meta = dict(tokens_per_rank=tokens, hidden=hidden, num_experts=num_experts, topk=num_topk,
              num_ranks=num_ranks, received_rows_rank0_or_self=recv_rows,
              remote_rows=remote_rows, num_calls=num_calls, repeats=repeats,
              kernel_profile_rank=rank, kernel_profile=profiles)
  return rows, meta
