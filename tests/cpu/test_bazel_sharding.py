"""tools/bazel/pytest_main.py under Bazel's test sharding: the shards of one file
run every test exactly once between them, each shard touches the status file
(so Bazel knows the runner shards), and a shard left without tests passes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tools" / "bazel" / "pytest_main.py"


def _run_shard(test_file: Path, total: int, index: int, status: Path) -> tuple[int, set[str]]:
  env = dict(os.environ, TEST_TOTAL_SHARDS=str(total), TEST_SHARD_INDEX=str(index),
             TEST_SHARD_STATUS_FILE=str(status))
  env.pop("XML_OUTPUT_FILE", None)
  result = subprocess.run([sys.executable, str(RUNNER), str(test_file), "--", "-q", "-rA"],
                          env=env, capture_output=True, text=True, timeout=120,
                          cwd=test_file.parent)
  ran = {line.split("::")[-1].strip() for line in result.stdout.splitlines()
         if line.startswith("PASSED")}
  return result.returncode, ran


@pytest.mark.parametrize("total", [2, 3, 7])
def test_shards_run_every_test_once(tmp_path, total):
  (tmp_path / "WORKSPACE").write_text("")
  test_file = tmp_path / "test_five.py"
  test_file.write_text("import pytest\n\n@pytest.mark.parametrize('i', range(5))\n"
                       "def test_case(i):\n  pass\n")
  seen: list[str] = []
  for index in range(total):
    status = tmp_path / f"status_{index}"
    code, ran = _run_shard(test_file, total, index, status)
    assert code == 0, (total, index)
    assert status.exists()
    seen += sorted(ran)
  assert sorted(seen) == sorted(f"test_case[{i}]" for i in range(5))
