"""Standard launchers: processes started by SLURM or Open MPI (one task per device),
that call jax.distributed.initialize() with no arguments, work without jax_ep.launch.

Two CPU processes get the variables those launchers set; each calls
jax.distributed.initialize() (JAX's cluster auto-detection), then jax_ep.initialize
on a mesh of one device per process (the portable backend here), runs a dispatch
and combine, and reports what the CUDA backend's start-up would set for NVSHMEM
(cuda_runtime.nvshmem_environment over the hosts gathered through JAX's key-value
store).
"""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from jax_ep import cuda_runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = textwrap.dedent("""
    import os
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    jax.distributed.initialize()  # auto-detected from the launcher's variables
    import jax_ep
    from jax_ep import cuda_runtime

    rank, count = jax.process_index(), jax.process_count()
    hosts = [h.decode() for h in cuda_runtime._exchange("test/hosts", b"node-a")]
    print("nvshmem env", rank, sorted(cuda_runtime.nvshmem_environment(hosts, {}).items()))
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    mesh = jax.make_mesh((count,), ("ep",), devices=devices)
    config = jax_ep.EpConfig(num_experts=4, hidden=16, max_tokens_per_rank=4, num_topk=2)
    jax_ep.initialize(config, mesh)
    spec = P("ep")
    x = np.full((1, 4, 16), rank + 1, np.float32)
    idx = np.tile(np.array([[0, 3]], np.int32), (1, 4, 1))
    w = np.ones((1, 4, 2), np.float32)
    args = [jax.make_array_from_process_local_data(NamedSharding(mesh, spec), a,
                                                   (count,) + a.shape[1:]) for a in (x, idx, w)]
    def fn(x, i, w):
      d = jax_ep.dispatch(x[0], i[0], w[0], config=config)
      return jax_ep.combine(d.x, d.handle, config=config)[None]
    out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(*args)
    # Experts 0 and 3 live on ranks 0 and 1: every token comes back twice.
    value = float(np.asarray(out.addressable_shards[0].data)[0, 0, 0])
    print("combined", rank, count, value)
    jax_ep.finalize()
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launcher_env(kind: str, rank: int, port: int) -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_EP_"))}
  env.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_PORT=str(port), PYTHONUNBUFFERED="1")
  env.pop("XLA_FLAGS", None)  # one CPU device per process
  if kind == "slurm":
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_STEP_NUM_NODES="1")
  else:  # Open MPI 4 (ORTE): the launcher's URI names the coordinator's address
    env.update(OMPI_MCA_orte_hnp_uri="1531576320.0;tcp://127.0.0.1:34911",
               OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK=str(rank),
               OMPI_COMM_WORLD_LOCAL_RANK=str(rank), OMPI_VERSION="4.1.5")
  return env


@pytest.mark.parametrize("kind", ["slurm", "openmpi"])
def test_processes_of_a_standard_launcher_run_without_jax_ep_launch(kind):
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT,
                            env=_launcher_env(kind, rank, port), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for rank in range(2)]
  outs = [p.communicate(timeout=180)[0] for p in procs]
  for rank, (proc, out) in enumerate(zip(procs, outs)):
    assert proc.returncode == 0, out[-3000:]
    assert f"combined {rank} 2 {2.0 * (rank + 1)}" in out, out[-2000:]
    assert (f"nvshmem env {rank} [('NVSHMEM_DISABLE_NVLS', '1'), "
            "('NVSHMEM_REMOTE_TRANSPORT', 'none')]") in out, out[-2000:]


def test_nvshmem_environment_keeps_what_the_user_set():
  assert cuda_runtime.nvshmem_environment(["a", "a"], {}) == {
      "NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_REMOTE_TRANSPORT": "none"}
  # Several hosts: NVSHMEM picks its remote transport (InfiniBand) itself.
  assert cuda_runtime.nvshmem_environment(["a", "b"], {}) == {"NVSHMEM_DISABLE_NVLS": "1"}
  assert cuda_runtime.nvshmem_environment(["a"], {"NVSHMEM_REMOTE_TRANSPORT": "ucx"}) == {
      "NVSHMEM_DISABLE_NVLS": "1"}


def test_a_missing_distributed_setup_says_what_to_call():
  assert "jax.distributed.initialize()" in cuda_runtime.missing_distributed_setup(
      {"SLURM_JOB_ID": "1"})
  assert "python -m jax_ep.launch" in cuda_runtime.missing_distributed_setup({})
