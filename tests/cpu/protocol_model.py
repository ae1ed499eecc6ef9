"""An executable model of the kernels' completion protocol, explored exhaustively.

The model runs R ranks (2 or 3) through the same program of jax_ep calls, one
step at a time, and searches every interleaving of the ranks' steps
(ranks run at arbitrary relative speeds). It is the protocols of
docs/design.md ("LL protocol", "HT protocol", "Completion protocol"; in short
at the top of each kernel file: cuda/ll_dispatch.cu, ll_combine.cu,
ll_presummed_kernels.cu, ht_dispatch.cu, ht_combine.cu) and of the comment at
the top of cuda/ll_presummed_kernels.cu turned into code; each step cites its
protocol's step number ("LL step 5").

Ops (program symbols): the LL dispatch (D one-call; Ds, Dr its split send and
recv), the LL combine (C; Cs, Cr), the LL combine pre-summed per rank (P; Ps,
Pr), the HT dispatch (H: one kernel, count exchange then rows) and the HT
combine (K: its send kernel, then its recv kernel). The backward passes' calls
are instances of these kinds: the LL combine's backward is an LL dispatch
carrying weights plus an LL combine returning values, the LL dispatch's
backward an LL combine, the HT dispatch's backward an HT combine and the HT
combine's backward an HT dispatch on cached routing (the same kernel). So
programs over this alphabet cover the calls of jax.grad too (e.g. C C C is the
forward combine, the combine-values and the dispatch's backward combine that
XLA may run back to back).

What the state holds (a rank only ever reads its own memory):
  * pcs: each thread's position in its chain of steps (a thread is one chain
    of one kernel of one rank, below). The device counters (DeviceCounters:
    the per-kind sequence numbers, the split sends' tickets and "outstanding"
    words) advance identically on every rank, as all ranks run the same
    program, so they are evaluated when the program is compiled
    (DeviceCounters below, after ll_common.cuh call_seq, finish_send and
    finish_call): every step carries its call's seq.
  * memory: every symmetric buffer cell that any step touches. A flag holds
    the seq of the call that wrote it (0 = never written; flags are never
    reset). A row slot holds a tag (op kind, call seq, writer rank). An HT
    chunk counter holds a count. Parity-alternating buffers have their two
    halves [p = seq & 1]. combine_flags and combine_recv are ONE array shared
    by the LL combine (index = expert e) and the pre-summed combine (index =
    rank r < R <= E), as in the kernels, so their cells alias; the two also
    share ll_combine_seq and ll_combine_outstanding.
Tokens are collapsed: the rows of one (source, expert) pair (LL) or (source,
owner rank) pair (pre-summed, HT) are one slot, written in one step. A routing
(Routing: which (source, expert) pairs are used) holds for every rank of a
call; one routing class for the whole program, or one per call (a split recv
takes its send's).

Steps (each a separate transition; Action below):
  WRITE   a store into a (peer's or its own) cell: a row's tag, a flag's seq,
          a counter's reset. Rows and flags to different peers are separate
          steps.
  ADD     red.add to an HT chunk counter.
  WAIT_EQ blocked until the cell holds the call's seq (the kernels compare a
          flag's seq for equality, device_common.cuh wait_flag).
  WAIT_GE blocked until an HT chunk counter reaches its rows (wait_count).
  READ    the data read after a wait, its own step: the cell must hold this
          call's tag, or the receiver "accepts a flag or row of another call"
          (an assertion failure).
A state where no rank can step and some rank has not finished is a deadlock
(the kernels would time out there); every exploration also checks that every
call ends (all ranks reach the end of the program in every terminal state).

Kernels and blocks. A call is one kernel (two for the HT combine: its send
kernel, then its recv kernel), and a rank's next kernel starts after its
previous one ended (stream order). A kernel's blocks run concurrently, so a
call's steps form chains that interleave freely with each other and with the
peers' steps (ModelConfig.concurrent_blocks): the LL dispatch sends one chain
per owner rank (the payload before the flags of the token's experts there,
each flag after its expert's rows) and receives one chain per local expert
(every source's flag, then the rows); the LL combine sends one chain per local
expert (its rows, then its flag on every rank), the pre-summed one chain per
source (its row, then its flag); a combine receives in one chain (the needed
flags, then the rows) while block 0's reuse credit is a chain of its own
(any order against the rows: the credit only has to precede the kernel's
end). The HT dispatch is block 0 with the senders (counts and notify flag to
every rank, every rank's flag and counts, then the rows and the chunk adds)
and the receivers (every rank's flag and counts, then per source the chunk
wait and reset, then the rows). Within a chain the order is the one the
kernel's block keeps (rows before their flag, a wait before its reads).

Rules (Rule): F521F4F, the combines as of commit f521f4f (an LL combine's
receive waits only for the flags of its tokens' experts, and reads its own
experts' rows from y without a flag; a pre-summed receive waits only for the
ranks holding its tokens' experts), and FIXED, the same plus the reuse credit:
once per call the receive waits for one flag of this call from every peer
q != me (LL step 7: combine_flags[p][q * E_local]; ll_presummed
step 5: combine_flags[p][q]). Under F521F4F the search finds the lapped
combine: with every token on rank 0's experts, rank 0 waits for no peer in a
combine, runs three combines and writes the parity-p flag of call 3 into rank 1
while rank 1 still waits for that cell to carry call 1's seq (a deadlock).

Search: explicit-state breadth-first search with a visited set, reduced by
persistent sets (partial-order reduction): at a state, if the next step t of
some thread i touches no cell that any other thread could touch (conflicting:
a write against any access) before i moves, only t is explored. The steps the
others could take first are over-approximated by running each of them forward
while thread i is frozen, past a wait only if its cell already holds the
awaited value or some other non-frozen thread could write it first, and into a
kernel only once the kernel before could have ended (a fixpoint). The
state graph is acyclic (pcs only grow), so this selective search reaches every
deadlock and every terminal state of the full search (Godefroid's theorem); a
failed READ is a transition to an error sink, so it is found too. The test
file checks the reduction against the full search on small programs.

Independence of op families: the LL dispatch family (D), the LL combine family
(C, P: shared seq counter and buffers), the HT dispatch (H) and the HT combine
(K) share no cell, no sequence counter and no outstanding word; their calls
are coupled only by each rank's stream order. The projection of an execution
of a mixed program onto one family's steps is an execution of the projected
program (only program order and that family's cells constrain it). So a wrong
read in a mixed program is a wrong read of a projection. And a deadlock D of a
mixed program gives one of a projection: take the earliest call c (in program
order) at which some rank is blocked, of family F. Every rank is finished,
past c or blocked in c; the values c's waits need (its seq) are written only
in call c, by ranks past c (who did so already) or blocked in c (who cannot in
the projection either); later calls write other seqs (a later chunk-counter
add would be followed by a wrong read). So from D's projection the ranks
blocked in c stay blocked: the projected program has a reachable deadlock or
wrong read. Hence single-family programs of up to N calls decide every mixed
program of up to N calls. Mixed programs are explored too (the tests): one
fails only where a projection does (not conversely: another family's waits
in between can keep a rank from lapping).

Not modelled: rank masking; RDMA (a signal on the queue pair of the data,
ordered after it like the NVLink release the model assumes); the FP8 one-call
dispatch's own payload copy (a cell only this rank writes and reads); the
combine_values buffer (the same protocol as combine_recv); one rank (R = 1).
Faults (timeouts) end a wait in the kernels; the model reports them as
deadlocks instead.

Run as a script:
  python tests/cpu/protocol_model.py --rule f521f4f|fixed --ranks 2 --calls 4
"""

