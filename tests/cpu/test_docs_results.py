"""docs/results: the result files the docs cite, and the commits they name.

- Every reference to ``results/...`` or ``docs/results/...`` in README.md and docs/
  resolves to a file (a month's archive included).
- Every file left directly in docs/results is cited by a current page (README.md,
  docs/*.md and docs/*.rst other than history.md) or read by the repository's code;
  the rest is in one archive per month, docs/results/archive/<YYYY-MM>.tar.xz.
- Each archive opens, and every file that a link names as in an archive
  (``[`FILE`](results/archive/YYYY-MM.tar.xz)``) is in that month's archive.
- Every commit in backticks in the docs, and in the name of a result file they cite,
  is a commit of this repository (skipped without .git).

Plain Python: no JAX.
"""

import fnmatch
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
ARCHIVE = RESULTS / "archive"
HISTORY = DOCS / "history.md"

# A result file's name: <mode>_<YYYY-MM-DD>[_<commit>][_<n>].json (or .txt).
NAME = r"[a-z][a-z0-9-]*_\d{4}-\d\d-\d\d(?:_[0-9a-z-]+)*\.(?:json|txt)"
NAME_RE = re.compile(r"(?<![\w.-])(" + NAME + r")")
# "[`X.json`](results/X.json) to `_5`", "X.json and `_2` .. `_5`": X_2 .. X_5 too.
RANGE_RE = re.compile(r"[`\]]*(?:\([^)\s]*\))?\)?,?\s+(?:to|and\s+`_2`\s+\.\.)\s+\[?`_(\d+)`")
# A path into docs/results as the docs write it (a link's target or a plain path).
REFERENCE_RE = re.compile(r"(?<![\w/.-])((?:docs/)?results/[\w./-]+)")
# The one form of a link into an archive: the file's name as its text.
ARCHIVE_LINK_RE = re.compile(
    r"\[([^\]]*)\]\(((?:docs/)?results/archive/[^)\s]*)\)")
ARCHIVE_NAME_RE = re.compile(r"`(" + NAME + r")`")
ARCHIVE_TARGET_RE = re.compile(r"(?:docs/)?results/archive/(\d{4}-\d\d)\.tar\.xz")
CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
HEX_RE = re.compile(r"(?<![0-9A-Za-z])([0-9a-f]{7,40})(?![0-9A-Za-z])")
NAME_COMMIT_RE = re.compile(r"_\d{4}-\d\d-\d\d_([0-9a-f]{7,40})(?![0-9a-z])")
# Where the repository's code may read result files by name or by pattern.
CODE_FOLDERS = ("benchmarks", "examples", "jax_ep", "tests", "tools")
CODE_SUFFIXES = (".py", ".sh", ".cu", ".cuh", ".cc", ".h", ".bzl", ".bazel", ".toml")


def _pages():
  """README.md and every Markdown and reStructuredText page of docs/ (the results'
  own README included)."""
  pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("*.rst"))]
  if (RESULTS / "README.md").is_file():
    pages.append(RESULTS / "README.md")
  return pages


def _current_pages():
  """The pages that describe the project as it is: all but history.md (and the
  results' README, an index)."""
  return [ROOT / "README.md",
          *(p for p in sorted(DOCS.glob("*.md")) if p.name != HISTORY.name),
          *sorted(DOCS.glob("*.rst"))]


def cited_names(text):
  """The result files a page names: each name, and each run of a range
  ("X.json to `_5`" names X_2.json to X_5.json)."""
  names = set()
  for match in NAME_RE.finditer(text):
    name = match.group(1)
    names.add(name)
    more = RANGE_RE.match(text, match.end())
    if more:
      stem, suffix = name.rsplit(".", 1)
      names.update(f"{stem}_{i}.{suffix}" for i in range(2, int(more.group(1)) + 1))
  return names


def names_cited_by_current_pages():
  names = set()
  for page in _current_pages():
    names |= cited_names(page.read_text(encoding="utf-8"))
  return names


def patterns_read_by_code():
  """Names and glob patterns of dated result files in the repository's code."""
  patterns = set()
  token = re.compile(r"[\w*?.-]*_\d{4}-\d\d-\d\d[\w*?.-]*")
  for folder in CODE_FOLDERS:
    for path in sorted((ROOT / folder).rglob("*")):
      if path.suffix not in CODE_SUFFIXES or not path.is_file() or path == Path(__file__).resolve():
        continue
      text = path.read_text(encoding="utf-8", errors="replace")
      if "results" in text:
        patterns.update(token.findall(text))
  return patterns


