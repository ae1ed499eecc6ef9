"""An executable model of the two-level (across nodes) HT protocol, explored exhaustively.

The protocol is docs/design.md, "HT across several NVLink domains (design; not
implemented)": N nodes of L GPUs, rank r = (node r // L, local r % L), a
token crossing the network once per destination node, to the GPU of the same
local index there (the source's rail peer, the forwarder), which forwards it
over NVLink. This module turns it into steps for protocol_model.py's search
(its Explorer, persistent-set reduction, Failure and Outcome, tags and
program symbols are reused, not copied) and checks it at 2 nodes x 2 GPUs
(R = 4) for every program of up to 3 calls of the HT dispatch (H) and the HT
combine (K), mixed ones too (the backward passes are instances of these:
protocol_model's docstring), under every routing class (routing_classes:
uniform, all to rank j for each j, none, all to self, cross-node only,
same-node only; a class is a set of (source rank, destination rank) pairs).

State, as in protocol_model: every thread's pc and every cell a step
touches. A flag holds the seq of the call that wrote it; a row slot a tag
(op kind, call seq, writer rank). Tokens are collapsed: the rows of one
(source, destination node) pair are one slot per chunk (config.chunks), every
chunk carrying rows for every destination GPU the routing gives the source on
that node. A count row is a tag too: what it says is the routing, which the
model knows when it compiles, so a forwarder expects exactly the chunks the
routing gives and a receiver reads exactly the rows it gives (the tests check
the compiled reads against the routing); the model checks that each count row
read is this call's.

Threads. Every kernel's blocks are concurrent chains (as protocol_model's;
a rank's next kernel starts when its previous one ended). The NICs are
threads too: one per (source, rail peer, queue pair) for the whole program,
gated by no kernel. A put is two transitions: the source posts it (it writes
the next entry of that QP's send queue) and later the QP's thread lands it:
it waits for the entry, READs the source's buffer (the NIC reads the data
then: a source that has repacked its buffer makes this a wrong read), then
WRITEs the peer's cells. So puts on one QP land in posting order (RC QPs; a
signal executes after the writes before it on its QP, o9-20) and puts on
different QPs in any order. QP 0 carries the count exchange, QP 1 the rows,
their signals and the combine's partials (the design's "1 + m mod Q": a rail
peer lives on one node m, so it sees one such QP).

Steps (a step's text cites them; design section, numbered as there):
  dispatch, one kernel:
    step 1  block 0: the source's per-node count row and its flag to each rail
            peer, on QP 0 (its own node's: local stores). The forwarder's
            relay chain waits for every rail peer's row and flag (its own
            too), then stores each local GPU's counts and flag over NVLink.
    step 2  a sender chain per destination node: waits for that rail peer's
            count flag of this dispatch (the reuse credit, below), packs each
            chunk into its send buffer and posts the rows and then the chunk's
            signal on QP 1 (one post step; the NIC lands rows, then signal).
            Its own node's rows: stores into its own RDMA receive buffer,
            then the chunk flag. A node that gets no rows gets no chunk.
    step 3  a forwarder chain per source node: waits for every local
            forwarder's counts (the final rows' offsets need every source's
            count), then per chunk waits for its signal, reads it (it must
            carry this dispatch's tag of that source) and stores it into the
            final row of each destination GPU in its mask; then, rows or not,
            every local GPU's per-(source node, rail) flag.
    step 4  the receiver: every local forwarder's counts, all N·L flags, then
            the counts and every row the routing gives it, each carrying this
            call's tag and its source rank (a forwarded row keeps its
            source's tag: the header names the source).
  combine ("the same path in reverse"), two kernels:
    C1  every GPU stores each row it holds for a source of rail l into
        forwarder (its node, l)'s stage [p][source node][its local index],
        then that slot's flag, whatever the rows.
    C2  a forwarder chain per source node: waits for every local GPU's flag,
        reads every copy the routing gives (each must be this call's, from
        that GPU), then writes the partial row (tag: this call, from the
        forwarder) into its staging buffer and posts it and its flag on QP 1
        to the source (its own node: stores into its own cells).
    C3  the second kernel: the source waits for every node's partial flag and
        reads each partial of a node holding its rows.
  A partial sum is a tag set, kept implicitly: the forwarder writes the
  partial's tag only after reading each local copy of this call with the
  right tag (or the trace has already failed), so a partial carrying (K, seq,
  forwarder) stands for the full set of this call's copies on that node, and
  the source's checked reads of every node's partial cover the full sum.

Buffers: as the design sizes them. The RDMA send and receive buffers, the
chunk flags, the final rows and the per-(source node, rail) flags are single;
the count rows and flags and all the combine's buffers alternate by parity
(p = seq & 1). The single buffers' reuse credit is the count exchange: a
rank sends its count rows of a dispatch in that dispatch's kernel, after its
last dispatch kernel ended, so a source that waits for its rail peer's count
row knows the peer has forwarded the last dispatch's rows (and, since the
peer waited for the signals behind them on their QP, that the NIC has read
its send buffer); a forwarder that waits for every local GPU's count row
knows each has read its last final rows.

Checked: no READ (a rank's or a NIC's) ever sees another call's tag or a
wrong writer; every state where nothing can step has every thread finished
(no deadlock; the kernels would time out); the reads are the routing's rows.

Variants (Variant): CORRECT, the design as above, and broken ones that the
tests show failing: FLAG_ON_OTHER_QP (the chunk signal on QP 0: it may land
before its rows), CHUNK_SLOT_REUSED_EARLY (the source's reuse credit is
nvshmem_quiet, its own puts landed, instead of the rail peer's count row:
the next dispatch overwrites the forwarder's receive slot before it forwarded
it), SOURCE_SKIPS_COUNT_WAIT (no credit at all: the send buffer is repacked
under the NIC), COMBINE_STAGE_SINGLE and COMBINE_SEND_SINGLE (a combine
buffer not parity-alternated), FORWARDER_SKIPS_IDLE_GPUS (C2 waits only for
the GPUs holding rows: protocol_model's f521f4f lap, one level down).

Not modelled: capacity and drops, rank masking and timeouts (a timeout is
reported as a deadlock), the count rows' values and staging buffer (a count
put carries its value), the chunking of the combine's RDMA stage (one put per
partial), the fp32 sums and bf16 partials, more than one data QP per peer,
and one node (N = 1 has no RDMA; the model runs it, the design does not).

Reductions, and why they are sound:
  * Tokens collapsed into slots (above): the protocol's waits and flags are
    per (source, destination node) and chunk, not per token.
  * Persistent sets (protocol_model's Explorer): the state graph is acyclic
    and a failed read is a transition, so the reduced search reaches every
    deadlock and wrong read of the full one; the tests compare the two where
    the full search is small (1 x 2 and 2 x 1; at 2 x 2 one call already
    takes millions of states). A send queue entry is written once, so the
    NIC's wait is a WAIT_EQ on its own cell: the reduction's look-ahead
    passes a WAIT_GE on any counter that some thread might still add to,
    which with a queue counter made every NIC look able to land every later
    call's puts (and the search 40 times larger).
  * Back-to-back posts (a count row and its flag; a chunk and its signal)
    are one step: posting is the source's local act, and posting earlier
    only lets the NIC land earlier, which the NIC may choose not to do.
  * No symmetry reduction: every program of up to 3 calls under every class
    explores in seconds, and the chains' fixed orders (nodes, then ranks)
    are not invariant under relabelling nodes or rails.

Run as a script:
  python tests/cpu/protocol_model_two_level.py --variant correct --calls 3 --chunks 2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import itertools
import sys
import time
from collections.abc import Iterable, Sequence

import protocol_model as pm
from protocol_model import Action, Buffer, Holds, OpKind, Program, Routing, Step


class Variant(enum.Enum):
  """The protocol: the design's, or one deliberately broken."""

  CORRECT = "correct"
  # The dispatch's chunk signal goes on QP 0 (the count exchange's), not on
  # its rows' QP, so it may land before them.
  FLAG_ON_OTHER_QP = "flag-on-other-qp"
  # The source reuses the rail peer's (single) RDMA receive slot once its
  # own puts have landed (nvshmem_quiet at the end of its sends) instead of
  # waiting for that peer's count row of this dispatch, the only sign that
  # the peer has forwarded the last dispatch's rows out of it.
  CHUNK_SLOT_REUSED_EARLY = "chunk-slot-reused-early"
  # The source does not wait for the rail peer's count row before its rows
  # at all: then even its own single send buffer is repacked while the NIC
  # may still read the last dispatch's rows from it.
  SOURCE_SKIPS_COUNT_WAIT = "source-skips-count-wait"
  # The combine's NVLink stage on the forwarder is not parity-alternated.
  COMBINE_STAGE_SINGLE = "combine-stage-single"
  # The forwarder's staging of the partial rows for the RDMA put is not
  # parity-alternated (nothing says that the NIC has read the last one).
  COMBINE_SEND_SINGLE = "combine-send-single"
  # The combine's forwarder waits only for the local GPUs holding rows of the
  # source (the f521f4f rule of the single-node model, one level down).
  FORWARDER_SKIPS_IDLE_GPUS = "forwarder-skips-idle-gpus"


