"""What the HT exchange would send across nodes (``--mode network``; pure numpy).

For EP groups of ``nodes`` x ``ranks_per_node`` GPUs and DeepEP's internode
routing (top-k of |N(0,1)|+1 scores within the ``topk_groups`` best nodes of
each token: DeepSeek-V3's group-limited gating, a group being a node), per
source token and per op:

* ``hierarchical``: network copies when each token crosses the network once per
  destination node other than its own, to the GPU of its own local index there,
  which forwards it over NVLink (docs/design.md, "HT across several NVLink
  domains"): the number of other nodes holding its experts.
* ``flat``: network copies of a flat exchange (one per destination rank on
  another node): the number of ranks on other nodes holding its experts.
* ``deepep_rdma``: DeepEP's count of RDMA tokens, the destination nodes with the
  token's own included (what its published "RDMA bottleneck bandwidth" divides by
  the time; the own node's copy never reaches the NIC).
* ``nvlink``: copies that cross NVLink in the hierarchical scheme: each
  forwarder's copies to the other GPUs of its node that need the token, and the
  source's own copies to the other GPUs of its node.

Bytes per token = copies x the row's payload (traffic.row_bytes: BF16 2H, FP8
H + 4H/128; headers, top-k ids and weights left out). The combine moves the same
copies back in BF16 (a partial sum per node and per forwarder).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_ep.bench import traffic

MAX_TOPK_GROUPS = 4   # DeepSeek-V3: a token's experts on at most 4 nodes


def internode_routing(rng: np.random.Generator, num_tokens: int, num_experts: int,
                      num_topk: int, num_nodes: int, topk_groups: int) -> np.ndarray:
  """int32[T, K] global expert ids: each token's top-k of |N(0,1)|+1 scores among the
  experts of its ``topk_groups`` nodes with the highest single score."""
  scores = np.abs(rng.standard_normal((num_tokens, num_experts))) + 1
  per_node = scores.reshape(num_tokens, num_nodes, num_experts // num_nodes)
  best_nodes = np.argsort(-per_node.max(axis=2), axis=1)[:, :topk_groups]
  kept = np.zeros((num_tokens, num_nodes), dtype=bool)
  np.put_along_axis(kept, best_nodes, True, axis=1)
  masked = np.where(np.repeat(kept, num_experts // num_nodes, axis=1), scores, -np.inf)
  return np.argsort(-masked, axis=1)[:, :num_topk].astype(np.int32)


@dataclasses.dataclass(frozen=True)
class NetworkCopies:
  """Mean copies per source token over every rank's tokens (module docstring)."""

  nodes: int
  ranks_per_node: int
  hierarchical: float
  flat: float
  deepep_rdma: float
  nvlink: float


def copies(topk_idx: np.ndarray, num_experts: int, ranks_per_node: int) -> NetworkCopies:
  """Copies per token of the global routing ``topk_idx`` int[R, T, K] (ids outside
  [0, E) are not routed; a token's repeated expert counts once)."""
  topk_idx = np.asarray(topk_idx)
  num_ranks = topk_idx.shape[0]
  if num_ranks % ranks_per_node:
    raise ValueError(f"{num_ranks} ranks are not whole nodes of {ranks_per_node}")
  if num_experts % num_ranks:
    raise ValueError(f"num_experts ({num_experts}) is not a multiple of R ({num_ranks})")
  num_nodes = num_ranks // ranks_per_node
  valid = (topk_idx >= 0) & (topk_idx < num_experts)
  owner = np.where(valid, topk_idx // (num_experts // num_ranks), -1)        # [R, T, K]
  on_rank = np.zeros(topk_idx.shape[:2] + (num_ranks + 1,), dtype=bool)    # last: unrouted
  np.put_along_axis(on_rank, np.where(owner < 0, num_ranks, owner), True, axis=2)
  on_rank = on_rank[..., :num_ranks].reshape(topk_idx.shape[:2] + (num_nodes, ranks_per_node))
  on_node = on_rank.any(axis=3)                                             # [R, T, N]
  source_node = np.arange(num_ranks) // ranks_per_node                      # [R]
  own = np.arange(num_nodes)[None, :] == source_node[:, None]               # [R, N]
  other_nodes = on_node & ~own[:, None, :]
  hierarchical = other_nodes.sum(axis=2)
  flat = (on_rank & ~own[:, None, :, None]).sum(axis=(2, 3))
  deepep_rdma = on_node.sum(axis=2)
  # NVLink: on another node the forwarder has the source's local index; it copies to
  # every other GPU there that needs the token. On the own node the source copies to
  # every other GPU that needs it.
  local = np.arange(num_ranks) % ranks_per_node                             # [R]
  rail = np.arange(ranks_per_node)[None, :] == local[:, None]               # [R, L]
  nvlink = (on_rank & ~rail[:, None, None, :]).sum(axis=(2, 3))              # [R, T]
  return NetworkCopies(nodes=num_nodes, ranks_per_node=ranks_per_node,
                       hierarchical=float(hierarchical.mean()), flat=float(flat.mean()),
                       deepep_rdma=float(deepep_rdma.mean()),
                       nvlink=float(nvlink.mean()))


def run(nodes: list[int], ranks_per_node: int, tokens: int, hidden: int, num_experts: int,
        num_topk: int, seed: int) -> tuple[list[dict], dict]:
  """Rows (one per node count) and the run's settings."""
  rows = []
  for num_nodes in nodes:
    rng = np.random.default_rng(seed)
    num_ranks = num_nodes * ranks_per_node
    topk_groups = min(num_nodes, MAX_TOPK_GROUPS)
    idx = np.stack([internode_routing(rng, tokens, num_experts, num_topk, num_nodes,
                                      topk_groups) for _ in range(num_ranks)])
    result = copies(idx, num_experts, ranks_per_node)
    row = dict(dataclasses.asdict(result), ranks=num_ranks, topk_groups=topk_groups)
    for name, fp8 in (("bf16", False), ("fp8", True)):
      payload = traffic.row_bytes(hidden, fp8)
      row[f"hierarchical_bytes_per_token_{name}"] = result.hierarchical * payload
      row[f"flat_bytes_per_token_{name}"] = result.flat * payload
    rows.append(row)
  meta = dict(ranks_per_node=ranks_per_node, tokens=tokens, hidden=hidden,
              experts=num_experts, topk=num_topk, seed=seed,
              routing="top-k of |N(0,1)|+1 scores within the min(nodes, 4) nodes of each "
                      "token's best scores (DeepEP's internode tests)")
  return rows, meta


def format_rows(rows: list[dict], hidden: int) -> str:
  head = (f"{'nodes x GPUs':>12} {'network copies/token':>22} {'flat':>6} {'DeepEP RDMA':>12} "
          f"{'NVLink':>7} {'network KB/token BF16 / FP8':>29} {'flat KB/token BF16':>19}")
  lines = [head]
  for row in rows:
    lines.append(
        f"{row['nodes']:>5} x {row['ranks_per_node']:<4} {row['hierarchical']:>22.2f} "
        f"{row['flat']:>6.2f} {row['deepep_rdma']:>12.2f} {row['nvlink']:>7.2f} "
        f"{row['hierarchical_bytes_per_token_bf16'] / 1e3:>16.1f} / "
        f"{row['hierarchical_bytes_per_token_fp8'] / 1e3:<10.1f} "
        f"{row['flat_bytes_per_token_bf16'] / 1e3:>19.1f}")
  lines.append(f"(hidden {hidden}; copies per source token, means over every rank's tokens)")
  return "\n".join(lines)