from __future__ import annotations

import argparse
import bisect
import collections
import dataclasses
import enum
import itertools
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence


class Rule(enum.Enum):
  """The combines' receive rule."""

  F521F4F = "f521f4f"  # wait only for the flags the tokens need
  FIXED = "fixed"  # and, once per call, for one flag of every peer (the reuse credit)


class OpKind(enum.IntEnum):
  """The op kinds; the value is the kind's field in a row tag."""

  LL_DISPATCH = 0
  LL_COMBINE = 1
  LL_PRESUMMED = 2
  HT_DISPATCH = 3
  HT_COMBINE = 4


class Part(enum.Enum):
  """Which parts of an op one call runs."""

  BOTH = "one-call"
  SEND = "split send"
  RECV = "split recv"


@dataclasses.dataclass(frozen=True)
class CallKind:
  """One program symbol: an op kind and the parts its call runs."""

  symbol: str
  op: OpKind
  part: Part


CALL_KINDS: dict[str, CallKind] = {
    kind.symbol: kind for kind in (
        CallKind("D", OpKind.LL_DISPATCH, Part.BOTH),
        CallKind("Ds", OpKind.LL_DISPATCH, Part.SEND),
        CallKind("Dr", OpKind.LL_DISPATCH, Part.RECV),
        CallKind("C", OpKind.LL_COMBINE, Part.BOTH),
        CallKind("Cs", OpKind.LL_COMBINE, Part.SEND),
        CallKind("Cr", OpKind.LL_COMBINE, Part.RECV),
        CallKind("P", OpKind.LL_PRESUMMED, Part.BOTH),
        CallKind("Ps", OpKind.LL_PRESUMMED, Part.SEND),
        CallKind("Pr", OpKind.LL_PRESUMMED, Part.RECV),
        CallKind("H", OpKind.HT_DISPATCH, Part.BOTH),
        CallKind("K", OpKind.HT_COMBINE, Part.BOTH),
    )
}

# The sequence counter of each kind (DeviceCounters in cuda/ep_types.h). Kinds
# that share one are one family: they share buffers, seq and the split pairing.
SEQ_COUNTER: dict[OpKind, str] = {
    OpKind.LL_DISPATCH: "ll_dispatch_seq",
    OpKind.LL_COMBINE: "ll_combine_seq",
    OpKind.LL_PRESUMMED: "ll_combine_seq",
    OpKind.HT_DISPATCH: "ht_dispatch_seq",
    OpKind.HT_COMBINE: "ht_combine_seq",
}
FAMILIES: tuple[str, ...] = ("ll_dispatch_seq", "ll_combine_seq", "ht_dispatch_seq",
                             "ht_combine_seq")
KIND_LETTER = {OpKind.LL_DISPATCH: "D", OpKind.LL_COMBINE: "C", OpKind.LL_PRESUMMED: "P",
               OpKind.HT_DISPATCH: "H", OpKind.HT_COMBINE: "K"}

Program = tuple[str, ...]