@dataclasses.dataclass(frozen=True)
class TwoLevelConfig:
  """N nodes of L GPUs; rank r = (node r // L, local r % L).

  variant: the design's protocol or a broken one (Variant).
  chunks: RDMA chunks per (source, destination node) that holds rows (the
  dispatch's per-chunk flags); tokens are collapsed, so every chunk carries
  rows for every destination GPU of the token set.
  concurrent_blocks: as in protocol_model.ModelConfig (False runs a kernel's
  chains one after the other, in the order they are built: one schedule).
  """

  nodes: int = 2
  local: int = 2
  variant: Variant = Variant.CORRECT
  chunks: int = 1
  concurrent_blocks: bool = True

  def __post_init__(self) -> None:
    if self.nodes < 1 or self.local < 1 or not 2 <= self.num_ranks <= 4:
      raise ValueError("the model runs 2 to 4 ranks (tags hold the writer in 2 bits)")
    if not 1 <= self.chunks <= 3:
      raise ValueError("chunks must be 1..3")

  @property
  def num_ranks(self) -> int:
    return self.nodes * self.local

  @property
  def single_buffered(self) -> frozenset[str]:
    """The parity buffers whose halves the variant merges (Layout.cell)."""
    return {Variant.COMBINE_STAGE_SINGLE: frozenset({"combine_stage", "combine_stage_flags"}),
            Variant.COMBINE_SEND_SINGLE: frozenset({"combine_send"})}.get(
                self.variant, frozenset())

  def rank(self, node: int, local: int) -> int:
    return node * self.local + local

  def node_of(self, rank: int) -> int:
    return rank // self.local

  def local_of(self, rank: int) -> int:
    return rank % self.local

  def name(self, rank: int) -> str:
    return f"rank {rank} ({self.node_of(rank)},{self.local_of(rank)})"


