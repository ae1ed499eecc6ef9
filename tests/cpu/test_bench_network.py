"""jax_ep.bench.network: the copies per token a two-level HT exchange would send
across nodes, on routings whose counts are known by hand."""

import numpy as np
import pytest

from jax_ep.bench import network

# 2 nodes x 2 ranks, 8 experts: rank r owns experts 2r, 2r+1; node n = ranks 2n, 2n+1.
RANKS, PER_NODE, EXPERTS = 4, 2, 8


def _copies(rows_of_each_rank):
  idx = np.asarray(rows_of_each_rank, np.int32)
  return network.copies(idx, EXPERTS, PER_NODE)


def test_tokens_kept_on_their_node_send_nothing_across():
  # every rank's one token goes to its own experts and its node neighbour's
  neighbour = {0: 2, 1: 0, 2: 6, 3: 4}
  result = _copies([[[2 * r, neighbour[r]]] for r in range(RANKS)])
  assert (result.hierarchical, result.flat, result.deepep_rdma) == (0.0, 0.0, 1.0)
  assert result.nvlink == 1.0          # the neighbour's copy


def test_a_token_for_every_rank_of_the_other_node_crosses_once():
  # rank 0's token: experts on ranks 2 and 3 (node 1); the rest unrouted (-1)
  rows = [[[4, 6]], [[-1, -1]], [[-1, -1]], [[-1, -1]]]
  result = _copies(rows)
  assert result.hierarchical == pytest.approx(1 / 4)   # one copy, mean over 4 tokens
  assert result.flat == pytest.approx(2 / 4)           # one per rank there
  assert result.deepep_rdma == pytest.approx(1 / 4)
  # the forwarder is rank 2 (rank 0's local index on node 1): it copies to rank 3
  assert result.nvlink == pytest.approx(1 / 4)


def test_repeated_experts_and_invalid_ids_count_once_or_not_at_all():
  rows = [[[4, 4]], [[5, 99]], [[-1, 8]], [[0, 1]]]
  result = _copies(rows)
  # rank 0 -> rank 2 (node 1), rank 1 -> rank 2 (node 1); rank 3 -> rank 0 (node 0)
  assert result.hierarchical == pytest.approx(3 / 4)
  assert result.flat == pytest.approx(3 / 4)
  # forwarders: rank 2 for rank 0 (no copy), rank 3 for rank 1 (copy to 2), rank 1 for
  # rank 3 (copy to 0)
  assert result.nvlink == pytest.approx(2 / 4)


def test_internode_routing_keeps_each_token_within_its_best_nodes():
  rng = np.random.default_rng(0)
  idx = network.internode_routing(rng, 64, 64, 8, num_nodes=8, topk_groups=4)
  nodes_per_token = [len(set((row // 8).tolist())) for row in idx]
  assert max(nodes_per_token) <= 4 and all(len(set(row.tolist())) == 8 for row in idx)


def test_bad_shapes_are_refused():
  with pytest.raises(ValueError, match="whole nodes"):
    network.copies(np.zeros((3, 1, 1), np.int32), 6, 2)
  with pytest.raises(ValueError, match="multiple of R"):
    network.copies(np.zeros((4, 1, 1), np.int32), 6, 2)