def family_of(symbol: str) -> str:
  """The sequence counter (family) of a program symbol."""
  return SEQ_COUNTER[CALL_KINDS[symbol].op]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The modelled system.

  concurrent_blocks: a call's chains (the kernel's blocks: each destination's
  sends, the receive, block 0's reuse credit) run concurrently, as on the GPU;
  False runs them one after the other in the order they are built (sends,
  then receives), one schedule of them.
  single_buffered names parity-alternating buffers whose two halves the model
  merges into one: a deliberately broken protocol, to show that the search
  catches what the parity halves prevent (the tests use it).
  """

  num_ranks: int
  experts_per_rank: int = 1
  rule: Rule = Rule.FIXED
  concurrent_blocks: bool = True
  single_buffered: frozenset[str] = frozenset()

  def __post_init__(self) -> None:
    if not 2 <= self.num_ranks <= 4:
      raise ValueError("the model runs 2 to 4 ranks (tags hold the writer in 2 bits)")
    if self.experts_per_rank < 1:
      raise ValueError("experts_per_rank must be >= 1")

  @property
  def num_experts(self) -> int:
    return self.num_ranks * self.experts_per_rank

  def owner(self, expert: int) -> int:
    return expert // self.experts_per_rank


@dataclasses.dataclass(frozen=True)
class Routing:
  """Which (source rank, expert) pairs some token of the source uses.

  It decides which rows a source sends to each owner rank and which flags a
  combine's receiver waits for (its tokens' experts, or their ranks).
  """

  name: str
  pairs: frozenset[tuple[int, int]]

  def uses(self, source: int, expert: int) -> bool:
    return (source, expert) in self.pairs

  def experts_of(self, source: int) -> tuple[int, ...]:
    return tuple(sorted(e for s, e in self.pairs if s == source))

  def has_rows(self, config: ModelConfig, source: int, owner: int) -> bool:
    """Whether some token of `source` uses an expert on `owner`."""
    return any(config.owner(e) == owner for e in self.experts_of(source))

  def ranks_of(self, config: ModelConfig, source: int) -> tuple[int, ...]:
    """The ranks holding the source's tokens' experts, ascending."""
    return tuple(sorted({config.owner(e) for e in self.experts_of(source)}))


def routing_classes(config: ModelConfig) -> tuple[Routing, ...]:
  """uniform (every source uses every expert), all to rank j's experts (each
  j), all to one expert (each, when a rank has several), none (every entry -1:
  no rows at all) and all to self (each source only its own rank's experts)."""
  ranks, experts = range(config.num_ranks), range(config.num_experts)
  classes = [Routing("uniform", frozenset(itertools.product(ranks, experts)))]
  for j in ranks:
    classes.append(Routing(f"all to rank {j}", frozenset(
        (s, e) for s in ranks for e in experts if config.owner(e) == j)))
  if config.experts_per_rank > 1:
    for x in experts:
      classes.append(Routing(f"all to expert {x}", frozenset((s, x) for s in ranks)))
  classes.append(Routing("none", frozenset()))
  classes.append(Routing("all to self", frozenset(
      (s, e) for s in ranks for e in experts if config.owner(e) == s)))
  return tuple(classes)


class Holds(enum.Enum):
  FLAG = "flag"  # the seq of the call that wrote it
  ROW = "row"  # a tag (kind, seq, writer)
  COUNT = "count"  # an HT chunk arrival counter


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A symmetric buffer of every rank: name, shape (the parity half first
  where `parity`) and what a cell holds. Names follow ep_types.h / ht_types.h."""

  name: str
  shape: tuple[int, ...]
  holds: Holds
  parity: bool


def buffers_of(config: ModelConfig) -> tuple[Buffer, ...]:
  r, el, e = config.num_ranks, config.experts_per_rank, config.num_experts
  return (
      Buffer("dispatch_flags", (2, el, r), Holds.FLAG, True),  # [p][le][source]
      Buffer("dispatch_recv", (2, el, r), Holds.ROW, True),  # slot headers, [p][le][source]
      Buffer("dispatch_tokens", (2, r), Holds.ROW, True),  # payloads, [p][source]
      Buffer("combine_flags", (2, e), Holds.FLAG, True),  # [p][expert] LL, [p][rank] pre-summed
      Buffer("combine_recv", (2, e), Holds.ROW, True),  # [p][expert] LL, [p][rank] pre-summed
      Buffer("ht_counts", (2, r), Holds.ROW, True),  # counts[p][source][*]
      Buffer("ht_notify_flags", (2, r), Holds.FLAG, True),  # [p][source]
      Buffer("ht_recv", (r,), Holds.ROW, False),  # recv_* rows of each source (single)
      Buffer("ht_chunk_arrived", (r,), Holds.COUNT, False),  # [source] (one chunk each)
      Buffer("ht_combine_flags", (2, r), Holds.FLAG, True),  # [p][rank]
      Buffer("ht_combine_recv", (2, r), Holds.ROW, True),  # [p][rank]
  )


def encode_tag(op: OpKind, seq: int, writer: int) -> int:
  """A row's tag as one byte: the op kind, the call's seq and the writer rank."""
  if not 1 <= seq <= 12:
    raise ValueError("the model's tags hold seq 1..12")
  return 1 + ((seq - 1) * 5 + int(op)) * 4 + writer


def decode_tag(tag: int) -> str:
  if tag == 0:
    return "nothing"
  index, writer = divmod(tag - 1, 4)
  seq_index, op = divmod(index, 5)
  return f"{KIND_LETTER[OpKind(op)]}#{seq_index + 1} row from rank {writer}"


class Layout:
  """Numbers the cells (rank, buffer, index) of every rank's buffers; the
  explorer keeps only the cells a program touches, renumbered densely."""

  def __init__(self, config: ModelConfig):
    self.config = config
    self.buffers = {b.name: b for b in buffers_of(config)}
    self._cells: dict[tuple[int, str, tuple[int, ...]], int] = {}
    self.names: list[str] = []
    self.holds: list[Holds] = []

  def cell(self, rank: int, buffer: str, index: tuple[int, ...]) -> int:
    spec = self.buffers[buffer]
    if len(index) != len(spec.shape) or any(not 0 <= i < n for i, n in zip(index, spec.shape)):
      raise IndexError(f"{buffer}{list(index)} outside {spec.shape}")
    if spec.parity and buffer in self.config.single_buffered:
      index = (0,) + index[1:]
    key = (rank, buffer, index)
    if key not in self._cells:
      self._cells[key] = len(self.names)
      self.names.append(f"rank {rank} {buffer}" + "".join(f"[{i}]" for i in index))
      self.holds.append(spec.holds)
    return self._cells[key]

  def describe_value(self, cell: int, value: int) -> str:
    holds = self.holds[cell]
    if holds is Holds.ROW:
      return decode_tag(value)
    if holds is Holds.FLAG:
      return f"seq {value}" if value else "seq 0 (never written)"
    return f"count {value}"


class Action(enum.IntEnum):
  WRITE = 0  # store `value` into the cell (a peer's or the rank's own)
  ADD = 1  # add `value` to a counter (red.relaxed.sys.add)
  WAIT_EQ = 2  # blocked until the cell holds `value` (a flag carrying the call's seq)
  WAIT_GE = 3  # blocked until the counter is >= `value` (an HT chunk's rows)
  READ = 4  # the data read after a wait: the cell must hold `value` (this call's tag)


# The actions as plain ints, for the search's inner loops (an enum member's
# lookup there costs more than the comparison).
_WRITE, _ADD, _WAIT_EQ, _WAIT_GE, _READ = (int(a) for a in (Action.WRITE, Action.ADD,
                                                            Action.WAIT_EQ, Action.WAIT_GE,
                                                            Action.READ))


@dataclasses.dataclass(frozen=True)
class Step:
  """One transition of one rank: an action on a cell, in call `call` of the
  program; `text` says which protocol step of which kernel file it is."""

  action: Action
  cell: int
  value: int
  call: int
  text: str


class ProtocolFault(ValueError):
  """A program the kernels reject (kStatusProtocol: a one-call op, or a second
  split send, of a kind whose split send awaits its recv), or one that is not
  a program at all (a recv with no send of its op, a send never received)."""


@dataclasses.dataclass
class DeviceCounters:
  """The pairing words of DeviceCounters (cuda/ep_types.h): per family the
  sequence number of the last send, the ticket a split send hands its recv
  and which kind's split send is outstanding (ll_common.cuh call_seq,
  finish_send, finish_call; ht_dispatch.cu: counter + 1, advanced at the end)."""

  seq: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(FAMILIES, 0))
  ticket: dict[str, int] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(FAMILIES, 0))
  outstanding: dict[str, OpKind | None] = dataclasses.field(
      default_factory=lambda: dict.fromkeys(FAMILIES, None))

  def start(self, kind: CallKind) -> int:
    """The call's seq (call_seq), or ProtocolFault."""
    family = SEQ_COUNTER[kind.op]
    waiting = self.outstanding[family]
    if kind.part is Part.RECV:
      if waiting is not kind.op:
        raise ProtocolFault(f"{kind.symbol} without an outstanding send of its op")
      return self.ticket[family]
    if waiting is not None:
      raise ProtocolFault(f"{kind.symbol} while a split send of {family} awaits its recv")
    return self.seq[family] + 1

  def finish(self, kind: CallKind, seq: int) -> None:
    """finish_call's bookkeeping (one-call: the seq; split send: the ticket and
    the outstanding word too; split recv: its send is no longer outstanding)."""
    family = SEQ_COUNTER[kind.op]
    if kind.part is Part.RECV:
      self.outstanding[family] = None
      return
    self.seq[family] = seq
    if kind.part is Part.SEND:
      self.ticket[family] = seq
      self.outstanding[family] = kind.op

  def check_closed(self) -> None:
    for family, waiting in self.outstanding.items():
      if waiting is not None:
        raise ProtocolFault(f"a split send of {family} never received")


