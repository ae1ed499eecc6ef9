"""How the fuzzer's processes agree without an XLA collective.

Where several processes share one GPU, NCCL cannot run, so no program may hold
an XLA collective, and the fuzzer's own decisions (stop at the time budget, or
after a fault) cannot take one either. They go through jax.distributed's
key-value store instead, as jax_ep's runtime passes its NVSHMEM unique id
(jax_ep/cuda_runtime.py): after program i every process publishes its word
under "<prefix>/<i>/<process>" and reads every other process's. Rank 0's word
also carries its decision about the budget (its clock alone counts), so every
process reaches the same verdict from the same words: each process runs the
same sequence of programs and stops after the same one.
"""

from __future__ import annotations

import dataclasses

import jax

PREFIX = "jax_ep_schedule_fuzz"
# A program may take long where processes share a GPU, and a timed-out kernel
# waits EpGroup.timeout_s before it records the fault: wait generously.
TIMEOUT_MS = 30 * 60 * 1000


def _client():
  from jax._src import distributed  # pylint: disable=import-outside-toplevel
  return distributed.global_state.client


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What every process concludes after one program.

  Attributes:
    outcomes: each process's outcome kind ("pass", "fail", "fault").
    go_on: rank 0's budget decision: another program fits.
  """

  outcomes: tuple[str, ...]
  go_on: bool

  @property
  def failed(self) -> bool:
    return any(kind != "pass" for kind in self.outcomes)

  @property
  def in_step(self) -> bool:
    """No process recorded a fault (jax_ep.status() ok everywhere)."""
    return "fault" not in self.outcomes


def exchange(key: str, word: str) -> list[str]:
  """Every process's word under `key`, in process order (KV store; one process: [word])."""
  count = jax.process_count()
  if count == 1:
    return [word]
  client = _client()
  if client is None:
    raise RuntimeError("several JAX processes but no jax.distributed client: start the fuzzer "
                       "under python -m jax_ep.launch")
  client.key_value_set(f"{PREFIX}/{key}/{jax.process_index()}", word)
  return [client.blocking_key_value_get(f"{PREFIX}/{key}/{p}", TIMEOUT_MS)
          for p in range(count)]


def agree_on_settings(settings: str) -> None:
  """Fails unless every process was started with the same settings (seed,
  budget, replay...): otherwise they would run different programs."""
  words = exchange("settings", settings)
  if len(set(words)) != 1:
    raise SystemExit(f"the processes disagree on the fuzzer's settings: {words}")


def after_program(index: int, outcome_kind: str, go_on: bool) -> Verdict:
  """Publishes this process's outcome of program `index` (and, on rank 0, the
  budget decision `go_on`; ignored elsewhere); returns the common verdict."""
  words = exchange(f"program/{index}", f"{outcome_kind}:{int(go_on)}")
  kinds = tuple(word.split(":")[0] for word in words)
  return Verdict(outcomes=kinds, go_on=words[0].split(":")[1] == "1")