def routing_classes(config: TwoLevelConfig) -> tuple[Routing, ...]:
  """The single-node model's classes over (source rank, destination rank)
  pairs (one expert per rank: a pair is "some token of the source has an
  expert on that rank"), plus the two that separate the levels."""
  ranks = range(config.num_ranks)
  node = config.node_of
  every = frozenset(itertools.product(ranks, ranks))
  classes = [Routing("uniform", every)]
  classes += [Routing(f"all to rank {j}", frozenset((s, j) for s in ranks)) for j in ranks]
  classes.append(Routing("none", frozenset()))
  classes.append(Routing("all to self", frozenset((s, s) for s in ranks)))
  if config.nodes > 1:
    classes.append(Routing("cross-node only",
                           frozenset((s, g) for s, g in every if node(s) != node(g))))
  if config.local > 1:
    classes.append(Routing("same-node only",
                           frozenset((s, g) for s, g in every if node(s) == node(g))))
  return tuple(classes)


COUNT_QP = 0  # the count exchange's queue pair (design step 1: "queue pair 0")
# The rows' (and their signals') queue pair to a rail peer: the design's
# 1 + m mod Q. A rail peer lives on one node m, so each peer sees only one
# such QP, and which one does not matter to the model.
DATA_QP = 1
NUM_QPS = 2