def program_is_valid(program: Program) -> bool:
  counters = DeviceCounters()
  try:
    for symbol in program:
      kind = CALL_KINDS[symbol]
      counters.finish(kind, counters.start(kind))
    counters.check_closed()
  except ProtocolFault:
    return False
  return True


def valid_programs(max_calls: int, symbols: Iterable[str] = tuple(CALL_KINDS),
                   min_calls: int = 1) -> tuple[Program, ...]:
  """Every valid program of min_calls..max_calls calls over `symbols` (a
  split send and its recv are two calls), in length then lexical order."""
  symbols = tuple(symbols)
  found = []
  for length in range(min_calls, max_calls + 1):
    found.extend(p for p in itertools.product(symbols, repeat=length) if program_is_valid(p))
  return tuple(found)


def family_programs(max_calls: int) -> dict[str, tuple[Program, ...]]:
  """The valid programs of each family alone."""
  return {family: valid_programs(max_calls, [s for s in CALL_KINDS if family_of(s) == family])
          for family in FAMILIES}


def mixed_programs(max_calls: int) -> tuple[Program, ...]:
  """The valid programs with calls of at least two families."""
  return tuple(p for p in valid_programs(max_calls)
               if len({family_of(s) for s in p}) > 1)


def project(program: Program, family: str) -> Program:
  return tuple(s for s in program if family_of(s) == family)


