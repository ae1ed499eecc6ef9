"""Start-up of the CUDA backend: one JAX process per GPU, NVSHMEM, symmetric buffers.

Called by ``jax_ep.initialize`` when the CUDA backend is chosen. NVSHMEM spans
every process of the job (PE = jax.process_index()); the mesh's EP groups are
sets of PEs, and the kernels address peers by EP rank through a per-process
table of the group's PEs (cuda/transport.cuh). Every step is collective over
all processes; the JAX distributed key-value store carries the NVSHMEM unique
id and the consistency checks (keys under ``jax_ep/``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import socket
import sys
from typing import Callable

import jax
from absl import logging

from jax_ep import _extension
from jax_ep import groups
from jax_ep.buffers import buffer_bytes, buffer_bytes_by_family, sizing_config
from jax_ep.config import EpConfig, describe_differences
from jax_ep.errors import EpConfigError, EpError

_KV_TIMEOUT_MS = 300_000
_generation = itertools.count()

# NVLink multicast (NVLS) must stay off on shared machines; harmless elsewhere.
_NVSHMEM_ENV_DEFAULTS = {"NVSHMEM_DISABLE_NVLS": "1"}


def nvshmem_environment(hostnames: list[str], environ) -> dict[str, str]:
  """What jax_ep sets for NVSHMEM before it starts, given every process's host:
  its defaults that the environment does not set already. One host: no remote
  transport (NVSHMEM would otherwise look for InfiniBand devices); several:
  NVSHMEM's own choice (set NVSHMEM_REMOTE_TRANSPORT to pick one)."""
  wanted = dict(_NVSHMEM_ENV_DEFAULTS)
  if len(set(hostnames)) == 1:
    wanted["NVSHMEM_REMOTE_TRANSPORT"] = "none"
  return {key: value for key, value in wanted.items() if key not in environ}


def missing_distributed_setup(environ) -> str:
  """Why several processes cannot find each other yet, and what to do."""
  if any(key in environ for key in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                                    "OMPI_MCA_orte_hnp_uri")):
    return ("jax_ep: this process runs under SLURM or Open MPI but jax.distributed is not "
            "initialised: call jax.distributed.initialize() (it reads the cluster's "
            "variables) before jax_ep.initialize")
  return ("jax_ep: jax.distributed is not initialised: launch with python -m jax_ep.launch, or "
          "call jax.distributed.initialize(coordinator_address, num_processes, process_id, "
          "local_device_ids=[gpu]) in every process first")

# Testing only: EP ranks the kernels treat as reachable only by RDMA, "all"
# (every other rank) or a comma-separated list, so that the RDMA branch of the
# LL kernels runs over NVSHMEM's own P2P transport on one node (docs/reliability.md).
TESTING_RDMA_PEERS_ENV = "JAX_EP_TESTING_RDMA_PEERS"


@dataclasses.dataclass
class CudaRuntime:
  """The CUDA backend's process state (one per process), and the only caller of
  the compiled module jax_ep._jax_ep_cuda (NVSHMEM, buffers, fault word, mask).

  Attributes:
    module: the compiled module.
    config: the EpConfig the buffers are sized for: the sizing_config of
      ``configs`` (jax_ep/buffers.py), the element-wise maximum of their sizes.
    group: this process's EP group (its PEs, its EP rank).
    rdma_staging: whether RDMA staging buffers were allocated.
    configs: the configs given to initialize(), which the buffers serve.
  """

  module: object
  config: EpConfig
  group: groups.EpGroup
  rdma_staging: bool
  group_pes: tuple[int, ...] = ()
  joined: bool = False
  configs: tuple[EpConfig, ...] = ()

  # group_pes[r]: the NVSHMEM PE of EP rank r (= its process index, unless jax_ep
  # joined an NVSHMEM runtime another library started, with its own numbering):
  # what a user's own NVSHMEM code (nvshmem4py) needs to address this EP group.
  # joined: NVSHMEM was up before jax_ep (it is then its starter's to finalise).

  @property
  def num_ranks(self) -> int:
    return self.group.size

  @property
  def rank(self) -> int:
    return self.group.rank

  def status(self) -> dict:
    """The host-mapped fault word (no GPU sync): code, op, peer, detail, fault_count."""
    return self.module.status()

  def masked(self) -> list[int]:
    """EP ranks masked in the kernels' view (host-mapped mirror: set by the host,
    or by a kernel with mask_on_timeout)."""
    return self.module.masked()

  def set_masked(self, ranks) -> None:
    """The kernels' mask: exactly `ranks` from the next call on."""
    self.module.set_masked(sorted(ranks))

  def probe_peers(self) -> list[bool]:
    """Load/store reachability of each EP rank of the group."""
    reachable = self.module.probe_peers()
    return [reachable[pe] for pe in self.group_pes]

  def read_profile(self) -> dict:
    """The in-kernel profile (JAX_EP_PROFILE=1 at initialize), read and reset; syncs."""
    return dict(self.module.read_profile())

  def release_buffers(self) -> None:
    self.module.release_buffers()