def buffers_of(config: TwoLevelConfig, max_posts: int) -> tuple[Buffer, ...]:
  """Every rank's symmetric cells (names after the design's buffers; the
  parity half first where `parity`). Tokens are collapsed: one cell per
  (source, destination) and chunk."""
  n, el, r, c = config.nodes, config.local, config.num_ranks, config.chunks
  return (
      # Step 1, count exchange. On a forwarder: its rail peers' count rows
      # [p][source node]; on every GPU: its node's forwarders' rows [p][rail].
      Buffer("rdma_counts", (2, n), Holds.ROW, True),
      Buffer("rdma_count_flags", (2, n), Holds.FLAG, True),
      Buffer("nvl_counts", (2, el), Holds.ROW, True),
      Buffer("nvl_count_flags", (2, el), Holds.FLAG, True),
      # Step 2: the source's send buffer [destination node][chunk] and the
      # forwarder's RDMA receive buffer [source node][chunk], single as the
      # design sizes them (N·T rows), and the per-chunk signals.
      Buffer("rdma_send", (n, c), Holds.ROW, False),
      Buffer("rdma_recv", (n, c), Holds.ROW, False),
      Buffer("chunk_flags", (n, c), Holds.FLAG, False),
      # Steps 3-4: the final rows [source rank][chunk] (single, as today) and
      # the per-(source node, rail) flags, i.e. one per source rank.
      Buffer("recv_rows", (r, c), Holds.ROW, False),
      Buffer("forward_flags", (r,), Holds.FLAG, False),
      # Combine, all parity-alternated: on the forwarder, the local GPUs'
      # rows [p][source node][GPU's local index] and their flags, and its
      # partial rows staged for the RDMA put [p][source node]; on the source,
      # the partials [p][forwarder node] and their flags.
      Buffer("combine_stage", (2, n, el), Holds.ROW, True),
      Buffer("combine_stage_flags", (2, n, el), Holds.FLAG, True),
      Buffer("combine_send", (2, n), Holds.ROW, True),
      Buffer("combine_recv", (2, n), Holds.ROW, True),
      Buffer("combine_flags", (2, n), Holds.FLAG, True),
      # The NIC's send queues [peer][QP][k]: the k-th work request posted on
      # that QP (its call's seq), written once by this rank and read by that
      # QP's NIC thread only. One cell per request, not a counter: a wait for
      # an exact value keeps the reduction's over-approximation tight.
      Buffer("send_queue", (r, NUM_QPS, max_posts), Holds.FLAG, False),
      # Their completions (only where a variant waits for them: a quiet).
      Buffer("completions", (r, NUM_QPS, max_posts), Holds.FLAG, False),
  )


class TwoLevelLayout(pm.Layout):
  """pm.Layout over the two-level buffers; a cell's name shows the rank's
  (node, local) pair."""

  # pylint: disable-next=super-init-not-called
  def __init__(self, config: TwoLevelConfig, max_posts: int):
    # pm.Layout.__init__ would build the single-node buffers; the rest of
    # the class (cell, describe_value) reads only these fields.
    self.config = config  # type: ignore[assignment]
    self.buffers = {b.name: b for b in buffers_of(config, max_posts)}
    self._cells: dict[tuple[int, str, tuple[int, ...]], int] = {}
    self.names: list[str] = []
    self.holds: list[Holds] = []

  def cell(self, rank: int, buffer: str, index: tuple[int, ...]) -> int:
    known = len(self.names)
    cell = super().cell(rank, buffer, index)
    if cell == known:  # a new cell: its name shows (node, local)
      prefix = f"rank {rank} "
      self.names[cell] = f"{self.config.name(rank)} {self.names[cell][len(prefix):]}"
    return cell


Effect = tuple[Action, int, str, tuple[int, ...], int]  # action, rank, buffer, index, value