class _CallSteps:
  """Builds one rank's steps of one call: kernels (segments, run in stream
  order), each a set of chains of steps that run concurrently (the kernel's
  blocks; ModelConfig.concurrent_blocks), every chain in program order."""

  def __init__(self, config: ModelConfig, layout: Layout, routing: Routing, rank: int,
               kind: CallKind, seq: int, call: int):
    self.config, self.layout, self.routing, self.me = config, layout, routing, rank
    self.kind, self.seq, self.call = kind, seq, call
    self.p = seq & 1
    self.kernels: list[list[list[Step]]] = []
    self.label = f"call {call} {kind.symbol}#{seq}"

  @property
  def sends(self) -> bool:
    return self.kind.part in (Part.BOTH, Part.SEND)

  @property
  def receives(self) -> bool:
    return self.kind.part in (Part.BOTH, Part.RECV)

  @property
  def one_call(self) -> bool:
    return self.kind.part is Part.BOTH

  def kernel(self) -> None:
    """Starts the next kernel of the call (it runs after the one before ends)."""
    self.kernels.append([])

  def chain(self) -> None:
    """Starts a chain of the current kernel, concurrent with its others."""
    self.kernels[-1].append([])

  def tag(self, writer: int | None = None) -> int:
    return encode_tag(self.kind.op, self.seq, self.me if writer is None else writer)

  def _add(self, action: Action, rank: int, buffer: str, index: tuple[int, ...], value: int,
           where: str) -> None:
    cell = self.layout.cell(rank, buffer, index)
    verb = {Action.WRITE: ":=", Action.ADD: "+=", Action.WAIT_EQ: "wait ==",
            Action.WAIT_GE: "wait >=", Action.READ: "read, expects"}[action]
    shown = (str(value) if self.layout.holds[cell] is Holds.COUNT
             else self.layout.describe_value(cell, value))
    self.kernels[-1][-1].append(Step(
        action, cell, value, self.call,
        f"{self.label} ({where}): {self.layout.names[cell]} {verb} {shown}"))

  def write(self, rank: int, buffer: str, index: tuple[int, ...], value: int, where: str):
    self._add(Action.WRITE, rank, buffer, index, value, where)

  def add(self, rank: int, buffer: str, index: tuple[int, ...], value: int, where: str):
    self._add(Action.ADD, rank, buffer, index, value, where)

  def wait(self, buffer: str, index: tuple[int, ...], where: str) -> None:
    self._add(Action.WAIT_EQ, self.me, buffer, index, self.seq, where)

  def wait_at_least(self, buffer: str, index: tuple[int, ...], value: int, where: str):
    self._add(Action.WAIT_GE, self.me, buffer, index, value, where)

  def read(self, buffer: str, index: tuple[int, ...], writer: int, where: str) -> None:
    self._add(Action.READ, self.me, buffer, index, self.tag(writer), where)

  # ------------------------------------------------------------------ LL
  def ll_dispatch(self) -> None:
    """LL steps 1-4 (step 1, the routing pass, is local). Chains:
    one per owner rank (its experts in order), one per local expert received."""
    cfg, me, p, routing = self.config, self.me, self.p, self.routing
    el = cfg.experts_per_rank
    self.kernel()
    if self.sends:
      for owner in range(cfg.num_ranks):
        self.chain()
        payload_sent = False
        for le in range(el):
          e = owner * el + le
          if not routing.uses(me, e):  # step 3: an expert no token uses: (seq, 0) at once
            self.write(owner, "dispatch_flags", (p, le, me), self.seq,
                       "LL step 3, no rows")
            continue
          # Step 2: the payload once per (token, owner), by its first expert
          # there (before the token's block barrier, so before any of the
          # token's flags); the one-call BF16 op's own pairs skip it (x).
          if not payload_sent and not (self.one_call and owner == me):
            self.write(owner, "dispatch_tokens", (p, me), self.tag(), "LL step 2")
            payload_sent = True
          self.write(owner, "dispatch_recv", (p, le, me), self.tag(), "LL step 2")
          # Step 3: the last arriver of expert e sets its flag after its rows.
          self.write(owner, "dispatch_flags", (p, le, me), self.seq, "LL step 3")
    if self.receives:
      for le in range(el):
        self.chain()
        reads: list[tuple[str, tuple[int, ...], int]] = []
        for s in range(cfg.num_ranks):  # step 4: every (expert, source) flag, then the rows
          self.wait("dispatch_flags", (p, le, s), "LL step 4")
          if routing.uses(s, me * el + le):
            reads.append(("dispatch_recv", (p, le, s), s))
            if not (self.one_call and s == me):
              reads.append(("dispatch_tokens", (p, s), s))
        for buffer, index, writer in reads:
          self.read(buffer, index, writer, "LL step 4")

  def ll_combine(self) -> None:
    """LL steps 5-7. Chains: one per local expert sent; the tokens
    received; block 0's reuse credit."""
    cfg, me, p, routing = self.config, self.me, self.p, self.routing
    el = cfg.experts_per_rank
    self.kernel()
    if self.sends:
      for le in range(el):  # step 5
        self.chain()
        e = me * el + le
        for s in range(cfg.num_ranks):
          if routing.uses(s, e) and not (self.one_call and s == me):
            self.write(s, "combine_recv", (p, e), self.tag(), "LL step 5")
        for r in range(cfg.num_ranks):  # after expert le's rows, its flag on every rank
          if not (self.one_call and r == me):
            self.write(r, "combine_flags", (p, e), self.seq, "LL step 5")
    if self.receives:
      # Step 6: the flags of the tokens' experts; the one-call op reads its
      # own experts' rows from y, without a flag.
      needed = [e for e in routing.experts_of(me)
                if not (self.one_call and cfg.owner(e) == me)]
      self.chain()
      for e in needed:
        self.wait("combine_flags", (p, e), "LL step 6")
      for e in needed:
        self.read("combine_recv", (p, e), cfg.owner(e), "LL step 6")
      if cfg.rule is Rule.FIXED:
        self.chain()
        for q in range(cfg.num_ranks):  # step 7: the reuse credit of every peer
          if q != me:
            self.wait("combine_flags", (p, q * el), "LL step 7, reuse credit")

  def ll_presummed(self) -> None:
    """ll_presummed_kernels.cu steps 1-5 (step 1, the listing, is local).
    Chains: one per source sent to; the tokens received; the reuse credit."""
    cfg, me, p, routing = self.config, self.me, self.p, self.routing
    self.kernel()
    if self.sends:
      for s in range(cfg.num_ranks):
        self.chain()
        if routing.has_rows(cfg, s, me):  # step 2: one row per (token, rank), r itself too
          self.write(s, "combine_recv", (p, me), self.tag(), "ll_presummed step 2")
        # Step 3: after all units of s (even with no rows), s's flag [p][me].
        self.write(s, "combine_flags", (p, me), self.seq, "ll_presummed step 3")
    if self.receives:
      ranks = routing.ranks_of(cfg, me)
      self.chain()
      for r in ranks:  # step 4: the ranks holding the tokens' experts
        self.wait("combine_flags", (p, r), "ll_presummed step 4")
      for r in ranks:
        self.read("combine_recv", (p, r), r, "ll_presummed step 4")
      if cfg.rule is Rule.FIXED:
        self.chain()
        for q in range(cfg.num_ranks):  # step 5: the reuse credit of every peer
          if q != me:
            self.wait("combine_flags", (p, q), "ll_presummed step 5, reuse credit")

  # ------------------------------------------------------------------ HT
  def ht_dispatch(self) -> None:
    """HT dispatch steps 1-4 (step 1, the send plan, is local).
    Chains: block 0 and the senders; the receivers."""
    cfg, me, p, routing = self.config, self.me, self.p, self.routing
    exchange = "HT step 2, count exchange"
    self.kernel()
    self.chain()
    for r in range(cfg.num_ranks):  # block 0: counts, then the notify flag, to every rank
      self.write(r, "ht_counts", (p, me), self.tag(), exchange)
      self.write(r, "ht_notify_flags", (p, me), self.seq, exchange)
    for s in range(cfg.num_ranks):  # every rank's flag (its own included), then its counts
      self.wait("ht_notify_flags", (p, s), exchange)
      self.read("ht_counts", (p, s), s, exchange)
    for r in range(cfg.num_ranks):  # step 3: rows into single recv buffers, then the adds
      if r != me and routing.has_rows(cfg, me, r):
        self.write(r, "ht_recv", (me,), self.tag(), "HT step 3")
        self.add(r, "ht_chunk_arrived", (me,), 1, "HT step 3")
    self.chain()
    for s in range(cfg.num_ranks):  # a receiver block waits for the count exchange too
      self.wait("ht_notify_flags", (p, s), exchange)
      self.read("ht_counts", (p, s), s, exchange)
    sources = [s for s in range(cfg.num_ranks) if s != me and routing.has_rows(cfg, s, me)]
    for s in sources:  # step 4: the chunk's rows have landed; the receiver resets it
      self.wait_at_least("ht_chunk_arrived", (s,), 1, "HT step 4")
      self.write(me, "ht_chunk_arrived", (s,), 0, "HT step 4, reset")
    for s in sources:
      self.read("ht_recv", (s,), s, "HT step 4")

  def ht_combine(self) -> None:
    """HT combine: ht_combine_send, then ht_combine_recv (stream order)."""
    cfg, me, p, routing = self.config, self.me, self.p, self.routing
    self.kernel()
    self.chain()
    for s in range(cfg.num_ranks):
      if s != me and routing.has_rows(cfg, s, me):
        self.write(s, "ht_combine_recv", (p, me), self.tag(), "ht_combine_send")
    for r in range(cfg.num_ranks):  # the last block: the flag on every rank
      self.write(r, "ht_combine_flags", (p, me), self.seq, "ht_combine_send")
    self.kernel()
    self.chain()
    for r in range(cfg.num_ranks):  # every rank's flag
      self.wait("ht_combine_flags", (p, r), "ht_combine_recv")
    for r in range(cfg.num_ranks):
      if r != me and routing.has_rows(cfg, me, r):
        self.read("ht_combine_recv", (p, r), r, "ht_combine_recv")

  def build(self) -> list[list[list[Step]]]:
    {OpKind.LL_DISPATCH: self.ll_dispatch, OpKind.LL_COMBINE: self.ll_combine,
     OpKind.LL_PRESUMMED: self.ll_presummed, OpKind.HT_DISPATCH: self.ht_dispatch,
     OpKind.HT_COMBINE: self.ht_combine}[self.kind.op]()
    kernels = [[chain for chain in kernel if chain] for kernel in self.kernels]
    if not self.config.concurrent_blocks:
      kernels = [[[step for chain in kernel for step in chain]] for kernel in kernels]
    return [kernel for kernel in kernels if kernel and kernel[0]]