def finalize(runtime: CudaRuntime | None) -> str:
  """Tears NVSHMEM down if it is up (also after a switch to the portable
  backend, when no CudaRuntime is left); returns "" or why the collective
  teardown was skipped (a peer did not arrive: the process should exit)."""
  module = runtime.module if runtime is not None else sys.modules.get("jax_ep._jax_ep_cuda")
  if module is None or not module.initialized():
    return ""
  return module.finalize()


def _client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


def _exchange(key: str, value: bytes) -> list[bytes]:
  """Every process publishes ``value``; returns every process's value (KV store)."""
  count = jax.process_count()
  if count == 1:
    return [value]
  client = _client()
  client.key_value_set_bytes(f"{key}/{jax.process_index()}", value)
  return [client.blocking_key_value_get_bytes(f"{key}/{p}", _KV_TIMEOUT_MS)
          for p in range(count)]


def testing_rdma_peers(rank: int, num_ranks: int) -> list[int]:
  """The ranks JAX_EP_TESTING_RDMA_PEERS names (never this rank), or []."""
  value = os.environ.get(TESTING_RDMA_PEERS_ENV, "").strip()
  if not value:
    return []
  if value == "all":
    return [r for r in range(num_ranks) if r != rank]
  try:
    ranks = sorted({int(part) for part in value.split(",") if part.strip()})
  except ValueError:
    raise EpConfigError(f"{TESTING_RDMA_PEERS_ENV}={value!r}: expected 'all' or a comma-separated "
                        "list of EP ranks") from None
  if any(not 0 <= r < num_ranks for r in ranks):
    raise EpConfigError(f"{TESTING_RDMA_PEERS_ENV}={value!r}: ranks must be in [0, {num_ranks})")
  return [r for r in ranks if r != rank]


def _process_group(config: EpConfig, mesh: jax.sharding.Mesh) -> groups.EpGroup:
  """This process's EP group: one JAX process per GPU, every process one mesh device."""
  if jax.local_device_count() != 1:
    raise EpError(
        f"jax_ep's CUDA backend needs one JAX process per GPU (NVSHMEM PEs are processes), "
        f"but this process drives {jax.local_device_count()} devices. Start one process per GPU "
        "(`python -m jax_ep.launch -n <num_gpus> your_script.py`, or jax.distributed.initialize() "
        "under SLURM / Open MPI with one task per GPU), or pass backend='xla'.")
  owners = sorted(d.process_index for d in mesh.devices.flat)
  if owners != list(range(jax.process_count())):
    raise EpError(
        f"jax_ep's CUDA backend needs the mesh to hold exactly one device of every process (one "
        f"NVSHMEM PE each): the mesh's {mesh.devices.size} devices belong to processes "
        f"{sorted(set(owners))} of {jax.process_count()}")
  if "xla_gpu_experimental_enable_nvshmem=true" in os.environ.get("XLA_FLAGS", "").replace(
      " ", "").lower():
    raise EpError(
        "jax_ep starts NVSHMEM itself; remove --xla_gpu_experimental_enable_nvshmem from "
        "XLA_FLAGS (XLA's own NVSHMEM would initialise the same library a second time)")
  return groups.group_of(mesh, config.axis_names, jax.local_devices()[0].id)