def result_files():
  return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md")


def archives():
  return sorted(ARCHIVE.glob("*.tar.xz")) if ARCHIVE.is_dir() else []


def archive_members(path):
  with tarfile.open(path, "r:xz") as tar:
    return [(m.name, m.isfile()) for m in tar.getmembers()]


def test_every_reference_to_a_result_file_resolves():
  missing = []
  for page in _pages():
    text = page.read_text(encoding="utf-8")
    for match in REFERENCE_RE.finditer(text):
      target = match.group(1).rstrip(".")
      if text[match.end():match.end() + 1] == "<" or target.endswith("/"):
        continue  # a template (docs/results/ht_<date>_<commit>.json) or the folder
      base = ROOT if target.startswith("docs/") else page.parent
      if not (base / target.split("#", 1)[0]).exists():
        missing.append(f"{page.relative_to(ROOT)}: {target}")
  assert not missing, "references to missing result files:\n" + "\n".join(missing)


def test_every_file_in_docs_results_is_cited_or_read():
  cited = names_cited_by_current_pages()
  patterns = patterns_read_by_code()
  uncited = [name for name in result_files()
             if name not in cited and not any(fnmatch.fnmatch(name, p) for p in patterns)]
  assert not uncited, ("files in docs/results that no current page cites and no code "
                       "reads (archive them: docs/results/README.md):\n" + "\n".join(uncited))


def test_the_archives_open_and_hold_what_the_links_say():
  members = {}
  for path in archives():
    entries = archive_members(path)
    assert entries, f"{path.name} is empty"
    bad = [name for name, is_file in entries if not is_file or "/" in name]
    assert not bad, f"{path.name}: not plain files at the top level: {bad}"
    names = [name for name, _ in entries]
    assert names == sorted(names), f"{path.name}: members not in sorted order"
    month = path.name[:-len(".tar.xz")]
    assert all(re.search(rf"_{month}-\d\d", n) for n in names), path.name
    members[month] = set(names)
  doubled = sorted(set(result_files()) & set().union(*members.values()))
  assert not doubled, f"in docs/results and in an archive: {doubled}"
  wrong = []
  linked = 0
  for page in _pages():
    for match in ARCHIVE_LINK_RE.finditer(page.read_text(encoding="utf-8")):
      label, target = match.groups()
      where = f"{page.relative_to(ROOT)}: [{label}]({target})"
      name, month = ARCHIVE_NAME_RE.fullmatch(label), ARCHIVE_TARGET_RE.fullmatch(target)
      if not name or not month:
        wrong.append(f"{where}: not the form [`FILE`](results/archive/YYYY-MM.tar.xz)")
      elif name.group(1) not in members.get(month.group(1), ()):
        wrong.append(f"{where}: not in that archive")
      linked += 1
  assert not wrong, "\n".join(wrong)
  assert linked or not members, "archives that no page links to"


def _commits_named(text):
  hashes = set()
  for span in CODE_SPAN_RE.findall(text):
    hashes.update(h for h in HEX_RE.findall(span) if re.search("[a-f]", h))
  for name in cited_names(text):
    hashes.update(NAME_COMMIT_RE.findall(name))
  return hashes


def test_every_commit_the_docs_name_exists():
  if not (ROOT / ".git").exists():
    pytest.skip("no .git: the commits cannot be looked up")
  shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                           capture_output=True, text=True)
  if shallow.returncode != 0 or shallow.stdout.strip() == "true":
    pytest.skip("not a full git history")
  named = {}
  for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted(DOCS.glob("*.rst"))]:
    for commit in _commits_named(page.read_text(encoding="utf-8")):
      named.setdefault(commit, []).append(page.name)
  assert named
  order = sorted(named)
  result = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check"],
                          input="".join(f"{h}^{{commit}}\n" for h in order),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  answers = result.stdout.splitlines()
  assert len(answers) == len(order), result.stdout
  dangling = [f"{h} ({', '.join(sorted(set(named[h])))}): {answer}"
              for h, answer in zip(order, answers) if answer.split()[-1] in ("missing",
                                                                             "ambiguous")]
  assert not dangling, "names that are no commit of this repository:\n" + "\n".join(dangling)