Kernel = list[list[Step]]  # concurrent chains of steps


def compile_rank(config: ModelConfig, layout: Layout, program: Program,
                 routings: Sequence[Routing], rank: int) -> list[Kernel]:
  """One rank's kernels for the whole program, in stream order."""
  counters = DeviceCounters()
  kernels: list[Kernel] = []
  for call, (symbol, routing) in enumerate(zip(program, routings, strict=True), start=1):
    kind = CALL_KINDS[symbol]
    seq = counters.start(kind)
    kernels.extend(_CallSteps(config, layout, routing, rank, kind, seq, call).build())
    counters.finish(kind, seq)
  counters.check_closed()
  return kernels


def routing_assignments(program: Program, classes: Sequence[Routing],
                        per_call: bool) -> Iterator[tuple[Routing, ...]]:
  """The routings of the program's calls: one class for all of them, or (per
  call) every choice for each op, a split recv taking its send's."""
  if not per_call:
    for routing in classes:
      yield (routing,) * len(program)
    return
  ops = [i for i, s in enumerate(program) if CALL_KINDS[s].part is not Part.RECV]
  for choice in itertools.product(classes, repeat=len(ops)):
    chosen: dict[int, Routing] = dict(zip(ops, choice))
    sent: dict[str, Routing] = {}
    assignment = []
    for i, symbol in enumerate(program):
      if CALL_KINDS[symbol].part is Part.RECV:
        assignment.append(sent[family_of(symbol)])
      else:
        assignment.append(chosen[i])
        sent[family_of(symbol)] = chosen[i]
    yield tuple(assignment)


def routing_name(routings: Sequence[Routing]) -> str:
  names = [r.name for r in routings]
  return names[0] if len(set(names)) == 1 else " | ".join(names)


@dataclasses.dataclass(frozen=True)
class Failure:
  """A counterexample: what went wrong and the steps that led there."""

  kind: str  # "deadlock" or "wrong read"
  message: str
  trace: tuple[str, ...]

  def render(self) -> str:
    return "\n".join([f"{self.kind}: {self.message}", *(f"  {line}" for line in self.trace)])


@dataclasses.dataclass(frozen=True)
class Outcome:
  """One exploration: states visited, terminal states (every rank finished)
  and the first failure found, if any. An exhaustive run (Explorer.run) goes
  on past failures and also holds the set of terminal states and the set of
  deadlocked states (both with the error byte: whether some read failed)."""

  states: int
  terminal_states: int
  failure: Failure | None
  terminal: frozenset[bytes] = frozenset()
  deadlocks: frozenset[bytes] = frozenset()


HALTED = 255  # the pc of a thread whose read failed (exhaustive runs)