def _bootstrap(module, config: EpConfig, group_size: int, device: int, generation: int) -> None:
  """Starts NVSHMEM over every process: PE = jax.process_index()."""
  pe, npes = jax.process_index(), jax.process_count()
  if npes > 1 and _client() is None:
    raise EpError(missing_distributed_setup(os.environ))
  hosts = [h.decode() for h in _exchange(f"jax_ep/{generation}/host",
                                          socket.gethostname().encode())]
  chosen = nvshmem_environment(hosts, os.environ)
  os.environ.update(chosen)
  if chosen:
    logging.info("jax_ep: NVSHMEM environment %s (%d host(s))", chosen, len(set(hosts)))
  # Reserve the first config's buffers up front (the heap can grow later).
  os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE",
                        str(buffer_bytes(config, group_size, rdma_staging=True) + (256 << 20)))
  key = f"jax_ep/{generation}/nvshmem_uid"
  if pe == 0:
    uid = module.get_unique_id()
    if npes > 1:
      _client().key_value_set_bytes(key, uid)
  else:
    uid = _client().blocking_key_value_get_bytes(key, _KV_TIMEOUT_MS)
  try:
    module.init(pe, npes, uid, device)
  except RuntimeError as e:
    raise EpError(str(e)) from None


def _different_configs(per_process: list[tuple[EpConfig, ...]]) -> str:
  """What differs between process 0's configs and the first process's that
  differ: the fields of each config, or the counts."""
  mine = per_process[0]
  for p, theirs in enumerate(per_process):
    if theirs == mine:
      continue
    if len(theirs) != len(mine):
      return f"process 0 passed {len(mine)} configs, process {p} {len(theirs)}"
    return "; ".join(
        f"configs[{i}]: " + describe_differences(a, b, "process 0", f"process {p}")
        for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
  return ""


def initialize(configs: tuple[EpConfig, ...], mesh: jax.sharding.Mesh,
               previous: CudaRuntime | None, *, reallocate: bool = False,
               before_buffers_move: Callable[[], None] = lambda: None) -> CudaRuntime:
  """Brings up the CUDA runtime for ``configs`` on ``mesh``, or re-sizes it.

  One set of symmetric buffers serves every config: it is allocated for
  ``sizing_config(configs)``. It is re-allocated (collective;
  ``before_buffers_move`` runs first: the runtime drops JAX's caches there,
  since executables hold the buffers' addresses) when that
  sizing, the EP group or the RDMA staging differs from ``previous``'s, or
  when ``reallocate`` (on any process: they all decide alike); otherwise
  ``previous``'s buffers are kept and the executables compiled for them stay
  valid.
  """
  config = sizing_config(configs)
  module = _extension.cuda_module()
  if module is None:
    raise EpError(f"jax_ep's CUDA backend is unavailable: {_extension.cuda_module_status()}")
  group = _process_group(config, mesh)
  num_ranks, rank = group.size, group.rank
  jax.devices()  # JAX's GPU client first: it owns the CUDA primary context
  device = jax.local_devices()[0].local_hardware_id
  generation = next(_generation)
  if previous is None or not module.initialized():
    previous = None  # nothing allocated survives a finalised runtime
    if module.nvshmem_already_initialized():
      # nvshmem4py (or another library) started NVSHMEM in this process: join it.
      try:
        module.init(-1, -1, b"", device)
      except RuntimeError as e:
        raise EpError(str(e)) from None
      logging.info("jax_ep: joined the NVSHMEM runtime already started in this process "
                   "(PE %d)", module.my_pe())
    else:
      _bootstrap(module, config, num_ranks, device, generation)
  # Every process's PE (its process index, unless a joined runtime numbers them
  # otherwise), so that EP ranks map to PEs.
  pe_of_process = [int(v) for v in _exchange(f"jax_ep/{generation}/pe",
                                             str(module.my_pe()).encode())]
  group_pes = tuple(pe_of_process[p] for p in group.processes)

  forced_rdma = testing_rdma_peers(rank, num_ranks)
  module.set_rdma_only_peers([group_pes[r] for r in forced_rdma])
  if forced_rdma:
    logging.warning("jax_ep TESTING: EP ranks %s are treated as reachable only by RDMA (%s): the "
                    "kernels take their RDMA branch over NVSHMEM's P2P transport. For tests only.",
                    forced_rdma, TESTING_RDMA_PEERS_ENV)
  per_process = [pickle.loads(c) for c in
                 _exchange(f"jax_ep/{generation}/config", pickle.dumps(tuple(configs)))]
  if any(c != tuple(configs) for c in per_process):
    raise EpConfigError(f"jax_ep.initialize: the processes passed different configs: "
                        f"{_different_configs(per_process)}")
  # The symmetric heap's layout must be the same on every PE, so RDMA staging is
  # allocated everywhere as soon as one group needs it.
  reachable = module.probe_peers()  # by PE
  needs_rdma = b"0" if all(reachable[pe] for pe in group_pes) else b"1"
  rdma_staging = b"1" in _exchange(f"jax_ep/{generation}/rdma", needs_rdma)
  if rdma_staging and config.enable_high_throughput:
    raise EpError(
        "jax_ep: the high-throughput kernels need every EP peer reachable by NVLink; some are "
        "only reachable by RDMA (docs/design.md describes the internode design). Use "
        "EpConfig(enable_high_throughput=False) for the low-latency ops over RDMA"
        + (" (in every config given to initialize)" if len(configs) > 1 else "") + ".")
  keeps = (not reallocate and previous is not None and module.allocated()
           and previous.config == config and previous.group == group
           and previous.group_pes == group_pes and previous.rdma_staging == rdma_staging)
  # Allocation is collective: every process re-allocates if any must.
  if b"1" in _exchange(f"jax_ep/{generation}/allocate", b"0" if keeps else b"1"):
    if previous is not None:
      before_buffers_move()
    _allocate(module, config, configs, group_pes, rank, num_ranks, rdma_staging)
  module.set_mask_on_timeout(bool(config.mask_on_timeout))
  if config.mask_on_timeout and num_ranks > 1 and not jax.config.jax_enable_recoverability:
    logging.warning(
        "jax_ep: mask_on_timeout keeps serving after an EP rank is lost, but JAX's coordination "
        "service aborts every process about heartbeat_timeout_seconds (default 100 s) after one "
        "dies unless recoverability is on: set JAX_ENABLE_RECOVERABILITY=1 (or "
        "jax.config.update('jax_enable_recoverability', True)) before jax.distributed."
        "initialize (docs/reliability.md)")
  return CudaRuntime(module=module, config=config, group=group, rdma_staging=rdma_staging,
                     group_pes=group_pes, joined=bool(module.joined()), configs=tuple(configs))


def _allocate(module, config: EpConfig, configs: tuple[EpConfig, ...], group_pes: tuple[int, ...],
              rank: int, num_ranks: int, rdma_staging: bool) -> None:
  """(Re)allocates the symmetric buffers for ``config``, the sizing of ``configs``."""
  families = buffer_bytes_by_family(config, num_ranks, rdma_staging=rdma_staging)
  sizes = (f"low latency {families['low_latency'] / 2**30:.2f} GiB for "
           f"{config.ll_max_tokens} tokens per rank, high throughput "
           f"{families['high_throughput'] / 2**30:.2f} GiB for {config.max_tokens_per_rank} "
           "tokens per rank")
  if len(configs) > 1:
    sizes += (f"; sized for the {len(configs)} configs together: E={config.num_experts}, "
              f"H={config.hidden}, K={config.num_topk}, each the largest of any config")
  try:
    module.allocate(list(group_pes), rank, config.num_experts, config.hidden,
                    config.max_tokens_per_rank, config.ll_max_tokens, config.num_topk,
                    config.enable_low_latency, config.enable_high_throughput, rdma_staging,
                    float(config.timeout_s), int(config.num_sms or 0))
  except RuntimeError as e:
    raise EpError(f"{e} [{sizes}: lower EpConfig.low_latency_max_tokens_per_rank or "
                  "max_tokens_per_rank, or set enable_low_latency / enable_high_throughput "
                  "to False for a family you do not use]") from None
  logging.info("jax_ep: %.2f GiB of symmetric GPU memory on EP rank %d of %d (%s)%s",
               sum(families.values()) / 2**30, rank, num_ranks, sizes,
               ", with RDMA staging" if rdma_staging else "")
