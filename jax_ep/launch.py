"""Runs N local processes, one GPU each: ``python -m jax_ep.launch -n N script.py [args]``.

Also ``python -m jax_ep.launch -n N -m module [args]`` (e.g. ``-m pytest tests/gpu``).

Each child gets one GPU and the environment jax_ep needs (NVSHMEM without
NVLink multicast or remote transport, no XLA preallocation, the coordinator
address). ``--devices 0,0,...`` puts several processes on one GPU (NVSHMEM
runs them all there; XLA collectives cannot run) and sets
``JAX_EP_GPUS_SHARED=1`` in every child ("0" otherwise). A child calls
:func:`initialize_distributed_from_env` (jax_ep's ops and examples do) to join
``jax.distributed`` with ``local_device_ids=[rank]``.
Output lines are prefixed with the rank. When one child fails, the others are
stopped and the launcher exits with the failing child's status.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Sequence

from absl import flags, logging

ENV_LAUNCHED = "JAX_EP_LAUNCHED"
ENV_RANK = "JAX_EP_RANK"
ENV_NUM_PROCESSES = "JAX_EP_NUM_PROCESSES"
ENV_COORDINATOR = "JAX_EP_COORDINATOR"
ENV_DEVICE = "JAX_EP_DEVICE"
# "1" when --devices names a GPU more than once (several processes share it:
# NVSHMEM runs, XLA collectives cannot, since NCCL refuses two ranks on one
# GPU); "0" otherwise.
ENV_GPUS_SHARED = "JAX_EP_GPUS_SHARED"

# Set for every child unless the caller already set them. NVLink multicast
# (NVLS) must stay off on shared machines; with one node no remote transport
# is needed; NVSHMEM allocates its own heap beside XLA's.
CHILD_ENV_DEFAULTS = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    "PYTHONUNBUFFERED": "1",
}
ALWAYS = ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE")  # not overridable

_FLAGS = flags.FlagValues()
flags.DEFINE_integer("num_processes", 2, "processes to start, one GPU each", short_name="n",
                     flag_values=_FLAGS)
flags.DEFINE_string("module", None, "run this module (python -m) instead of a script",
                    short_name="m", flag_values=_FLAGS)
flags.DEFINE_integer("port", 0, "coordinator port on localhost (0: pick a free one)",
                     flag_values=_FLAGS)
flags.DEFINE_string("devices", None, "comma-separated GPU ordinals (default 0..N-1)",
                    flag_values=_FLAGS)
flags.DEFINE_float("kill_grace_s", 10.0, "seconds between SIGTERM and SIGKILL when stopping "
                   "the other processes after a failure", flag_values=_FLAGS)
flags.DEFINE_bool("keep_going", False, "when a process fails, let the others run to their end "
                  "instead of stopping them (fault tests: the survivors of a killed rank must "
                  "exit by themselves); the exit status is still the first failure's",
                  flag_values=_FLAGS)

_VALUE_FLAGS = {"-n", "--num_processes", "--port", "--devices", "--kill_grace_s"}


def initialize_distributed_from_env() -> bool:
  """Joins jax.distributed when started by this launcher; returns whether it did.

  Must run before any JAX computation. Safe to call twice.
  """
  if os.environ.get(ENV_LAUNCHED) != "1":
    return False
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  if distributed.global_state.client is not None:
    return True
  jax.distributed.initialize(
      coordinator_address=os.environ[ENV_COORDINATOR],
      num_processes=int(os.environ[ENV_NUM_PROCESSES]),
      process_id=int(os.environ[ENV_RANK]),
      local_device_ids=[int(os.environ[ENV_DEVICE])])
  return True


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(launcher argv, child command); the child starts at the script or after -m X."""
  own, i = [argv[0]], 1
  while i < len(argv):
    token = argv[i]
    if token in ("-m", "--module"):
      return own + argv[i:i + 2], [sys.executable, "-m"] + list(argv[i + 1:])
    if token.startswith("--module="):
      return own + [token], [sys.executable, "-m", token.split("=", 1)[1]] + list(argv[i + 1:])
    if token in _VALUE_FLAGS:
      own += argv[i:i + 2]
      i += 2
      continue
    if token.startswith("-"):
      own.append(token)
      i += 1
      continue
    return own, [sys.executable] + list(argv[i:])
  return own, []


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
  for raw in iter(stream.readline, b""):
    line = raw.decode(errors="replace").rstrip("\n")
    with lock:
      out.write(f"[rank {rank}] {line}\n")
      out.flush()


