"""Process-wide jax_ep state, and its one owner: which backend runs the ops, on
which mesh and EP groups, for which configs, with which ranks masked.

``initialize(configs, mesh)`` is called before jit (collectively, on every
process of the mesh) with every EpConfig the process traces ops with: one, or
several (a model with two MoE shapes, a train and a decode config). The ops
read the state once per trace through ``require`` and hand the backend
everything it needs as arguments, their own config included (the backends keep
no state). On CUDA the state includes the CUDA runtime
(jax_ep/cuda_runtime.py, the only caller of the compiled module), whose device
view of the rank mask is merged here with the host's.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
from typing import Optional, Sequence

import jax
from absl import logging

from jax_ep import _extension
from jax_ep import groups
from jax_ep import masking
from jax_ep.backends.base import Backend
from jax_ep.backends.cuda import CudaBackend
from jax_ep.backends.xla import XlaBackend
from jax_ep.config import EpConfig, check_same_group, differences, describe_differences
from jax_ep.errors import EpConfigError, EpError

BACKENDS = ("auto", "xla", "cuda")


@dataclasses.dataclass(frozen=True)
class RuntimeState:
  """What initialize() established (replaced, never mutated).

  Attributes:
    config: the first config given to initialize() (the only one when one was).
    num_ranks: R, devices per EP group (the product of the EP axes).
    backend: the backend the ops call ("xla" or "cuda").
    mesh: the mesh given to initialize().
    cuda: the CUDA runtime (NVSHMEM, symmetric buffers, its EP group) or None.
    masked: the EP ranks this process masked (jax_ep.mask_rank).
    configs: every config given to initialize(), in the order given (distinct);
      ops may be traced with any of them. () stands for (config,).
  """

  config: EpConfig
  num_ranks: int
  backend: Backend
  mesh: jax.sharding.Mesh
  cuda: Optional["cuda_runtime.CudaRuntime"] = None  # noqa: F821 (imported lazily)
  masked: frozenset[int] = frozenset()
  configs: tuple[EpConfig, ...] = ()

  def __post_init__(self) -> None:
    if not self.configs:
      object.__setattr__(self, "configs", (self.config,))

  @property
  def backend_name(self) -> str:
    return self.backend.name

  def masked_ranks(self) -> tuple[int, ...]:
    """Masked EP ranks: by this process, and on CUDA by a kernel (mask_on_timeout)."""
    on_device = set(self.cuda.masked()) if self.cuda is not None else set()
    return tuple(sorted(self.masked | on_device))

  def live_ranks(self) -> tuple[bool, ...]:
    """masking.live_ranks of this state: () when every rank is live."""
    return masking.live_ranks(self.num_ranks, self.masked_ranks())


_state: Optional[RuntimeState] = None


def _drop_traces(why: str) -> None:
  """The one mechanism by which jitted functions trace again: jax_ep's only
  ``jax.clear_caches()``.

  A trace reads the runtime state once (the held configs, the backend, the
  rank mask) and a compiled executable holds the CUDA buffers' addresses, so
  JAX's caches must go when any of those changes: ``_set_state`` decides for
  the state, and the CUDA runtime calls this before its buffers move."""
  logging.vlog(1, "jax_ep: clearing JAX's caches (%s); jitted functions trace again", why)
  jax.clear_caches()


def _traces_outdated(old: Optional[RuntimeState], new: Optional[RuntimeState]) -> str:
  """Why traces made under ``old`` must not run under ``new``, or ""."""
  if old is None:
    return ""  # no jax_ep op traces without a state
  if new is None:
    return "jax_ep.finalize"
  if not set(old.configs) <= set(new.configs):
    return "a config held before is no longer held"
  if old.backend_name != new.backend_name:
    return f"the backend changed from {old.backend_name} to {new.backend_name}"
  if old.masked != new.masked:
    return "the rank mask changed"
  return ""


def _set_state(new: Optional[RuntimeState]) -> None:
  """The one way the state changes; drops stale traces (``_drop_traces``)."""
  global _state
  old, _state = _state, new
  why = _traces_outdated(old, new)
  if why:
    _drop_traces(why)


def _mesh_platform(mesh: jax.sharding.Mesh) -> str:
  return mesh.devices.flat[0].platform


def _choose_backend(requested: str, mesh: jax.sharding.Mesh) -> str:
  if requested not in BACKENDS:
    raise EpConfigError(f"backend must be one of {BACKENDS}, got {requested!r}")
  if requested != "auto":
    return requested
  if _mesh_platform(mesh) == "gpu" and _extension.cuda_module() is not None:
    return "cuda"
  return "xla"


def _as_configs(configs: EpConfig | Sequence[EpConfig], op: str) -> tuple[EpConfig, ...]:
  """One config or a sequence of them -> a tuple of distinct configs, in order,
  checked to share one EpGroup."""
  given = (configs,) if isinstance(configs, EpConfig) else configs
  if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
    raise EpConfigError(f"jax_ep.{op}() needs an EpConfig or a sequence of them, got "
                        f"{type(configs).__name__}")
  for c in given:
    if not isinstance(c, EpConfig):
      raise EpConfigError(f"jax_ep.{op}() needs EpConfigs, got a {type(c).__name__}")
  distinct = tuple(dict.fromkeys(given))
  if not distinct:
    raise EpConfigError(f"jax_ep.{op}() needs at least one EpConfig")
  check_same_group(distinct, op)
  return distinct


def _group_size(configs: tuple[EpConfig, ...], mesh: jax.sharding.Mesh) -> int:
  """R of the configs' common EP axes on ``mesh``; checks every E is a multiple."""
  groups.check_axes(mesh, configs[0].axis_names)
  num_ranks = groups.group_size(mesh, configs[0].axis_names)
  for c in configs:
    c.experts_per_rank(num_ranks)
  return num_ranks


