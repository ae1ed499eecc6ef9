"""The launcher: rank-prefixed output, environment, failure takes the others down."""

import os
import subprocess
import sys
import time

LAUNCH = [sys.executable, "-m", "jax_ep.launch"]


def _script(tmp_path, body: str) -> str:
  path = tmp_path / "child.py"
  path.write_text("import os, sys, time\nrank = int(os.environ['JAX_EP_RANK'])\n" + body)
  return str(path)


def test_success_prefixes_output_and_sets_environment(tmp_path):
  script = _script(tmp_path, "print('hello', rank, os.environ['JAX_EP_NUM_PROCESSES'], "
                             "os.environ['NVSHMEM_DISABLE_NVLS'], os.environ['JAX_EP_DEVICE'], "
                             "sys.argv[1:])\n")
  result = subprocess.run(LAUNCH + ["-n", "3", script, "--flag", "x"], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr
  for rank in range(3):
    assert f"[rank {rank}] hello {rank} 3 1 {rank} ['--flag', 'x']" in result.stdout


def test_module_mode(tmp_path):
  (tmp_path / "childmod.py").write_text("import os\nprint('module', os.environ['JAX_EP_RANK'])\n")
  env = dict(os.environ, PYTHONPATH=str(tmp_path))
  result = subprocess.run(LAUNCH + ["-n", "2", "-m", "childmod"], capture_output=True, text=True,
                          timeout=60, env=env)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "[rank 1] module 1" in result.stdout


def test_one_failure_stops_the_others(tmp_path):
  script = _script(tmp_path, "if rank == 1:\n  sys.exit(3)\ntime.sleep(120)\n")
  start = time.monotonic()
  result = subprocess.run(LAUNCH + ["-n", "3", "--kill_grace_s=2", script], capture_output=True,
                          text=True, timeout=60)
  assert result.returncode == 3
  assert time.monotonic() - start < 30
  assert "rank 1 exited with status 3" in result.stdout


def test_nvls_cannot_be_turned_on(tmp_path):
  script = _script(tmp_path, "print('nvls', os.environ['NVSHMEM_DISABLE_NVLS'])\n")
  env = dict(os.environ, NVSHMEM_DISABLE_NVLS="0")
  result = subprocess.run(LAUNCH + ["-n", "1", script], capture_output=True, text=True,
                          timeout=60, env=env)
  assert "[rank 0] nvls 1" in result.stdout


def test_keep_going_lets_the_survivors_finish(tmp_path):
  """A rank killed by SIGKILL (a crash) does not take the others down with --keep_going:
  they run to their own end, and the launcher reports the first failure's status."""
  script = _script(tmp_path, "import signal\nif rank == 1:\n  os.kill(os.getpid(), signal.SIGKILL)\n"
                             "time.sleep(3)\nprint('survivor done', rank, flush=True)\n")
  result = subprocess.run(LAUNCH + ["-n", "3", "--keep_going", "--kill_grace_s=1", script],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 128 + 9, result.stdout + result.stderr
  assert "rank 1 exited with status -9" in result.stdout, result.stdout
  for rank in (0, 2):
    assert f"[rank {rank}] survivor done {rank}" in result.stdout, result.stdout


def test_repeated_devices_mark_the_gpus_shared(tmp_path):
  """--devices 0,0 puts both processes on GPU 0: children learn it from
  JAX_EP_GPUS_SHARED (the GPU tests skip what needs an XLA collective)."""
  script = _script(tmp_path, "print('shared', os.environ['JAX_EP_GPUS_SHARED'], "
                             "os.environ['JAX_EP_DEVICE'])\n")
  env = dict(os.environ, JAX_EP_GPUS_SHARED="1")  # the launcher decides, not the caller
  for devices, shared in (("0,0", "1"), ("0,1", "0"), (None, "0")):
    args = ["-n", "2"] + (["--devices", devices] if devices else []) + [script]
    result = subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
      device = devices.split(",")[rank] if devices else str(rank)
      assert f"[rank {rank}] shared {shared} {device}" in result.stdout, (devices, result.stdout)


def test_help_prints_usage_and_exits_zero():
  """--help, -h and --helpfull print the usage and the launcher's flags (absl's global
  help flags are not the launcher's: they used to raise UnrecognizedFlagError)."""
  for flag in ("--help", "-h", "--helpfull"):
    result = subprocess.run(LAUNCH + [flag], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (flag, result.stdout + result.stderr)
    assert result.stdout.startswith("usage: python -m jax_ep.launch"), (flag, result.stdout)
    for name in ("-n,--num_processes", "--devices", "--keep_going", "--kill_grace_s"):
      assert name in result.stdout, (flag, name, result.stdout)
    assert "Traceback" not in result.stderr, (flag, result.stderr)


def test_bad_command_lines_say_why_without_a_traceback(tmp_path):
  script = _script(tmp_path, "print('ran')\n")
  for args, reason in (([], "no script or -m module given"),
                       (["--no_such_flag", script], "Unknown command line flag 'no_such_flag'")):
    result = subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, (args, result.stdout + result.stderr)
    assert reason in result.stderr and "usage:" in result.stderr, (args, result.stderr)
    assert "Traceback" not in result.stderr and "ran" not in result.stdout, result.stderr