class Explorer:
  """The search over one (config, program, routings).

  Threads are the chains of every rank's kernels; a thread may step once every
  thread of its rank's previous kernel has finished (stream order). The state
  is bytes: every thread's pc, then every cell the program touches, then the
  error byte.
  """

  def __init__(self, config: ModelConfig, program: Program,
               routings: Routing | Sequence[Routing], reduce: bool = True):
    if isinstance(routings, Routing):
      routings = (routings,) * len(program)
    self.config, self.program, self.reduce = config, program, reduce
    self.routings = tuple(routings)
    layout = Layout(config)
    self.layout = layout
    self.thread_rank: list[int] = []
    self.steps: list[list[Step]] = []
    self.gate: list[tuple[int, ...]] = []  # the threads of the rank's previous kernel
    for rank in range(config.num_ranks):
      previous: tuple[int, ...] = ()
      for kernel in compile_rank(config, layout, program, self.routings, rank):
        ids = tuple(range(len(self.steps), len(self.steps) + len(kernel)))
        for chain in kernel:
          self.thread_rank.append(rank)
          self.steps.append(chain)
          self.gate.append(previous)
        previous = ids
    self.index_steps(len(layout.names))

  def index_steps(self, num_cells: int) -> None:
    """The tables the search reads, from self.steps over num_cells memory cells
    (also called by models built on this one: protocol_model_two_level)."""
    n = len(self.steps)
    if n > 255 or max((len(s) for s in self.steps), default=0) >= HALTED:
      raise ValueError("the model's pcs are bytes: at most 255 threads of 254 steps")
    self.num_threads = n
    self.lengths = [len(steps) for steps in self.steps]
    self.actions = [[int(s.action) for s in steps] for steps in self.steps]
    self.cells = [[n + s.cell for s in steps] for steps in self.steps]
    self.values = [[s.value for s in steps] for steps in self.steps]
    # Per cell, the threads that write it and the threads that touch it, each
    # with the indices of those steps (ascending threads): the reduction looks
    # at those threads only.
    writes_of: dict[int, list[tuple[int, list[int]]]] = collections.defaultdict(list)
    touches_of: dict[int, list[tuple[int, list[int]]]] = collections.defaultdict(list)
    for j, (actions, cells) in enumerate(zip(self.actions, self.cells)):
      writes: dict[int, list[int]] = collections.defaultdict(list)
      touches: dict[int, list[int]] = collections.defaultdict(list)
      for k, (action, cell) in enumerate(zip(actions, cells)):
        touches[cell].append(k)
        if action in (Action.WRITE, Action.ADD):
          writes[cell].append(k)
      for cell, indices in writes.items():
        writes_of[cell].append((j, indices))
      for cell, indices in touches.items():
        touches_of[cell].append((j, indices))
    self.writes_of = dict(writes_of)
    self.touches_of = dict(touches_of)
    # Each thread's gate as a slice [start, stop) of the threads (a kernel's
    # chains are consecutive threads): the gate test, the search's most
    # frequent, then compares two slices instead of looping over the threads.
    self.gate_slices: list[tuple[int, int]] = []
    for gate in self.gate:
      start = gate[0] if gate else 0
      if gate != tuple(range(start, start + len(gate))):
        raise ValueError(f"a gate of consecutive threads, not {gate}")
      self.gate_slices.append((start, start + len(gate)))
    self.lengths_bytes = bytes(self.lengths)
    self.error_byte = n + num_cells  # 1 once a read failed (exhaustive runs)
    self.initial = bytes(n + num_cells + 1)

  # -------------------------------------------------------------- reduction
  def _frontier(self, state: bytes, frozen: int) -> list[int]:
    """For every thread but `frozen`, how far it could run before `frozen`
    moves (an over-approximation: a thread starts once its gate could have
    finished; a wait is passed if its cell holds the value now, or some
    non-frozen thread could write it first)."""
    front = list(state[:self.num_threads])
    lengths, gate_slices = self.lengths, self.gate_slices
    can_write: set[tuple[int, int]] = set()
    can_add: set[int] = set()
    changed = True
    while changed:
      changed = False
      for j in range(self.num_threads):
        k, end = front[j], lengths[j]
        if j == frozen or k == end:
          continue
        start, stop = gate_slices[j]
        if front[start:stop] != lengths[start:stop]:
          continue
        actions, cells, values = self.actions[j], self.cells[j], self.values[j]
        while k < end:
          action, cell, value = actions[k], cells[k], values[k]
          if action == _WAIT_EQ:
            if state[cell] != value and (cell, value) not in can_write:
              break
          elif action == _WAIT_GE:
            if state[cell] < value and cell not in can_add:
              break
          elif action == _WRITE:
            can_write.add((cell, value))
          elif action == _ADD:
            can_add.add(cell)
          k += 1
        if k != front[j]:
          front[j] = k
          changed = True
    return front

  def _persistent(self, state: bytes, i: int) -> bool:
    """Whether thread i's next step alone is a persistent set at `state`: no
    step another thread could take before it touches its cell (a write
    against any access)."""
    pc = state[i]
    cell = self.cells[i][pc]
    writes = self.actions[i][pc] in (_WRITE, _ADD)
    table = self.touches_of if writes else self.writes_of
    pending = [(j, indices) for j, indices in table.get(cell, ())
               if j != i and indices[-1] >= state[j]]
    if not pending:
      return True
    front = self._frontier(state, i)
    for j, indices in pending:
      k = bisect.bisect_left(indices, state[j])
      if indices[k] < front[j]:
        return False
    return True

  # ------------------------------------------------------------------ search
  def _trace(self, parents: dict[bytes, tuple[bytes, int] | None], state: bytes) -> list[str]:
    moves = []
    while parents[state] is not None:
      previous, thread = parents[state]
      moves.append(f"rank {self.thread_rank[thread]}: {self.steps[thread][previous[thread]].text}")
      state = previous
    return moves[::-1]

  def _describe_blocked(self, state: bytes) -> str:
    parts = []
    for r in range(self.config.num_ranks):
      threads = [t for t in range(self.num_threads) if self.thread_rank[t] == r]
      waiting = [t for t in threads if state[t] < self.lengths[t] and
                 all(state[u] == self.lengths[u] for u in self.gate[t])]
      if any(state[t] == HALTED for t in threads):
        parts.append(f"rank {r} halted at a failed read")
      elif not waiting:
        parts.append(f"rank {r} finished")
      for t in waiting:
        step = self.steps[t][state[t]]
        held = self.layout.describe_value(step.cell, state[self.num_threads + step.cell])
        parts.append(f"rank {r} blocked at {step.text}, holds {held}")
    return "; ".join(parts)

  def _wrong_read(self, parents, state: bytes, thread: int) -> Failure:
    step = self.steps[thread][state[thread]]
    held = state[self.num_threads + step.cell]
    rank = self.thread_rank[thread]
    message = (f"rank {rank} accepts a flag or row of another call: "
               f"{self.layout.names[step.cell]} holds "
               f"{self.layout.describe_value(step.cell, held)} ({step.text})")
    return Failure("wrong read", message,
                   tuple(self._trace(parents, state) + [f"rank {rank}: {step.text}"]))

  def run(self, exhaustive: bool = False) -> Outcome:
    """The search; it stops at the first failure unless `exhaustive`. Then a
    failed read is a step too: it halts its thread (pc HALTED, and the kernels
    after it never start) and sets the error byte, while the other threads go
    on; the reduction keeps every state where nothing can step, so the sets of
    terminal and deadlocked states match the full search's (the tests)."""
    n = self.num_threads
    lengths, actions, cells, values = self.lengths, self.actions, self.cells, self.values
    gate_slices, lengths_bytes = self.gate_slices, self.lengths_bytes
    parents: dict[bytes, tuple[bytes, int] | None] = {self.initial: None}
    queue = collections.deque([self.initial])
    terminal = 0
    first: Failure | None = None
    terminal_states: set[bytes] = set()
    deadlocks: set[bytes] = set()
    while queue:
      state = queue.popleft()
      enabled = []
      unfinished = False
      for t in range(n):
        pc = state[t]
        if pc >= lengths[t]:  # finished, or HALTED
          continue
        unfinished = True
        start, stop = gate_slices[t]
        if state[start:stop] != lengths_bytes[start:stop]:
          continue
        action, held, value = actions[t][pc], state[cells[t][pc]], values[t][pc]
        if action == _WAIT_EQ:
          if held != value:
            continue
        elif action == _WAIT_GE:
          if held < value:
            continue
        elif action == _READ and held != value:
          failure = self._wrong_read(parents, state, t)
          if not exhaustive:
            return Outcome(len(parents), terminal, failure)
          first = first or failure
        enabled.append(t)
      if not enabled:
        if not unfinished:
          terminal += 1
          terminal_states.add(state)
          continue
        failure = Failure("deadlock", self._describe_blocked(state),
                          tuple(self._trace(parents, state)))
        if not exhaustive:
          return Outcome(len(parents), terminal, failure)
        first = first or failure
        deadlocks.add(state)
        continue
      chosen = enabled
      if self.reduce and len(enabled) > 1:
        for t in enabled:
          if self._persistent(state, t):
            chosen = (t,)
            break
      for t in chosen:
        pc = state[t]
        successor = bytearray(state)
        successor[t] = pc + 1
        action, cell, value = actions[t][pc], cells[t][pc], values[t][pc]
        if action == _WRITE:
          successor[cell] = value
        elif action == _ADD:
          successor[cell] += value
        elif action == _READ and state[cell] != value:
          successor[t] = HALTED
          successor[self.error_byte] = 1
        successor = bytes(successor)
        if successor not in parents:
          parents[successor] = (state, t)
          queue.append(successor)
    return Outcome(len(parents), terminal, first, frozenset(terminal_states),
                   frozenset(deadlocks))