def initialize(config: EpConfig | Sequence[EpConfig], mesh: jax.sharding.Mesh, *,
               backend: str | None = None) -> None:
  """Prepares jax_ep for ``config`` on ``mesh``; call before jit, on every process.

  ``config``: the EpConfig, or a sequence of every EpConfig, that ops will be
  traced with in this process (e.g. ``initialize((train, decode), mesh)``);
  each call replaces the previous set, so pass them all in one call. They must
  share one ``group`` (jax_ep.EpGroup: one process has one EP group); sizes,
  enable_* flags, debug_checks and fallback may differ, as long as they fit
  the buffers. On CUDA one set of symmetric buffers serves them all, sized for
  the element-wise maximum of their sizes (jax_ep.buffers sizing_config;
  jax_ep.buffer_bytes((a, b), R) gives its bytes), and every kernel runs with
  its own call's sizes.

  Picks the backend (``backend=`` or env ``JAX_EP_BACKEND``: "auto" (default),
  "cuda" or "xla"; auto takes the CUDA kernels when the mesh is on GPUs and
  the CUDA extension loads, else the portable XLA backend) and allocates what
  it needs. Idempotent for the same configs. Another set re-sizes the
  backend's buffers (the transport stays up) when its sizing differs, which
  also clears JAX's caches (executables hold the buffers' addresses); a set
  that drops a config held before clears them too, so a function traced with
  that config is traced again (and refused). Clears every rank mask.

  Raises:
    EpConfigError: the axes are not in the mesh, E is not a multiple of R, or
      the configs' groups differ (the message names both EpGroups).
    EpError: the chosen backend cannot start (the message says why).
  """
  configs = _as_configs(config, "initialize")
  num_ranks = _group_size(configs, mesh)
  choice = _choose_backend(backend or os.environ.get("JAX_EP_BACKEND", "auto"), mesh)
  previous = _state
  if (previous is not None and previous.configs == configs and previous.mesh == mesh
      and previous.backend_name == choice and not previous.masked_ranks()):
    return
  # A set-up with masked ranks starts over on fresh buffers (a masked peer may
  # have left them mid-protocol), as with any change of the CUDA buffers' sizing.
  was_masked = previous is not None and bool(previous.masked_ranks())
  unmask_all()  # masks name ranks of the previous set-up
  if choice == "xla":
    if previous is not None and previous.cuda is not None:
      _drop_traces("the CUDA buffers are released")
      previous.cuda.release_buffers()
    _set_state(RuntimeState(config=configs[0], num_ranks=num_ranks, backend=XlaBackend(),
                            mesh=mesh, configs=configs))
    return
  from jax_ep import cuda_runtime  # pylint: disable=import-outside-toplevel
  runtime = cuda_runtime.initialize(
      configs, mesh, previous.cuda if previous else None, reallocate=was_masked,
      before_buffers_move=lambda: _drop_traces("the CUDA buffers are re-allocated"))
  _set_state(RuntimeState(config=configs[0], num_ranks=num_ranks, backend=CudaBackend(),
                          mesh=mesh, cuda=runtime, configs=configs))


