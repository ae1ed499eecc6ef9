"""Counts individual test cases of one `bazel test` invocation.

    summarize_tests.py <build_event_json_file> <bazel_exit_code> <testlogs_dir>

Reads the Build Event Protocol (JSON) file of the invocation to find which
test targets it covered and their status, then each target's test.xml
(<testlogs_dir>/<package>/<name>/test.xml: JUnit from pytest, the C++ check
harness, the CUDA check script, or the one Bazel writes itself) and counts its
<testcase> elements: failed (a <failure> or <error> child), skipped (a
<skipped> child) or passed. A test target without a usable result (did not
build, crashed before writing its report, timed out) counts as one failure,
and so does a Bazel failure that ran no test at all.

Prints one line per target, the skipped cases, and finally exactly
`N passed, N failed`. Exits 1 if anything failed (or Bazel failed), else 0.
"""

import json
import os
import sys
import xml.etree.ElementTree as ET

_OK_STATUSES = {"PASSED", "FLAKY"}


def read_events(path):
  events = []
  if not os.path.exists(path):
    return events
  with open(path, encoding="utf-8", errors="replace") as f:
    decoder = json.JSONDecoder()
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        events.append(decoder.decode(line))
      except ValueError:
        continue  # a truncated last event when Bazel was interrupted
  return events


def count_xml(path):
  """(passed, failed, skipped_names) of a JUnit file, or None if unusable."""
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError):
    return None
  cases = list(root.iter("testcase"))
  if not cases:
    # No <testcase>: fall back to the <testsuite> attributes.
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites:
      return None
    total = sum(int(s.get("tests", 0) or 0) for s in suites)
    bad = sum(int(s.get("failures", 0) or 0) + int(s.get("errors", 0) or 0) for s in suites)
    skipped = sum(int(s.get("skipped", 0) or 0) + int(s.get("disabled", 0) or 0) for s in suites)
    return max(total - bad - skipped, 0), bad, ["(%d unnamed)" % skipped] if skipped else []
  passed = failed = 0
  skipped = []
  for case in cases:
    name = case.get("name", "?")
    classname = case.get("classname")
    if case.find("failure") is not None or case.find("error") is not None:
      failed += 1
    elif case.find("skipped") is not None:
      reason = case.find("skipped").get("message", "")
      full = "%s.%s" % (classname, name) if classname else name
      skipped.append("%s%s" % (full, ": " + reason if reason else ""))
    else:
      passed += 1
  return passed, failed, skipped


def label_to_dir(label):
  # //tests/cpu:test_ht -> tests/cpu/test_ht ; @repo//a:b is not expected here.
  label = label.split("//", 1)[-1]
  package, _, name = label.partition(":")
  return os.path.join(package, name) if package else name


def main(argv):
  bep_path, bazel_rc, testlogs = argv[1], int(argv[2]), argv[3]
  events = read_events(bep_path)

  tests = {}  # label -> {"status": ..., "xml": path or None}
  configured_tests = []
  for event in events:
    ident = event.get("id", {})
    if "targetConfigured" in ident and "testSize" in event.get("configured", {}):
      configured_tests.append(ident["targetConfigured"]["label"])
    if "testResult" in ident:
      label = ident["testResult"]["label"]
      result = event.get("testResult", {})
      xml = None
      for out in result.get("testActionOutput", []):
        if out.get("name") == "test.xml" and out.get("uri", "").startswith("file://"):
          xml = out["uri"][len("file://"):]
      # Several attempts/shards: keep the last status, prefer a failing one.
      entry = tests.setdefault(label, {"status": "PASSED", "xml": []})
      status = result.get("status", "NO_STATUS")
      if entry["status"] in _OK_STATUSES:
        entry["status"] = status
      if xml:
        entry["xml"].append(xml)

  total_passed = total_failed = 0
  skipped_lines = []
  lines = []
  for label in sorted(set(configured_tests) | set(tests)):
    entry = tests.get(label)
    if entry is None:
      lines.append("  %-50s did not run (build failure or Bazel error): 1 failed" % label)
      total_failed += 1
      continue
    xml_paths = entry["xml"] or [os.path.join(testlogs, label_to_dir(label), "test.xml")]
    passed = failed = 0
    skipped = []
    usable = False
    for xml in xml_paths:
      counted = count_xml(xml)
      if counted is None:
        continue
      usable = True
      passed += counted[0]
      failed += counted[1]
      skipped += counted[2]
    note = ""
    if entry["status"] not in _OK_STATUSES and failed == 0:
      failed = 1  # crashed, timed out or failed outside its own test cases
      note = " (target %s)" % entry["status"]
    elif not usable and entry["status"] in _OK_STATUSES:
      passed = 1  # no report at all, but the target passed
    total_passed += passed
    total_failed += failed
    skipped_lines += ["%s: %s" % (label, s) for s in skipped]
    lines.append("  %-50s %d passed, %d failed, %d skipped%s" %
                 (label, passed, failed, len(skipped), note))

  if bazel_rc != 0 and total_failed == 0:
    # Bazel failed without a failing test case to show for it (loading or
    # analysis error, a non-test target that did not build, ...).
    lines.append("  bazel test exited with %d%s: 1 failed" %
                 (bazel_rc, "" if lines else " before running any test"))
    total_failed += 1

  print("Test cases per target:")
  for line in lines:
    print(line)
  if skipped_lines:
    print("%d skipped: %s" % (len(skipped_lines), "; ".join(skipped_lines)))
  else:
    print("0 skipped")
  print("%d passed, %d failed" % (total_passed, total_failed))
  sys.stdout.flush()
  return 1 if total_failed or bazel_rc != 0 else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
