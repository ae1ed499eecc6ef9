"""Runs each jax_ep kernel of the EP1 bench a few times, for Nsight Compute.

One process on one GPU, the bench's shapes (jax_ep/bench/ll.py, ht.py): mode
"ll" runs the LL dispatch (FP8, BF16, no rows) and combine (BF16, no rows),
mode "ht" the HT dispatch (BF16, FP8) and combine at 24 SMs, each op
``CALLS`` times under jit(shard_map), in that order. Run it under ncu with XLA's
command buffers off, so that each call is one plain launch. With ncu's default
kernel replay it did not profile these kernels (2026-12-01, docs/history.md:
the replay backs up the process's device memory, the NVSHMEM heap among it).
Not part of the library.
    XLA_FLAGS=--xla_gpu_enable_command_buffer= ncu --clock-control none \
        -k regex:"ll_dispatch|ll_combine|ht_dispatch|ht_combine" \
        python tools/ncu_probe.py ll|ht
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import jax_ep
from jax_ep.bench import ht, ll, timing
from jax_ep.bench.common import deepep_routing, random_rows
from jax_ep.types import LowLatencyHandle

CALLS = 2
TOKENS = {"ll": 128, "ht": 4096}
HIDDEN, EXPERTS, TOPK = 7168, 256, 8


def _run(name: str, op, mesh, local_args) -> None:
  fn = timing.executable(op, mesh, 1)  # the bench's executable, one call
  args = [timing.global_array(mesh, a) for a in local_args]
  for _ in range(CALLS):
    jax.block_until_ready(fn(*args))
  print(f"ncu_probe: {name}: {CALLS} calls", flush=True)


def ll_ops(mesh) -> None:
  tokens = TOKENS["ll"]
  config = ll.config_for(tokens, HIDDEN, EXPERTS, TOPK)
  jax_ep.initialize(config, mesh)
  rng = np.random.default_rng(0)
  x = random_rows(rng, (tokens, HIDDEN))
  idx = deepep_routing(rng, tokens, EXPERTS, TOPK)
  w = rng.random((tokens, TOPK)).astype(np.float32)
  nothing = np.full_like(idx, -1)

  def dispatch(fp8):
    return lambda x, i: jax_ep.low_latency_dispatch(x, i, config=config, use_fp8=fp8)

  def combine(y, i, w, s, c):
    handle = LowLatencyHandle(recv_src=s, count=c, config=config, num_tokens=tokens)
    return jax_ep.low_latency_combine(y, i, w, handle, config=config)

  def dispatch_once(x, i):
    d = jax_ep.low_latency_dispatch(x, i, config=config)
    return d.x, d.handle.recv_src, d.count
  once = jax.jit(jax.shard_map(dispatch_once, mesh=mesh, in_specs=jax.P("ep"),
                               out_specs=jax.P("ep")))
  y, recv_src, count = (timing.local_part(o) for o in once(timing.global_array(mesh, x),
                                                          timing.global_array(mesh, idx)))
  y_shape = (EXPERTS, tokens)
  y = y.reshape(y_shape + (HIDDEN,))
  _run("LL dispatch FP8", dispatch(True), mesh, [x, idx])
  _run("LL dispatch BF16", dispatch(False), mesh, [x, idx])
  _run("LL combine BF16", combine, mesh, [y, idx, w, recv_src, count])
  _run("LL dispatch, no rows", dispatch(False), mesh, [x, nothing])
  _run("LL combine, no rows", combine, mesh,
       [np.zeros_like(y), nothing, w, np.full(y_shape, -1, np.int32),
        np.zeros(y_shape[:1], np.int32)])


def ht_ops(mesh) -> None:
  # pylint: disable=protected-access
  setup = ht._setup(mesh, TOKENS["ht"], HIDDEN, EXPERTS, TOPK, 0, 24)  # the bench's setup at 24 SMs
  inputs = ht._inputs(setup)
  for name, op in ht.jax_ep_ops(setup.config).items():
    args = inputs[name]
    _run(f"HT {name}", op, mesh, args() if callable(args) else args)


def main() -> None:
  mode = sys.argv[1] if len(sys.argv) > 1 else "ll"
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  {"ll": ll_ops, "ht": ht_ops}[mode](mesh)
  jax_ep.finalize()


if __name__ == "__main__":
  main()