class QueuePairs:
  """The NICs: one thread per (source, peer, QP) for the whole program.

  A put is two transitions: the source posts it (writes the next entry of
  its send queue for that QP, in the source's chain), and later the QP's
  thread, which waits for that entry, lands it: the NIC reads the source's
  buffer then (a READ: the source may have overwritten it), then writes the
  peer's cells. A QP's thread lands its puts in posting order (RC QPs
  deliver in order, and a signal executes after the writes before it on its
  QP); distinct QPs are distinct threads, so their puts land in any order.
  """

  def __init__(self, layout: TwoLevelLayout):
    self.layout = layout
    self.threads: dict[tuple[int, int, int], list[Step]] = collections.defaultdict(list)
    self.posted: dict[tuple[int, int, int], int] = collections.defaultdict(int)

  def post(self, sender: TwoLevelCallSteps, peer: int, qp: int, effects: Sequence[Effect],
           where: str) -> None:
    me = sender.me
    key = (me, peer, qp)
    entry = (peer, qp, self.posted[key])
    self.posted[key] += 1
    sender.write(me, "send_queue", entry, sender.seq, f"{where}: post on QP {qp}")
    steps = self.threads[key]
    prefix = f"{sender.label} (NIC QP {qp} {me}->{peer}, {where})"
    cell = self.layout.cell(me, "send_queue", entry)
    steps.append(Step(Action.WAIT_EQ, cell, sender.seq, sender.call,
                      f"{prefix}: {self.layout.names[cell]} wait == seq {sender.seq}"))
    for action, rank, buffer, index, value in effects:
      cell = self.layout.cell(rank, buffer, index)
      verb = {Action.WRITE: "lands", Action.READ: "NIC reads, expects"}[action]
      steps.append(Step(action, cell, value, sender.call,
                        f"{prefix}: {self.layout.names[cell]} {verb} "
                        f"{self.layout.describe_value(cell, value)}"))
    if self.layout.config.variant is Variant.CHUNK_SLOT_REUSED_EARLY:
      # The completion the sender's quiet waits for (only this variant has
      # a quiet; the design's kernels never wait for their own puts).
      cell = self.layout.cell(me, "completions", entry)
      steps.append(Step(Action.WRITE, cell, sender.seq, sender.call,
                        f"{prefix}: {self.layout.names[cell]} := seq {sender.seq}"))

  def quiet(self, sender: TwoLevelCallSteps, peer: int, where: str) -> None:
    """nvshmem_quiet towards `peer`: a wait for the completion of the last
    put posted on each QP (RC completions come in order)."""
    for qp in range(NUM_QPS):
      posted = self.posted[(sender.me, peer, qp)]
      if posted:
        sender.wait("completions", (peer, qp, posted - 1), where)


