"""The completion protocol's model (protocol_model.py), explored exhaustively.

The rule as of commit f521f4f must show the lapped combine (issue 30: every
token on one rank's experts, three combines back to back); the fixed rule (the
combines' reuse credit) must pass every program of up to 4 calls, at R = 2 and
R = 3, under every routing class, and under every assignment of a class to
each call (up to 4 calls at R = 2, E_local = 1; up to 3 elsewhere).
"""

import functools
import time

import pytest

import protocol_model as pm
from protocol_model import ModelConfig, Rule

# (R, E_local): E_local = 2 makes the pre-summed combine's flag and row of rank
# r alias the LL combine's of expert r, which another rank owns.
SHAPES = [(2, 1), (2, 2), (3, 1), (3, 2)]


def _routing(config: ModelConfig, name: str) -> pm.Routing:
  return next(r for r in pm.routing_classes(config) if r.name == name)


def _ops(program: pm.Program) -> int:
  """Calls, a split send and its recv counted once."""
  return sum(pm.CALL_KINDS[s].part is not pm.Part.RECV for s in program)


@functools.cache
def _families(config: ModelConfig, max_calls: int = 4) -> pm.Report:
  """pm.check_families, once per (config, max_calls) for the whole file: several
  tests look at the same sweep."""
  report = pm.check_families(config, max_calls)
  print(report.summary())
  return report


def _family_sweep(shape: tuple[int, int], rule: Rule) -> pm.Report:
  return _families(ModelConfig(*shape, rule))


def test_programs_are_the_valid_ones():
  by_family = pm.family_programs(4)
  assert {f: len(p) for f, p in by_family.items()} == {
      "ll_dispatch_seq": 11, "ll_combine_seq": 68, "ht_dispatch_seq": 4, "ht_combine_seq": 4}
  programs = set(pm.valid_programs(4))
  assert ("Cs", "D", "Cr") in programs and ("Ds", "C", "P", "Dr") in programs
  # A one-call op or a second send of a kind whose split send awaits its recv
  # is a protocol fault (kStatusProtocol); P shares the combine's pairing word.
  for faulty in [("Cs", "C", "Cr"), ("Cs", "Ps", "Pr", "Cr"), ("Ds", "D", "Dr"),
                 ("Cs", "Pr"), ("Cr",), ("Ds",)]:
    assert faulty not in programs
    with pytest.raises(pm.ProtocolFault):
      pm.compile_rank(ModelConfig(2), pm.Layout(ModelConfig(2)), faulty,
                      [pm.routing_classes(ModelConfig(2))[0]] * len(faulty), 0)
  mixed = pm.mixed_programs(4)
  assert len(mixed) + sum(len(p) for p in by_family.values()) == len(programs)


def test_sequence_numbers_follow_call_seq_and_tickets():
  config = ModelConfig(2)
  steps = [step for kernel in pm.compile_rank(config, pm.Layout(config),
                                              ("C", "Ps", "D", "Pr", "K", "C"),
                                              [pm.routing_classes(config)[0]] * 6, 0)
           for chain in kernel for step in chain]
  seqs = {}
  for step in steps:
    seqs.setdefault(step.call, set()).add(step.text.split()[2])
  # The combine family counts C and P together; the recv takes its send's ticket.
  assert seqs == {1: {"C#1"}, 2: {"Ps#2"}, 3: {"D#1"}, 4: {"Pr#2"}, 5: {"K#1"}, 6: {"C#3"}}


def test_f521f4f_laps_a_peer_in_three_combines():
  config = ModelConfig(2, rule=Rule.F521F4F)
  outcome = pm.explore(config, ("C", "C", "C"), _routing(config, "all to rank 0"))
  failure = outcome.failure
  assert failure is not None
  print(f"\nR=2, every token on rank 0's experts, C C C, rule f521f4f:\n{failure.render()}")
  assert failure.kind == "deadlock"
  # Rank 0 waits for no peer, finishes all three combines and overwrites the
  # parity-1 flag that rank 1's first combine still waits for.
  assert "rank 0 finished" in failure.message
  assert "rank 1 blocked at call 1 C#1" in failure.message
  assert "combine_flags[1][0] wait == seq 1, holds seq 3" in failure.message
  assert any(line.startswith("rank 0: call 3 C#3") for line in failure.trace)
  # Two combines cannot lap; the reuse credit keeps three from doing so.
  assert pm.explore(config, ("C", "C"), _routing(config, "all to rank 0")).failure is None
  fixed = ModelConfig(2, rule=Rule.FIXED)
  assert pm.explore(fixed, ("C", "C", "C"), _routing(fixed, "all to rank 0")).failure is None


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_f521f4f_fails_only_in_lapped_combines(shape):
  report = _family_sweep(shape, Rule.F521F4F)
  assert report.failures
  for f in report.failures:
    # Only the combine family, only with three of its ops (calls n, n+1, n+2
    # of one parity), never when every rank waits for every rank.
    assert {pm.family_of(s) for s in f.program} == {"ll_combine_seq"}, f
    assert _ops(f.program) >= 3 and f.routing != "uniform", f
    if shape[1] == 1:
      assert f.routing.startswith("all to rank"), f
  first = report.first_failure()
  print(f"\nshortest counterexample: {' '.join(first.program)} under '{first.routing}'\n"
        f"{first.failure.render()}")
  assert _ops(first.program) == 3 and first.routing.startswith("all to")
  if shape[0] == 2:
    assert first.program == ("C", "C", "C")
  failing = {(" ".join(f.program), f.routing) for f in report.failures}
  for program in ("C C C", "P P P", "C P C", "Cs Cr C C"):
    assert {(program, f"all to rank {j}") for j in range(shape[0])} <= failing