def child_env(rank: int, num_processes: int, coordinator: str, device: int,
              gpus_shared: bool = False) -> dict[str, str]:
  env = dict(os.environ)
  for key, value in CHILD_ENV_DEFAULTS.items():
    if key in ALWAYS:
      env[key] = value
    else:
      env.setdefault(key, value)
  env.update({ENV_LAUNCHED: "1", ENV_RANK: str(rank), ENV_NUM_PROCESSES: str(num_processes),
              ENV_COORDINATOR: coordinator, ENV_DEVICE: str(device),
              ENV_GPUS_SHARED: "1" if gpus_shared else "0"})
  return env


def run(command: list[str], num_processes: int, port: int = 0,
        devices: Sequence[int] | None = None, kill_grace_s: float = 10.0,
        keep_going: bool = False) -> int:
  """Starts the processes and waits; returns the exit status (first failure wins).

  A failing process stops the others (SIGTERM, then SIGKILL after
  kill_grace_s) unless keep_going, which waits for every process to end.
  """
  devices = list(devices) if devices is not None else list(range(num_processes))
  if len(devices) != num_processes:
    raise ValueError(f"{num_processes} processes need {num_processes} devices, got {devices}")
  coordinator = f"127.0.0.1:{port or _free_port()}"
  gpus_shared = len(set(devices)) < len(devices)
  lock = threading.Lock()
  procs, pumps = [], []
  for rank in range(num_processes):
    proc = subprocess.Popen(command, env=child_env(rank, num_processes, coordinator,
                                                   devices[rank], gpus_shared),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    procs.append(proc)
    pump = threading.Thread(target=_pump, args=(rank, proc.stdout, sys.stdout, lock), daemon=True)
    pump.start()
    pumps.append(pump)

  def stop_all(sig=signal.SIGTERM):
    for p in procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except ProcessLookupError:
          pass

  def on_signal(signum, _frame):
    stop_all(signal.SIGTERM)
    sys.exit(128 + signum)

  previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
  status = 0
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
      if failed and keep_going:
        if status == 0:
          rank, status = failed[0]
          with lock:
            print(f"[jax_ep.launch] rank {rank} exited with status {status}; the others keep "
                  "going (--keep_going)", flush=True)
        if all(c is not None for c in codes):
          break
        time.sleep(0.1)
        continue
      if failed:
        rank, status = failed[0]
        with lock:
          print(f"[jax_ep.launch] rank {rank} exited with status {status}; stopping the others",
                flush=True)
        stop_all(signal.SIGTERM)
        deadline = time.monotonic() + kill_grace_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
          time.sleep(0.1)
        stop_all(signal.SIGKILL)
        break
      if all(c == 0 for c in codes):
        break
      time.sleep(0.1)
    for p in procs:
      p.wait()
    for pump in pumps:
      pump.join(timeout=5)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  return status if status >= 0 else 128 - status


USAGE = "usage: python -m jax_ep.launch [flags] -n N (script.py | -m module) [args...]"
# Asked for help: absl's own --help lives in its global FLAGS, which this
# launcher does not parse (its flags are kept apart from the child's).
_HELP_FLAGS = ("-h", "--help", "-?", "--helpfull", "--helpshort")


def usage_text() -> str:
  """The usage line, the module docstring and the launcher's flags."""
  lines = [USAGE, "", (__doc__ or "").strip(), "", "flags:"]
  seen = set()
  for name in sorted(_FLAGS):
    flag = _FLAGS[name]
    if flag.name in seen or flag.name in ("flagfile", "undefok"):  # absl's, not ours
      continue
    seen.add(flag.name)
    names = (f"-{flag.short_name}," if flag.short_name else "") + f"--{flag.name}"
    default = "" if flag.default is None else f" (default: {flag.default})"
    lines.append(textwrap.fill(f"{names}: {flag.help}{default}", width=80,
                               initial_indent="  ", subsequent_indent="      "))
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> None:
  own, command = _split_argv(list(argv))
  if any(token in _HELP_FLAGS for token in own[1:]):
    sys.stdout.write(usage_text())
    sys.exit(0)
  try:
    _FLAGS(own)
  except flags.Error as e:
    # A bad flag is the caller's mistake: say so in one line, not a traceback.
    sys.stderr.write(f"jax_ep.launch: {e}\n{USAGE}\n(--help lists the flags)\n")
    sys.exit(2)
  if not command:
    sys.stderr.write(f"jax_ep.launch: no script or -m module given\n{USAGE}\n")
    sys.exit(2)
  devices = ([int(d) for d in _FLAGS.devices.split(",")] if _FLAGS.devices else None)
  logging.info("launching %d processes: %s", _FLAGS.num_processes, " ".join(command))
  sys.exit(run(command, _FLAGS.num_processes, _FLAGS.port, devices, _FLAGS.kill_grace_s,
               _FLAGS.keep_going))


if __name__ == "__main__":
  main(sys.argv)