class TwoLevelCallSteps(pm._CallSteps):  # pylint: disable=protected-access
  """One rank's steps of one two-level call (pm._CallSteps builds the chains,
  the steps' text and tags; this class replaces the two HT ops)."""

  config: TwoLevelConfig  # type: ignore[assignment]

  def __init__(self, config: TwoLevelConfig, layout: TwoLevelLayout, routing: Routing,
               rank: int, kind: pm.CallKind, seq: int, call: int, queues: QueuePairs):
    super().__init__(config, layout, routing, rank, kind, seq, call)  # type: ignore[arg-type]
    self.queues = queues
    self.node, self.rail = config.node_of(rank), config.local_of(rank)

  def post(self, peer: int, qp: int, effects: Sequence[Effect], where: str) -> None:
    self.queues.post(self, peer, qp, effects, where)

  def quiet(self, peer: int, where: str) -> None:
    """Waits until every put this rank posted to `peer` has landed."""
    self.queues.quiet(self, peer, where)

  def _node_ranks(self, node: int) -> list[int]:
    return [self.config.rank(node, l) for l in range(self.config.local)]

  def _to_node(self, source: int, node: int) -> list[int]:
    """The GPUs of `node` holding rows of `source` (its token set's mask)."""
    return [g for g in self._node_ranks(node) if self.routing.uses(source, g)]

  def ht_dispatch(self) -> None:
    """Design steps 1-4, one kernel whose blocks run as concurrent chains:
    block 0 (the count exchange), a sender per destination node, the
    forwarder's count relay, a forwarder per source node, the receiver."""
    cfg, me, p, seq, tag = self.config, self.me, self.p, self.seq, self.tag()
    n, rail, chunks, variant = self.node, self.rail, range(self.config.chunks), cfg.variant
    nodes = range(cfg.nodes)
    self.kernel()
    # ------------------------------------------------------ source, block 0
    self.chain()
    for m in nodes:  # step 1: the per-node count row to each rail peer, flag behind it
      peer = cfg.rank(m, rail)
      if m == n:  # its own node's row: a local store (it is its own rail peer)
        self.write(me, "rdma_counts", (p, n), tag, "step 1, count row")
        self.write(me, "rdma_count_flags", (p, n), seq, "step 1, count flag")
      else:
        self.post(peer, COUNT_QP, [(Action.WRITE, peer, "rdma_counts", (p, n), tag),
                                   (Action.WRITE, peer, "rdma_count_flags", (p, n), seq)],
                  "step 1, count row and flag")
    # -------------------------------------- source, a sender per destination node
    for m in nodes:  # step 2: rows per destination node, each chunk then its signal
      peer = cfg.rank(m, rail)
      if not self._to_node(me, m):
        continue  # no rows: the forwarder expects no chunk (the count exchange)
      self.chain()
      if m != n and variant not in (Variant.SOURCE_SKIPS_COUNT_WAIT,
                                    Variant.CHUNK_SLOT_REUSED_EARLY):
        # The rail peer's count row of this dispatch, sent in its kernel of
        # this dispatch, so after it forwarded the last dispatch's rows out
        # of its single RDMA receive buffer (and after the NIC read this
        # rank's send buffer: the peer waited for the signals behind them).
        self.wait("rdma_count_flags", (p, m), "step 2, the rail peer's count flag")
      for c in chunks:
        if m == n:  # its own node: the rows go into its own RDMA receive buffer
          self.write(me, "rdma_recv", (n, c), tag, "step 2, own node's rows")
          self.write(me, "chunk_flags", (n, c), seq, "step 2, own node's chunk flag")
          continue
        self.write(me, "rdma_send", (m, c), tag, "step 2, pack")
        data: list[Effect] = [(Action.READ, me, "rdma_send", (m, c), tag),
                              (Action.WRITE, peer, "rdma_recv", (n, c), tag)]
        signal: list[Effect] = [(Action.WRITE, peer, "chunk_flags", (n, c), seq)]
        if variant is Variant.FLAG_ON_OTHER_QP:
          self.post(peer, DATA_QP, data, "step 2, rows")
          self.post(peer, COUNT_QP, signal, "step 2, chunk signal")
        else:  # posted back to back: one step (the NIC still lands them in order)
          self.post(peer, DATA_QP, data + signal, "step 2, rows and chunk signal")
      if m != n and variant is Variant.CHUNK_SLOT_REUSED_EARLY:
        # nvshmem_quiet instead of the count flag: the puts have landed, so
        # the send buffer is free, but nothing says the rows were forwarded.
        self.quiet(peer, "step 2, quiet")
    # ---------------------------------------------- forwarder, the count relay
    self.chain()
    for s_node in nodes:  # step 1: every rail peer's count row (its own too)
      self.wait("rdma_count_flags", (p, s_node), "step 1, forwarder")
      self.read("rdma_counts", (p, s_node), cfg.rank(s_node, rail), "step 1, forwarder")
    for g in self._node_ranks(n):  # ... and its sums to every local GPU, flag behind them
      self.write(g, "nvl_counts", (p, rail), tag, "step 1, NVLink counts")
      self.write(g, "nvl_count_flags", (p, rail), seq, "step 1, NVLink count flag")
    # ------------------------------------- forwarder, a block per source node
    for s_node in nodes:  # step 3, chunk by chunk
      source = cfg.rank(s_node, rail)
      dests = self._to_node(source, n)
      self.chain()
      # Every local forwarder's counts: this block writes final rows, whose
      # offsets depend on every source's count, which only the forwarder of
      # that source's rail has. It is also the reuse credit of the single
      # final rows and flags: a GPU sends them in this dispatch's kernel.
      for l in range(cfg.local):
        self.wait("nvl_count_flags", (p, l), "step 3, local forwarders' counts")
        self.read("nvl_counts", (p, l), cfg.rank(n, l), "step 3, local forwarders' counts")
      for c in chunks if dests else ():
        self.wait("chunk_flags", (s_node, c), "step 3, chunk landed")
        self.read("rdma_recv", (s_node, c), source, "step 3, forward")
        for g in dests:  # the row's bitmask: straight into g's final row
          self.write(g, "recv_rows", (source, c), self.tag(source), "step 3, forward")
      for g in self._node_ranks(n):  # after its last row for g (none too): g's flag
        self.write(g, "forward_flags", (source,), seq, "step 3, forward flag")
    # -------------------------------------------------------------- receiver
    self.chain()
    for l in range(cfg.local):  # every block waits for the counts, as today
      self.wait("nvl_count_flags", (p, l), "step 4, counts")
      self.read("nvl_counts", (p, l), cfg.rank(n, l), "step 4, counts")
    for source in range(cfg.num_ranks):  # step 4: all N·L flags
      self.wait("forward_flags", (source,), "step 4")
    for source in range(cfg.num_ranks):
      if self.routing.uses(source, me):
        for c in chunks:
          self.read("recv_rows", (source, c), source, "step 4")

  def ht_combine(self) -> None:
    """The combine, two kernels: the NVLink stage (C1, a block per local
    forwarder) and the forwarder's partial sums (C2, a block per source
    node), then the source's sums (C3)."""
    cfg, me, p, seq, tag = self.config, self.me, self.p, self.seq, self.tag()
    n, rail, variant = self.node, self.rail, cfg.variant
    nodes = range(cfg.nodes)
    self.kernel()
    # ----------------------------------------- C1: rows back to the forwarders
    for l in range(cfg.local):
      self.chain()
      forwarder = cfg.rank(n, l)
      for s_node in nodes:
        if self.routing.uses(cfg.rank(s_node, l), me):
          self.write(forwarder, "combine_stage", (p, s_node, rail), tag, "C1, row")
        # One flag per (source node, this GPU) whatever the rows ("flags as
        # in dispatch"): the forwarder's reuse credit.
        self.write(forwarder, "combine_stage_flags", (p, s_node, rail), seq, "C1, flag")
    # ----------------------------------- C2: the forwarder's partial sums, RDMA
    for s_node in nodes:
      self.chain()
      source = cfg.rank(s_node, rail)
      holders = [g for g in self._node_ranks(n) if self.routing.uses(source, g)]
      waited = (holders if variant is Variant.FORWARDER_SKIPS_IDLE_GPUS
                else self._node_ranks(n))
      for g in waited:
        self.wait("combine_stage_flags", (p, s_node, cfg.local_of(g)), "C2")
      # The partial sum: every local copy of this call, read (and checked)
      # before the partial row is written, so its tag stands for that set.
      for g in holders:
        self.read("combine_stage", (p, s_node, cfg.local_of(g)), g, "C2, sum")
      if s_node == n:  # the source is this GPU: no network
        if holders:
          self.write(me, "combine_recv", (p, n), tag, "C2, own node's partial")
        self.write(me, "combine_flags", (p, n), seq, "C2, own node's flag")
        continue
      effects: list[Effect] = []
      if holders:
        self.write(me, "combine_send", (p, s_node), tag, "C2, partial staged")
        effects += [(Action.READ, me, "combine_send", (p, s_node), tag),
                    (Action.WRITE, source, "combine_recv", (p, n), tag)]
      effects.append((Action.WRITE, source, "combine_flags", (p, n), seq))
      self.post(source, DATA_QP, effects, "C2, partial and flag")
    # --------------------------------------------- C3: the source's own sums
    self.kernel()
    self.chain()
    for m in nodes:  # every node's partial flag, whatever the routing
      self.wait("combine_flags", (p, m), "C3")
    for m in nodes:
      if self._to_node(me, m):
        self.read("combine_recv", (p, m), cfg.rank(m, rail), "C3, sum")


