"""tools/test.sh on a machine without Bazel: tools/ensure_bazel.sh installs bazel-bootstrap.

Runs the shell function with PATH set to a directory of stand-ins (id, sudo,
apt-get; the Bazel command is named by JAX_EP_BAZEL), so nothing is installed.
The stand-in apt-get logs its arguments and, unless told to fail, "installs"
the Bazel command.
"""

import os
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BAZEL = "bazel-for-test"


def _stand_ins(tmp_path, *, uid: int, sudo: bool, apt_get: bool = True, apt_fails=False):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  log = tmp_path / "log"

  def script(name, body):
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)

  script("id", f'[ "$1" = "-u" ] && echo {uid}\n')
  if sudo:
    script("sudo", f'echo "sudo $*" >> {log}\nexec "$@"\n')
  if apt_get:
    install = ("exit 100\n" if apt_fails else
               f"printf '#!/bin/sh\\n' > {bin_dir}/{BAZEL}; /bin/chmod +x {bin_dir}/{BAZEL}\n")
    script("apt-get", f'echo "apt-get $* DEBIAN_FRONTEND=$DEBIAN_FRONTEND" >> {log}\n'
                      f'[ "$2" = "install" ] || exit 0\n' + install)
  for tool in ("env", "dirname"):  # what the scripts use besides shell builtins
    os.symlink(f"/usr/bin/{tool}", bin_dir / tool)
  return bin_dir, log


def _run(bin_dir, command):
  env = {"PATH": str(bin_dir), "JAX_EP_BAZEL": BAZEL, "HOME": os.environ.get("HOME", "/")}
  return subprocess.run(["/bin/bash", "-c", command], env=env, cwd=ROOT, capture_output=True,
                        text=True, timeout=60)


def _ensure(bin_dir):
  return _run(bin_dir, "source tools/ensure_bazel.sh && ensure_bazel")


def _log(log):
  return log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("uid,prefix", [(1000, "sudo env "), (0, "")])
def test_installs_bazel_bootstrap_when_missing(tmp_path, uid, prefix):
  bin_dir, log = _stand_ins(tmp_path, uid=uid, sudo=True)
  result = _ensure(bin_dir)
  assert result.returncode == 0, result.stdout + result.stderr
  assert f"== {BAZEL} not found: {prefix.split()[0] + ' ' if prefix else ''}apt-get install " \
         "bazel-bootstrap" in result.stdout
  calls = [c for c in _log(log) if c.startswith("apt-get")]
  assert calls == ["apt-get -qq update DEBIAN_FRONTEND=noninteractive",
                   "apt-get -qq install -y --no-install-recommends bazel-bootstrap "
                   "DEBIAN_FRONTEND=noninteractive"]
  sudo_calls = [c for c in _log(log) if c.startswith("sudo")]
  assert len(sudo_calls) == (2 if uid else 0)
  assert all(c.startswith("sudo env DEBIAN_FRONTEND=noninteractive apt-get") for c in sudo_calls)


def test_nothing_to_do_when_bazel_is_there(tmp_path):
  bin_dir, log = _stand_ins(tmp_path, uid=1000, sudo=True)
  (bin_dir / BAZEL).write_text("#!/bin/sh\n")
  (bin_dir / BAZEL).chmod(0o755)
  result = _ensure(bin_dir)
  assert result.returncode == 0 and result.stdout == "" and not _log(log)


@pytest.mark.parametrize("case,message", [
    ("no_sudo", "needs root and there is no sudo: run 'apt-get install bazel-bootstrap' as root"),
    ("no_apt", "no apt-get to install Debian's bazel-bootstrap"),
    ("apt_fails", "apt-get install bazel-bootstrap failed"),
])
def test_says_what_to_do_when_it_cannot_install(tmp_path, case, message):
  bin_dir, log = _stand_ins(tmp_path, uid=1000, sudo=case != "no_sudo",
                            apt_get=case != "no_apt", apt_fails=case == "apt_fails")
  result = _ensure(bin_dir)
  assert result.returncode == 1
  assert message in result.stdout, result.stdout
  if case == "no_sudo":
    assert not _log(log)


def test_test_sh_ends_with_the_count_line_without_bazel(tmp_path):
  """tools/test.sh checks Bazel first: no set-up runs, and the last line is the count."""
  bin_dir, _ = _stand_ins(tmp_path, uid=0, sudo=False, apt_fails=True)
  result = _run(bin_dir, "/bin/bash tools/test.sh")
  assert result.returncode == 1
  lines = result.stdout.strip().splitlines()
  assert lines[-1] == "0 passed, 1 failed", result.stdout
  assert "apt-get install bazel-bootstrap failed" in result.stdout
  assert "tools/setup_env.sh" not in result.stdout