def finalize() -> None:
  """Releases everything initialize() set up (clears JAX's caches first, since
  compiled executables refer to the buffers). Safe to call twice. When an EP
  peer does not come (it died), NVSHMEM's collective teardown is skipped with a
  warning instead of waiting for it: the process should then exit."""
  unmask_all()
  state_before = _state
  _set_state(None)   # executables refer to the buffers: dropped first
  _drop_failed_runtime_tokens()
  from jax_ep import cuda_runtime  # pylint: disable=import-outside-toplevel
  skipped = cuda_runtime.finalize(state_before.cuda if state_before is not None else None)
  if skipped:
    logging.warning("jax_ep.finalize: %s", skipped)


def _drop_failed_runtime_tokens() -> None:
  """Waits for JAX's runtime tokens, dropping them if they hold an error.

  JAX keeps, per device, the runtime token of the last executable with side
  effects (every jax_ep custom call has them) and waits for it at exit. After
  a fault, that token holds the refused call's error: the exit-time wait then
  raises inside JAX's clean-up, which skips the distributed shutdown and makes
  the coordination service abort the process. Measured on the 2x H200 machine
  (tests/gpu_faults), 2026-11-30.
  """
  try:
    from jax._src import dispatch  # pylint: disable=import-outside-toplevel
    tokens = dispatch.runtime_tokens
  except (ImportError, AttributeError):
    return
  try:
    tokens.block_until_ready()
  except Exception:  # pylint: disable=broad-except
    tokens.clear()  # the error was already raised to the caller of that call


# Also at exit, for a process that never calls finalize(): registered after
# JAX's own exit hook (jax is imported first), so it runs before it.
atexit.register(_drop_failed_runtime_tokens)


def state() -> Optional[RuntimeState]:
  """The current RuntimeState, or None before initialize()."""
  return _state


def require(config: EpConfig, op: str, *, every_rank: bool = False) -> RuntimeState:
  """The state for an op call with ``config``; raises a clear error otherwise.

  every_rank: the op needs every EP rank (the HT ops): refused while a rank
  is masked.
  """
  if not isinstance(config, EpConfig):
    raise EpConfigError(f"jax_ep.{op}: config= must be an EpConfig, got {type(config).__name__}")
  current = _state
  if current is None:
    raise EpError(f"jax_ep.{op}: call jax_ep.initialize(config, mesh) before tracing jax_ep ops")
  fault = status()
  if not fault["ok"]:
    # Executables compiled earlier fail in XLA (a runtime error carrying this
    # message); a new trace fails here, as a real EpError.
    if fault.get("kind") == "protocol":
      what = ("ran while a split send of its kind awaited its receive (each "
              "low_latency_*_send must reach its *_recv before the next send or one-call op of "
              "that kind); its results were void")
    else:
      what = f"timed out waiting for EP rank {fault['peer']} (detail {fault['detail']})"
    raise EpError(
        f"jax_ep.{op}: an earlier jax_ep op ({fault['op']}) {what}; the EP group is out of "
        "step. Restart it: jax_ep.finalize() and jax_ep.initialize() on every rank "
        "(docs/reliability.md)")
  if config not in current.configs:
    raise EpConfigError(_not_held(config, current.configs, op))
  if every_rank and current.masked_ranks():
    raise EpError(
        f"jax_ep.{op}: ranks {current.masked_ranks()} are masked; rank masking covers the "
        "low-latency ops only, and this op needs every EP rank (jax_ep.unmask_all() to lift "
        "the masks)")
  return current