def compile_rank(config: TwoLevelConfig, layout: TwoLevelLayout, program: Program,
                 routings: Sequence[Routing], rank: int, queues: QueuePairs) -> list[pm.Kernel]:
  """One rank's kernels for the whole program in stream order (its puts go
  to `queues`)."""
  counters = pm.DeviceCounters()
  kernels: list[pm.Kernel] = []
  for call, (symbol, routing) in enumerate(zip(program, routings, strict=True), start=1):
    kind = pm.CALL_KINDS[symbol]
    if kind.op not in (OpKind.HT_DISPATCH, OpKind.HT_COMBINE):
      raise ValueError(f"the two-level model runs H and K calls, not {symbol}")
    seq = counters.start(kind)
    kernels.extend(TwoLevelCallSteps(config, layout, routing, rank, kind, seq, call,
                                     queues).build())
    counters.finish(kind, seq)
  return kernels


class TwoLevelExplorer(pm.Explorer):
  """pm.Explorer (its search, reduction and reports) over the two-level
  threads: every rank's chains, gated by stream order, and the NICs' queue
  pair threads, which are never gated (a NIC lands puts while kernels
  come and go)."""

  # pylint: disable-next=super-init-not-called
  def __init__(self, config: TwoLevelConfig, program: Program,
               routings: Routing | Sequence[Routing], reduce: bool = True):
    if isinstance(routings, Routing):
      routings = (routings,) * len(program)
    self.config, self.program, self.reduce = config, program, reduce  # type: ignore[assignment]
    self.routings = tuple(routings)
    # Enough send queue entries for every put of the program on one QP.
    layout = TwoLevelLayout(config, max_posts=len(program) * (config.chunks + 1))
    self.layout = layout
    queues = QueuePairs(layout)
    self.thread_rank: list[int] = []
    self.steps: list[list[Step]] = []
    self.gate: list[tuple[int, ...]] = []
    for rank in range(config.num_ranks):
      previous: tuple[int, ...] = ()
      for kernel in compile_rank(config, layout, program, self.routings, rank, queues):
        ids = tuple(range(len(self.steps), len(self.steps) + len(kernel)))
        for chain in kernel:
          self.thread_rank.append(rank)
          self.steps.append(chain)
          self.gate.append(previous)
        previous = ids
    for (source, _, _), steps in sorted(queues.threads.items()):
      self.thread_rank.append(source)
      self.steps.append(steps)
      self.gate.append(())
    self.index_steps(len(layout.names))


