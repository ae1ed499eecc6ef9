"""Where a benchmark JSON came from: machine, commit, date, versions, command.

Every JSON the bench writes holds these, and its default name is
``<mode>_<date>_<commit>.json`` (for example ``ht_2026-12-01_18c85d7.json``),
so a published number can be traced to the code and machine that produced it.
"""

from __future__ import annotations

import datetime
import os
import shlex
import socket
import subprocess
import sys
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The commit the caller names: where the tree travels without .git, or with a
# .git that is not the tree's (the GPU machine's copy kept a stale one: runs of
# 2026-12-01 named 6675740 while the tree was eee35d1 and then 78a3d62). The
# name wins over git; "dirty" is then unknown.
COMMIT_ENV = "JAX_EP_BENCH_COMMIT"
# Environment variables that change what the bench measures.
RECORDED_ENV = ("XLA_FLAGS", "JAX_PLATFORMS", "JAX_EP_PROFILE", "JAX_EP_TIMELINE",
                "JAX_EP_PREPARE_STATUS_CHECK", "JAX_EP_HT_RECV_DIVISOR",
                "NVSHMEM_DISABLE_NVLS", "NVSHMEM_REMOTE_TRANSPORT", "CUDA_VISIBLE_DEVICES")


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(("git", "-C", REPO_ROOT) + args, capture_output=True, text=True,
                         timeout=30, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


def commit() -> dict:
  """{"commit": full hash or None, "short": 7 hex digits or "unknown", "dirty": bool or None}.

  dirty: tracked files differ from the commit (untracked files do not count).
  """
  named = os.environ.get(COMMIT_ENV)
  full = _git("rev-parse", "HEAD")
  if named:
    seen = f" (git HEAD there: {full[:7]})" if full and not full.startswith(named) else ""
    return dict(commit=named, short=named[:7], dirty=None, source=f"${COMMIT_ENV}{seen}")
  if full is None:
    return dict(commit=None, short="unknown", dirty=None, source="no git checkout")
  status = _git("status", "--porcelain", "--untracked-files=no")
  return dict(commit=full, short=full[:7], dirty=bool(status) if status is not None else None,
              source="git")


def _driver_version() -> str | None:
  try:
    out = subprocess.run(("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
                         capture_output=True, text=True, timeout=30, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  versions = sorted(set(out.stdout.split()))
  return ",".join(versions) or None


def machine() -> dict:
  """GPU (or CPU) kind and count, driver where nvidia-smi answers, host name."""
  import jax  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  return dict(device_kind=device.device_kind, platform=device.platform,
              device_count=jax.device_count(), process_count=jax.process_count(),
              driver=_driver_version() if device.platform == "gpu" else None,
              hostname=socket.gethostname())


def versions() -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import jaxlib  # pylint: disable=import-outside-toplevel
  return dict(python=sys.version.split()[0], jax=jax.__version__, jaxlib=jaxlib.__version__)


def command_line(argv: Sequence[str], module: str = "jax_ep.bench") -> str:
  """The command that ran the bench (``argv``: its sys.argv; ``module``: what
  ``python -m`` ran), in the launcher's form when the launcher started it."""
  bench = " ".join([f"-m {module}"] + [shlex.quote(a) for a in argv[1:]])
  if os.environ.get("JAX_EP_LAUNCHED") == "1":
    return f"python -m jax_ep.launch -n {os.environ.get('JAX_EP_NUM_PROCESSES', '?')} {bench}"
  return f"python {bench}"


def record(argv: Sequence[str], now: datetime.datetime | None = None,
           module: str = "jax_ep.bench") -> dict:
  """The provenance fields of a bench JSON (``module``: as command_line)."""
  now = now or datetime.datetime.now()
  return dict(date=now.isoformat(timespec="seconds"), machine=machine(), commit=commit(),
              versions=versions(), command=command_line(argv, module),
              environment={k: os.environ[k] for k in RECORDED_ENV if k in os.environ})


def default_name(mode: str, date_iso: str, short_commit: str, dirty: bool | None) -> str:
  """``<mode>_<date>_<commit>.json``; ``-dirty`` after the commit for a changed tree."""
  return f"{mode}_{date_iso[:10]}_{short_commit}{'-dirty' if dirty else ''}.json"


def free_path(directory: str, name: str) -> str:
  """``directory/name``, or ``name`` with ``_2``, ``_3``... before ``.json`` when taken
  (several runs of one commit on one day)."""
  stem, ext = os.path.splitext(name)
  path, n = os.path.join(directory, name), 1
  while os.path.exists(path):
    n += 1
    path = os.path.join(directory, f"{stem}_{n}{ext}")
  return path