def _not_held(config: EpConfig, held: tuple[EpConfig, ...], op: str) -> str:
  """Why ``config`` is refused: the fields where it differs from the closest
  held config (fewest differing fields, the first of a tie), and the fix."""
  closest = min(held, key=lambda c: len(differences(c, config)))
  which = ("a config" if len(held) == 1 else
           f"{len(held)} configs, none equal to this call's; the closest, configs"
           f"[{held.index(closest)}],")
  return (f"jax_ep.{op}: jax_ep was initialized with {which} that differs from this call's "
          f"in {describe_differences(closest, config, 'initialized', 'this call')}. Pass "
          "every config you trace with to jax_ep.initialize, on every process: "
          "jax_ep.initialize((config_a, config_b), mesh)")


# ---------------------------------------------------------------- rank masking
def mask_rank(rank: int) -> None:
  """Masks EP rank ``rank`` (0 <= rank < R) for this process's low-latency ops
  (semantics: jax_ep/masking.py). Clears JAX's caches: jitted functions
  retrace with the new mask."""
  current = _state
  if current is None:
    raise EpError("jax_ep.mask_rank: call jax_ep.initialize(config, mesh) first")
  rank = masking.check_rank(rank, current.num_ranks, "mask_rank")
  if rank in current.masked:
    return
  masked = dataclasses.replace(current, masked=current.masked | {rank})
  if current.cuda is not None:
    current.cuda.set_masked(masked.masked_ranks())
  _set_state(masked)


def masked_ranks() -> tuple[int, ...]:
  """The ranks this process has masked, ascending (on CUDA, also those a kernel
  masked on a timeout)."""
  return _state.masked_ranks() if _state is not None else ()


def unmask_all() -> None:
  """Clears every mask of this process."""
  current = _state
  if current is None:
    return
  if current.cuda is not None and current.cuda.masked():
    current.cuda.set_masked(())
  if current.masked:
    _set_state(dataclasses.replace(current, masked=frozenset()))


# ---------------------------------------------------------------- faults
# Names of the ops a fault word can point at (cuda/ep_types.h OpCode).
_OP_NAMES = {1: "low_latency_dispatch", 2: "low_latency_combine",
             3: "dispatch (count exchange)", 4: "dispatch", 5: "combine"}
# DeviceStatus::code (cuda/ep_types.h kStatus*).
_FAULT_KINDS = {1: "timeout", 2: "protocol"}


def status() -> dict:
  """The process's jax_ep fault status, read without synchronising the GPU.

  Returns a dict: ``ok`` (bool), ``backend``, and when a fault was recorded
  ``kind`` ("timeout": ``op`` timed out waiting for EP rank ``peer``;
  "protocol": ``op`` ran while a split send of its kind awaited its receive,
  ``peer`` is this rank), ``op``, ``peer``, ``detail`` (of the first fault)
  and ``fault_count``. On CUDA, ``fails_next_execution`` says
  whether a fault also fails executions replayed from command buffers (the
  prepare-stage check, on unless JAX_EP_PREPARE_STATUS_CHECK=0;
  docs/reliability.md).
  """
  current = _state
  if current is None or current.cuda is None:
    return {"ok": True, "backend": current.backend_name if current else None}
  raw = current.cuda.status()
  result = {"ok": raw["code"] == 0, "backend": "cuda",
            "fails_next_execution": _extension.prepare_status_check()["enabled"]}
  if raw["code"]:
    result.update(kind=_FAULT_KINDS.get(raw["code"], f"code {raw['code']}"),
                  op=_OP_NAMES.get(raw["op"], f"op {raw['op']}"), peer=raw["peer"],
                  detail=raw["detail"], fault_count=raw["fault_count"])
  return result


@contextlib.contextmanager
def lowering_only(config: EpConfig | Sequence[EpConfig], mesh: jax.sharding.Mesh,
                  backend: str = "cuda"):
  """Traces jax_ep ops for ``backend`` without starting it (no GPU needed).

  ``config``: one EpConfig or several, as for initialize(). For inspecting
  what an op lowers to, e.g.
  ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``; the result
  cannot run. Restores the previous state on exit.
  """
  backends = {"cuda": CudaBackend, "xla": XlaBackend}
  if backend not in backends:
    raise EpConfigError(f"backend must be one of {sorted(backends)}, got {backend!r}")
  configs = _as_configs(config, "lowering_only")
  num_ranks = _group_size(configs, mesh)
  previous = _state
  _set_state(RuntimeState(config=configs[0], num_ranks=num_ranks, backend=backends[backend](),
                          mesh=mesh, configs=configs))
  try:
    yield
  finally:
    _set_state(previous)
