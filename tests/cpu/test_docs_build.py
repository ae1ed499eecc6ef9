"""The documentation: the Sphinx user guide and API reference build without a warning,
and every local file the Markdown docs link to exists.

The build is what CI checks: ``python -m sphinx -W --keep-going -b html docs <dir>``
(warnings are errors), autodoc importing jax_ep from the tree under test.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")


def test_sphinx_builds_without_warnings(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p])
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-d",
       str(tmp_path / "doctrees"), DOCS, str(tmp_path / "html")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  for page in ("index.html", "guide.html", "api.html"):
    assert (tmp_path / "html" / page).is_file(), page
  api = (tmp_path / "html" / "api.html").read_text(encoding="utf-8")
  for name in ("EpConfig", "initialize", "finalize", "status", "get_dispatch_layout",
               "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
               "low_latency_dispatch_send", "low_latency_dispatch_recv",
               "low_latency_combine_send", "low_latency_combine_recv", "DispatchResult",
               "DispatchHandle", "ExpertMajorHandle", "LowLatencyDispatchResult",
               "LowLatencyHandle"):
    assert f'id="jax_ep.{name}"' in api, f"jax_ep.{name} is missing from the API reference"


def _markdown_files():
  yield os.path.join(ROOT, "README.md")
  for directory, _, names in os.walk(DOCS):
    if "_build" in directory:
      continue
    for name in names:
      if name.endswith(".md"):
        yield os.path.join(directory, name)


def test_markdown_links_to_local_files_resolve():
  missing = []
  for path in _markdown_files():
    with open(path, encoding="utf-8") as f:
      text = f.read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      local = os.path.join(os.path.dirname(path), target.split("#", 1)[0])
      if not os.path.exists(local):
        missing.append(f"{os.path.relpath(path, ROOT)}: {target}")
  assert not missing, "links to missing files:\n" + "\n".join(missing)