@pytest.mark.parametrize("shape", SHAPES)
def test_fixed_rule_passes_every_program(shape):
  report = _family_sweep(shape, Rule.FIXED)
  assert not report.failures, report.failures[0].failure.render()
  assert report.explorations == report.programs * len(pm.routing_classes(report.config))


@pytest.mark.parametrize("shape,max_calls", [((2, 1), 4), ((2, 2), 3), ((3, 1), 3)])
def test_fixed_rule_passes_with_a_routing_per_call(shape, max_calls):
  report = pm.check_families(ModelConfig(*shape), max_calls, per_call_routing=True)
  print(report.summary())
  assert not report.failures, report.failures[0].failure.render()


@pytest.mark.parametrize("num_ranks,rules", [(2, (Rule.F521F4F, Rule.FIXED)),
                                             (3, (Rule.FIXED,))])
def test_mixed_programs_fail_only_where_a_projection_does(num_ranks, rules):
  """The op families share no state (protocol_model's docstring): a mixed
  program fails only if one of its single-family projections does."""
  max_calls = 4
  for rule in rules:
    config = ModelConfig(num_ranks, rule=rule)
    start = time.perf_counter()
    families = _families(config, max_calls)
    failing = {(f.program, f.routing) for f in families.failures}
    mixed = pm.mixed_programs(max_calls)
    report = pm.check(config, mixed)
    print(f"mixed: {report.summary()} ({time.perf_counter() - start:.1f} s with projections)")
    for f in report.failures:
      projections = {pm.project(f.program, family) for family in pm.FAMILIES}
      assert any((p, f.routing) in failing for p in projections if p), f
    if rule is Rule.FIXED:
      assert not report.failures


def _small_programs(max_calls: int) -> list[pm.Program]:
  return [p for family in pm.family_programs(max_calls).values() for p in family]


# The full search grows fast with R: at R = 3 only programs whose full state
# space stays small.
R3_PROGRAMS = [("C", "C", "C"), ("C", "Cs", "Cr"), ("P", "P"), ("Ds", "Dr"), ("K", "K", "K")]


@pytest.mark.parametrize("rule", list(Rule))
@pytest.mark.parametrize("config,programs", [
    (ModelConfig(2), _small_programs(4)),
    (ModelConfig(2, 2), _small_programs(2)),
    (ModelConfig(3), R3_PROGRAMS),
])
def test_reduction_matches_the_full_search(rule, config, programs):
  """The persistent-set search reaches exactly the full search's terminal and
  deadlocked states (failed reads included: exhaustive runs)."""
  config = ModelConfig(config.num_ranks, config.experts_per_rank, rule)
  # 1.3 million states in full: R = 3's ("P", "P") under uniform routing is left out.
  cases = [(program, routing) for program in programs for routing in pm.routing_classes(config)
           if not (config.num_ranks == 3 and program == ("P", "P") and routing.name == "uniform")]
  reduced_states, full_states, failing = pm.compare_with_full(
      lambda program, routing, reduce: pm.Explorer(config, program, routing,
                                                   reduce=reduce).run(exhaustive=True), cases)
  assert bool(failing) == (rule is Rule.F521F4F and ("C", "C", "C") in programs)
  print(f"{rule.value} R={config.num_ranks}: {reduced_states} states reduced, "
        f"{full_states} full, {failing} failing")


@pytest.mark.parametrize("buffers,program", [
    (("combine_flags", "combine_recv"), ("C", "C")),
    (("combine_flags", "combine_recv"), ("P", "P")),
    (("dispatch_flags", "dispatch_recv", "dispatch_tokens"), ("D", "D")),
    (("ht_counts", "ht_notify_flags"), ("H", "H")),
    (("ht_combine_flags", "ht_combine_recv"), ("K", "K")),
])
def test_the_model_sees_what_the_parity_halves_prevent(buffers, program):
  """With one buffer instead of two halves, two calls already collide: the
  search is not vacuous (e.g. ht_kernels.cu: a peer that receives no rows
  from this rank publishes the next dispatch's counts while this rank still
  reads the current ones)."""
  for num_ranks in (2, 3):
    config = ModelConfig(num_ranks, single_buffered=frozenset(buffers))
    assert pm.check(config, [program]).failures
    assert not pm.check(ModelConfig(num_ranks), [program]).failures


def test_concurrent_blocks_cover_the_sequential_schedule():
  for rule in Rule:
    failing = []
    for concurrent in (False, True):
      config = ModelConfig(2, rule=rule, concurrent_blocks=concurrent)
      report = _families(config)
      failing.append({(f.program, f.routing) for f in report.failures})
    assert failing[0] <= failing[1]
    assert bool(failing[1]) == (rule is Rule.F521F4F)


def test_script(capsys):
  assert pm.main(["--rule", "f521f4f", "--ranks", "2", "--calls", "3"]) == 1
  out = capsys.readouterr().out
  assert "counterexample: program C C C, routing 'all to rank 0'" in out
  assert "deadlock" in out and "programs" in out and "states" in out
  assert pm.main(["--rule", "fixed", "--ranks", "3", "--calls", "3", "--mixed"]) == 0
  assert "no counterexample" in capsys.readouterr().out
