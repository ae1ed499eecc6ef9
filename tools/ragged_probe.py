"""Where does the ragged_all_to_all baseline stall? Timestamps per stage.

    python -m jax_ep.launch -n 2 tools/ragged_probe.py [tokens]
    tools/ragged_probe.sh   # several XLA flag variants, each under a time limit

Stage 1 runs MaxText's ragged_all_to_all dispatch in plain JAX (no jax_ep, no
NVSHMEM); stage 2 the same after jax_ep.initialize. Each stage: compile, one
call, then 3 calls. Run under `timeout`: the last line printed says where it
stopped.
"""

import os
import sys
import time

# RAGGED_PROBE_FLAGS: the XLA flags under test (tools/ragged_probe.sh tries
# several); default: the NCCL send/recv fallback the benchmark uses.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + os.environ.get(
    "RAGGED_PROBE_FLAGS", "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"))

from jax_ep import launch  # noqa: E402

launch.initialize_distributed_from_env()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.bench.common import deepep_routing, random_rows  # noqa: E402
from jax_ep.bench import ragged  # noqa: E402
from jax_ep.bench.timing import global_array  # noqa: E402

START = time.perf_counter()


def say(what: str) -> None:
  print(f"[{time.perf_counter() - START:7.2f} s] {what}", flush=True)


def stage(name: str, config: jax_ep.EpConfig, mesh, x, idx) -> None:
  fn = jax.jit(jax.shard_map(lambda x, i: ragged.dispatch(x, i, config)[0], mesh=mesh,
                             in_specs=jax.P("ep"), out_specs=jax.P("ep")))
  args = (global_array(mesh, x), global_array(mesh, idx))
  say(f"{name}: compiling")
  compiled = fn.lower(*args).compile()
  say(f"{name}: compiled; first call")
  jax.block_until_ready(compiled(*args))
  say(f"{name}: first call done; 3 more")
  start = time.perf_counter()
  for _ in range(3):
    jax.block_until_ready(compiled(*args))
  say(f"{name}: {1e3 * (time.perf_counter() - start) / 3:.1f} ms per call (host-timed)")


def main() -> None:
  tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
  hidden, num_experts, num_topk = 7168, 256, 8
  mesh = jax.make_mesh((jax.device_count(),), ("ep",))
  rng = np.random.default_rng(jax.process_index())
  x = random_rows(rng, (tokens, hidden))
  idx = deepep_routing(rng, tokens, num_experts, num_topk)
  config = jax_ep.EpConfig(num_experts=num_experts, hidden=hidden, max_tokens_per_rank=tokens,
                           num_topk=num_topk, enable_low_latency=False)
  stage("plain JAX", config, mesh, x, idx)
  jax_ep.initialize(config, mesh)
  say("jax_ep initialized")
  stage("after jax_ep.initialize", config, mesh, x, idx)
  jax_ep.finalize()
  say("done")


if __name__ == "__main__":
  main()