def explore(config: TwoLevelConfig, program: Program, routings: Routing | Sequence[Routing],
            reduce: bool = True) -> pm.Outcome:
  return TwoLevelExplorer(config, program, routings, reduce).run()


@dataclasses.dataclass(frozen=True)
class Report:
  """A sweep over programs x routing assignments."""

  config: TwoLevelConfig
  programs: int
  explorations: int
  states: int
  max_states: int  # of one exploration
  seconds: float
  failures: tuple[pm.ProgramFailure, ...]

  def summary(self) -> str:
    c = self.config
    return (f"variant {c.variant.value}, {c.nodes} nodes x {c.local} GPUs, "
            f"{c.chunks} chunk(s): {self.programs} programs, {self.explorations} "
            f"(program, routing) explorations, {self.states} states (at most "
            f"{self.max_states} in one), {len(self.failures)} failing, {self.seconds:.1f} s")

  def first_failure(self) -> pm.ProgramFailure | None:
    return pm.shortest(self.failures)


def programs(max_calls: int, min_calls: int = 1) -> tuple[Program, ...]:
  """Every program of HT dispatches (H) and HT combines (K), mixed ones too."""
  return pm.valid_programs(max_calls, ("H", "K"), min_calls)


def check(config: TwoLevelConfig, programs_: Iterable[Program], per_call_routing: bool = False,
          classes: Sequence[Routing] | None = None, stop_at_first: bool = False) -> Report:
  """Explores every program under every routing class (or every assignment
  of classes to its calls)."""
  classes = routing_classes(config) if classes is None else tuple(classes)
  start = time.perf_counter()
  states = explorations = max_states = 0
  failures = []
  programs_ = tuple(programs_)
  for program in programs_:
    for routings in pm.routing_assignments(program, classes, per_call_routing):
      outcome = explore(config, program, routings)
      explorations += 1
      states += outcome.states
      max_states = max(max_states, outcome.states)
      if outcome.failure is not None:
        failures.append(pm.ProgramFailure(program, pm.routing_name(routings), outcome.failure))
    if failures and stop_at_first:
      break
  return Report(config, len(programs_), explorations, states, max_states,
                time.perf_counter() - start, tuple(failures))


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--variant", choices=[v.value for v in Variant],
                      default=Variant.CORRECT.value)
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--local", type=int, default=2)
  parser.add_argument("--calls", type=int, default=3)
  parser.add_argument("--chunks", type=int, default=1)
  parser.add_argument("--per-call-routing", action="store_true")
  args = parser.parse_args(argv)
  config = TwoLevelConfig(args.nodes, args.local, Variant(args.variant), args.chunks)
  report = check(config, programs(args.calls), args.per_call_routing)
  print(report.summary())
  if not report.failures:
    print("no counterexample")
    return 0
  first = report.first_failure()
  assert first is not None
  print(f"counterexample: program {' '.join(first.program)}, routing '{first.routing}'")
  print(first.failure.render())
  return 1


if __name__ == "__main__":
  sys.exit(main())