def explore(config: ModelConfig, program: Program, routings: Routing | Sequence[Routing],
            reduce: bool = True) -> Outcome:
  """Every interleaving of the ranks' steps of `program` under `routings` (one
  routing for every call, or one per call)."""
  return Explorer(config, program, routings, reduce).run()


@dataclasses.dataclass(frozen=True)
class ProgramFailure:
  program: Program
  routing: str
  failure: Failure


@dataclasses.dataclass(frozen=True)
class Report:
  """A sweep over programs x routing assignments."""

  config: ModelConfig
  programs: int
  explorations: int
  states: int
  seconds: float
  failures: tuple[ProgramFailure, ...]

  def summary(self) -> str:
    c = self.config
    return (f"rule {c.rule.value}, R={c.num_ranks}, E_local={c.experts_per_rank}: "
            f"{self.programs} programs, {self.explorations} (program, routing) explorations, "
            f"{self.states} states, {len(self.failures)} failing, {self.seconds:.1f} s")

  def first_failure(self) -> ProgramFailure | None:
    return shortest(self.failures)


def compare_with_full(explore: Callable[..., Report], cases: Iterable[tuple]
                      ) -> tuple[int, int, int]:
  """Runs each (program, routing) of ``cases`` exhaustively with the persistent-set
  reduction and without (``explore(program, routing, reduce)`` returns the run's
  Report) and asserts that both reach the same outcome, the same terminal and
  deadlocked states, and at least one of them (either model's Report serves).
  Returns the states of the reduced searches, of the full ones, and how many
  cases failed."""
  reduced_states = full_states = failing = 0
  for program, routing in cases:
    reduced, full = explore(program, routing, True), explore(program, routing, False)
    reduced_states += reduced.states
    full_states += full.states
    where = (program, routing.name)
    assert (reduced.failure is None) == (full.failure is None), where
    assert reduced.terminal == full.terminal and reduced.deadlocks == full.deadlocks, where
    assert reduced.terminal or reduced.deadlocks, where
    failing += full.failure is not None
  return reduced_states, full_states, failing


def shortest(failures: Iterable[ProgramFailure]) -> ProgramFailure | None:
  """The shortest counterexample: fewest calls, then fewest steps."""
  return min(failures, key=lambda f: (len(f.program), len(f.failure.trace)), default=None)


def check(config: ModelConfig, programs: Sequence[Program], per_call_routing: bool = False,
          classes: Sequence[Routing] | None = None) -> Report:
  """Explores every program under every routing class (or, per call, every
  assignment of classes to its ops)."""
  classes = routing_classes(config) if classes is None else tuple(classes)
  start = time.perf_counter()
  states = explorations = 0
  failures = []
  for program in programs:
    for routings in routing_assignments(program, classes, per_call_routing):
      outcome = explore(config, program, routings)
      explorations += 1
      states += outcome.states
      if outcome.failure is not None:
        failures.append(ProgramFailure(program, routing_name(routings), outcome.failure))
  return Report(config, len(programs), explorations, states, time.perf_counter() - start,
                tuple(failures))


def check_families(config: ModelConfig, max_calls: int, per_call_routing: bool = False) -> Report:
  """Every single-family program of up to max_calls calls (which decide the
  mixed ones: the module docstring) under every routing (assignment)."""
  programs = [p for family in family_programs(max_calls).values() for p in family]
  return check(config, programs, per_call_routing)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rule", choices=[r.value for r in Rule], default=Rule.FIXED.value)
  parser.add_argument("--ranks", type=int, default=2)
  parser.add_argument("--calls", type=int, default=4)
  parser.add_argument("--experts-per-rank", type=int, default=1)
  parser.add_argument("--per-call-routing", action="store_true",
                      help="every assignment of routing classes to the calls, not one class "
                      "for the whole program")
  parser.add_argument("--mixed", action="store_true",
                      help="also every mixed-family program (decided by the single-family "
                      "ones; slower)")
  parser.add_argument("--sequential-blocks", action="store_true",
                      help="run a call's chains one after the other (one schedule)")
  args = parser.parse_args(argv)
  config = ModelConfig(args.ranks, args.experts_per_rank, Rule(args.rule),
                       concurrent_blocks=not args.sequential_blocks)
  reports = [check_families(config, args.calls, args.per_call_routing)]
  print("single-family programs:", reports[0].summary())
  if args.mixed:
    reports.append(check(config, mixed_programs(args.calls), args.per_call_routing))
    print("mixed programs:", reports[1].summary())
  failures = [f for r in reports for f in r.failures]
  if not failures:
    print("no counterexample")
    return 0
  for f in failures:
    print(f"FAILS: {' '.join(f.program)} under '{f.routing}': {f.failure.kind}")
  first = shortest(failures)
  assert first is not None
  print(f"\ncounterexample: program {' '.join(first.program)}, routing '{first.routing}'")
  print(first.failure.render())
  return 1


if __name__ == "__main__":
  sys.exit(main())
