"""Bytes and GB/s of the benchmark (jax_ep/bench/traffic.py), on a routing counted by hand.

Every expected value below is an exact small integer (or a half), so the
comparisons are exact.
"""

import numpy as np
import pytest

from jax_ep.bench import traffic

H = 256          # row bytes: bf16 512, FP8 256 + 4 * 2 = 264
E = 4            # 2 ranks: experts 0, 1 on rank 0; 2, 3 on rank 1
ROUTING = np.array([
    [[0, 2, 3],     # rank 0, token 0: one expert here, two on rank 1
     [1, 1, -1],    # token 1: a repeated expert counts once; -1 is not routed
     [-1, 3, 9]],   # token 2: 9 is out of range, not routed
    [[3, 2, 0],     # rank 1, token 0: two experts here, one on rank 0
     [0, 7, 1],     # token 1: two on rank 0 (7 is out of range)
     [-1, -1, -1]],  # token 2: nothing
], dtype=np.int32)
PAIRS = [[2, 3], [3, 2]]   # [source, destination]
TOKENS = [[2, 2], [2, 1]]


def test_row_bytes():
  assert traffic.row_bytes(7168, fp8=False) == 14336
  assert traffic.row_bytes(7168, fp8=True) == 7168 + 4 * 56
  assert traffic.row_bytes(H, fp8=True) == 264


def test_routing_counts_by_hand():
  counts = traffic.routing_counts(ROUTING, E)
  assert counts.pairs.tolist() == PAIRS
  assert counts.tokens.tolist() == TOKENS
  with pytest.raises(ValueError):
    traffic.routing_counts(ROUTING, 5)


def test_ll_dispatch_payload_crosses_once_per_token_and_rank():
  counts = traffic.routing_counts(ROUTING, E)
  fp8 = traffic.ll_dispatch(counts, H, fp8=True)
  # DeepEP's way: every (token, expert) row received, own rows too: 5 on each rank.
  assert fp8.deepep_bytes == 5 * 264
  # Crossing into each rank: 2 tokens of the other rank (once each, though they
  # carry 3 (token, expert) pairs) plus a 16-byte header per pair.
  assert fp8.link_bytes == 2 * 264 + 3 * 16
  bf16 = traffic.ll_dispatch(counts, H, fp8=False)
  assert (bf16.deepep_bytes, bf16.link_bytes) == (5 * 512, 2 * 512 + 3 * 16)


def test_ll_combine_sends_one_row_per_token_and_expert():
  counts = traffic.routing_counts(ROUTING, E)
  moved = traffic.ll_combine(counts, H)
  assert moved.deepep_bytes == 5 * 512   # rows back to each rank, its own included
  assert moved.link_bytes == 3 * 512     # of which from the other rank


def test_ht_rows_cross_once_per_token_and_rank():
  counts = traffic.routing_counts(ROUTING, E)
  bf16 = traffic.ht_dispatch(counts, H, fp8=False)
  # Received (token, rank) rows: 4 on rank 0, 3 on rank 1; 2 cross into each.
  assert (bf16.deepep_bytes, bf16.link_bytes) == (3.5 * 512, 2 * 512)
  fp8 = traffic.ht_dispatch(counts, H, fp8=True)
  assert (fp8.deepep_bytes, fp8.link_bytes) == (3.5 * 264, 2 * 264)
  back = traffic.ht_combine(counts, H)
  assert (back.deepep_bytes, back.link_bytes) == (3.5 * 512, 2 * 512)


def test_bare_all_to_all():
  moved = traffic.bare_all_to_all(num_ranks=2, num_tokens=3, hidden=H, fp8=False)
  assert (moved.deepep_bytes, moved.link_bytes) == (2 * 3 * 512, 3 * 512)
  assert traffic.bare_all_to_all(4, 3, H, fp8=True).link_bytes == 3 * 3 * 264


def test_portable_rows_keep_only_the_received_bytes():
  moved = traffic.ll_dispatch(traffic.routing_counts(ROUTING, E), H, fp8=True)
  assert moved.received_only() == traffic.Traffic(moved.deepep_bytes, None)


def test_gbps():
  assert traffic.gbps(1e6, 1.0) == 1000.0   # 1 MB per us = 1e12 B/s
  assert traffic.gbps(3e5, 150.0) == 2.0
  assert traffic.gbps(None, 5.0) is None
  assert traffic.gbps(1e6, None) is None
  assert traffic.gbps(1e6, -3.0) is None   # a noisy negative slope has no rate
