"""Collectives priced as NCCL runs them, against numbers worked out by hand.

The profile: 8 GPUs a node, NVLink 200 GB/s a GPU and direction, the node's NICs 50 GB/s
together (so a GPU's share when the whole node crosses is 50 / 8 = 6.25 GB/s), a GPU's own NIC
25 GB/s (not binding), latencies 1 us within a node and 10 us across.
"""
import dataclasses

import pytest

from longctx import collectives
from longctx.chunks import Chunk, Piece
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig

GB = 1e9


@pytest.fixture
def hw():
    return dataclasses.replace(load_profile("a800"), gpus_per_node=8, intra_node_gbps=200.0,
                               inter_node_gbps=25.0, node_nic_gbps=50.0,
                               intra_node_latency_s=1e-6, inter_node_latency_s=1e-5)


def test_ranks_per_node(hw):
    assert collectives.ranks_per_node(hw, 4, 4) == 4       # inside one node
    assert collectives.ranks_per_node(hw, 16, 16) == 8     # two whole nodes
    assert collectives.ranks_per_node(hw, 8, 16) == 4      # stride 2: 4 ranks a node
    assert collectives.ranks_per_node(hw, 4, 32) == 1      # stride 8: one rank a node


def test_all_to_all_within_a_node(hw):
    # n = 8 on one node: (8-1)/8 of 1 GB over NVLink = 0.875 GB / 200 GB/s = 4.375 ms.
    assert collectives.all_to_all_per_byte(hw, 8, 8) * GB == pytest.approx(4.375e-3)


def test_all_to_all_charges_the_nics_with_the_cross_node_share_only(hw):
    # n = 16 over two nodes, 8 a node; 1 GB a rank, 1/16 GB to each rank.
    # NVLink: 7/16 GB / 200 GB/s = 2.1875 ms; NICs: 8/16 GB / 6.25 GB/s = 80 ms; the NICs
    # decide: 80 ms (the whole (n-1)/n at the NIC share would be 15/16 / 6.25 = 150 ms).
    assert collectives.all_to_all_per_byte(hw, 16, 16) * GB == pytest.approx(80e-3)
    # n = 32 over four nodes: 24/32 GB / 6.25 GB/s = 120 ms.
    assert collectives.all_to_all_per_byte(hw, 32, 32) * GB == pytest.approx(120e-3)
    # n = 8 strided 2 (span 16): 4 a node; NICs 4/8 GB / 6.25 = 80 ms, NVLink 3/8 / 200.
    assert collectives.all_to_all_per_byte(hw, 8, 16) * GB == pytest.approx(80e-3)


def test_ring_within_a_node(hw):
    # all-gather of a 1 GB buffer over 8 ranks: 7 steps of 1/8 GB at 200 GB/s = 4.375 ms.
    assert collectives.ring_per_byte(hw, 8, 8) * GB == pytest.approx(4.375e-3)
    # all-reduce: reduce-scatter + all-gather = 8.75 ms.
    assert collectives.all_reduce_per_byte(hw, 8, 8) * GB == pytest.approx(8.75e-3)


def test_ring_crosses_each_nodes_nics_once(hw):
    # n = 16 over two whole nodes: the crossing link gets the node's NICs, 8 x 6.25 = 50 GB/s,
    # below NVLink's 200, so each of the 15 steps passes 1/16 GB at 50 GB/s:
    # 15/16 / 50 = 18.75 ms (8x less than 15/16 / 6.25 = 150 ms at one GPU's share).
    assert collectives.ring_per_byte(hw, 16, 16) * GB == pytest.approx(18.75e-3)
    assert collectives.all_reduce_per_byte(hw, 16, 16) * GB == pytest.approx(37.5e-3)
    # n = 4 strided 8 (span 32): one rank a node, eight sibling rings share the NICs:
    # 6.25 GB/s a ring, 3/4 / 6.25 = 120 ms.
    assert collectives.ring_per_byte(hw, 4, 32) * GB == pytest.approx(120e-3)
    # a point-to-point ring step of 1 GB at 6.25 GB/s: 160 ms.
    assert collectives.ring_step_per_byte(hw, 4, 32) * GB == pytest.approx(160e-3)


def test_ring_is_bounded_by_nvlink_when_the_nics_are_faster(hw):
    # NICs of 3200 GB/s a node: a GPU's share is min(25, 3200 / 8) = 25 GB/s, the crossing
    # link 8 x 25 = 200 GB/s; NVLink of 100 GB/s is then the slowest: 15/16 / 100 = 9.375 ms.
    fast = dataclasses.replace(hw, node_nic_gbps=3200.0, intra_node_gbps=100.0)
    assert collectives.ring_per_byte(fast, 16, 16) * GB == pytest.approx(9.375e-3)


def test_cost_model_prices_ulysses_and_tp_with_them(hw):
    # h = 1024, BF16 (e = 2): a token's activation is 2048 bytes.
    model = ModelConfig("m", 4, 1024, 16, 4096, 1000, dtype="bfloat16")
    chunk = Chunk((Piece(0, 0, 0, 16384, True),))
    # Ulysses SP 16 over two nodes, TP 1: four all-to-alls of 16384 x 2048 / 16 = 2 MiB a GPU,
    # each 10 us + 2097152 B x 8/16 / 6.25 GB/s = 10 us + 167.77 us = 177.77 us; four: 711.1 us.
    sp = CostModel(model, hw, ParallelConfig(pp=1, sp=16, memory_gb=80))
    assert sp.layer_collectives(chunk) == pytest.approx(4 * (1e-5 + 2097152 * 0.5 / 6.25e9))
    # TP 16 over two nodes: four rings over the whole 16384 x 2048 = 32 MiB buffer, each
    # 10 us + 33554432 x 15/16 / 50 GB/s = 10 us + 629.1 us; four: 2.5566 ms.
    tp = CostModel(model, hw, ParallelConfig(pp=1, tp=16, memory_gb=80))
    assert tp.layer_collectives(chunk) == pytest.approx(4 * (1e-5 + 33554432 * 15 / 16 / 50e9))
