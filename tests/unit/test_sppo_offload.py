"""Offload ratios (alpha_i A_i = M_threshold, two levels) and the simulator's copy stream."""
import dataclasses

import pytest

from megatron.plugin.pipeline.ir import parse_schedule
from megatron.plugin.pipeline.simulator import UniformCosts, simulate

from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import get_model

from sppo_offload.costs import SequenceCosts, subsequence_chunks
from sppo_offload.offload import (capped, capped_ratios, host_bytes, offload_ratios,
                                  offloadable_bytes, parse_offload, resident_bytes,
                                  threshold_bytes)
from sppo_offload.partition import balanced_lengths
from sppo_offload.pipeline import build_schedule


def setup(host_gbps, seq=262144, n=16, pp=4, sp=8):
    hardware = dataclasses.replace(load_profile("a100"), host_link_gbps=host_gbps)
    cost = CostModel(get_model("gpt-7b"), hardware, ParallelConfig(pp=pp, tp=sp))
    lengths = balanced_lengths(seq, n, cost.linear_per_token, cost.alpha1, sp)
    return cost, lengths, subsequence_chunks(lengths)


def test_parse_offload():
    assert parse_offload("auto") == "auto" and parse_offload("off") == "off"
    assert parse_offload("0.25") == 0.25
    for bad in ("1.5", "-0.1", "most"):
        with pytest.raises(ValueError, match="--sppo-offload"):
            parse_offload(bad)


def test_two_levels_split_the_stash():
    cost, _, chunks = setup(32.0)
    for stage in range(cost.pp):
        for chunk in chunks:
            kept, moved = resident_bytes(cost, stage, chunk), offloadable_bytes(cost, stage, chunk)
            assert kept + moved == pytest.approx(cost.stash_bytes(stage, chunk))
            kv = cost.layers(stage) * chunk.tokens * cost.kv_per_token
            assert kept >= kv and moved > 0
    assert resident_bytes(cost, 0, chunks[-1]) == pytest.approx(
        cost.layers(0) * chunks[-1].tokens * cost.kv_per_token)  # no dK/dV buffer on the last


@pytest.mark.parametrize("host_gbps", [0.5, 2.0, 32.0])
def test_ratio_formula(host_gbps):
    cost, _, chunks = setup(host_gbps)
    alphas = offload_ratios(cost, chunks, "auto", host_gbps)
    for stage, row in enumerate(alphas):
        threshold = threshold_bytes(cost, stage, chunks, host_gbps)
        assert row[-1] == 0.0
        for alpha, chunk in zip(row[:-1], chunks[:-1]):
            size = offloadable_bytes(cost, stage, chunk)
            assert 0.0 < alpha <= 1.0
            if alpha < 1.0:
                assert alpha * size == pytest.approx(threshold)
            else:
                assert size <= threshold
        # earlier subsequences are longer, so they get the smaller ratios
        assert list(row[:-1]) == sorted(row[:-1])
    assert offload_ratios(cost, chunks, "off", host_gbps) == tuple((0.0,) * 16 for _ in range(4))
    assert set(offload_ratios(cost, chunks, 0.5, None)[0]) == {0.5, 0.0}


def test_auto_needs_a_host_link():
    cost, _, chunks = setup(None)
    with pytest.raises(ValueError, match="no host_link_gbps"):
        offload_ratios(cost, chunks, "auto", None)


class CopyCosts(UniformCosts):
    def __init__(self, copy):
        super().__init__()
        self.copy = copy

    def duration(self, action):
        return self.copy if action.is_memory() else super().duration(action)

    def activation_bytes(self, action):
        return 0.6 if action.is_memory() else 1.0


PLAIN = "0: 0F0 0F1 0B1 0B0"
COPIED = "0: 0F0 0OFFLOAD0 0F1 0RELOAD0 0B1 0B0"


def test_copy_hidden_behind_compute_frees_memory():
    plain = simulate(parse_schedule(PLAIN))
    result = simulate(parse_schedule(COPIED), CopyCosts(copy=0.5))
    assert result.iteration_time == plain.iteration_time == 6.0
    assert result.busy == plain.busy  # copies are not compute
    assert (1.5, pytest.approx(0.4)) in result.memory_timeline[0]  # freed when the copy ends
    assert (2.0, pytest.approx(1.4)) in result.memory_timeline[0]  # F1 stashed on top
    assert result.peak_memory[0] == plain.peak_memory[0]  # the reload is back before B1
    assert (2.0, pytest.approx(2.0)) in result.memory_timeline[0]  # reload adds at its start
    assert result.memory_timeline[0][-1][1] == pytest.approx(0.0)
    times = [t for t, _ in result.memory_timeline[0]]
    assert times == sorted(times)


def test_slow_copy_delays_the_backward():
    result = simulate(parse_schedule(COPIED), CopyCosts(copy=3.0))
    # offload 1..4, reload queued behind it 4..7, B1 2..4, B0 waits for the reload: 7..9
    assert result.iteration_time == 9.0
    assert result.idle[0] == 3.0


def test_sppo_offload_lowers_peak_without_slowing_down():
    cost, lengths, chunks = setup(32.0)
    alphas = offload_ratios(cost, chunks, "auto", 32.0)
    moved = [[a * offloadable_bytes(cost, s, c) for a, c in zip(alphas[s], chunks)]
             for s in range(cost.pp)]
    plain = simulate(build_schedule(cost.pp, len(lengths)), SequenceCosts(cost, lengths))
    offloaded = simulate(build_schedule(cost.pp, len(lengths), lambda a: moved[a.stage][a.unit]),
                         SequenceCosts(cost, lengths, moved, None, 32.0))
    assert offloaded.iteration_time == pytest.approx(plain.iteration_time, rel=1e-3)
    for stage in range(cost.pp):
        saved = plain.peak_memory[stage] - offloaded.peak_memory[stage]
        assert saved > 0.5 * sum(moved[stage])
    assert max(offloaded.peak_memory) < 0.8 * max(plain.peak_memory)
    assert sum(moved[0]) > 1 * GB


def test_capped_lowers_the_largest_moves_to_a_common_level():
    ratios, sizes = (1.0, 1.0, 0.5, 0.0), (100.0, 60.0, 40.0, 30.0)  # moves 100, 60, 20, 0
    assert capped(ratios, sizes, 200.0) == ratios  # within the cap
    lowered = capped(ratios, sizes, 120.0)  # level 50: moves 50, 50, 20, 0
    moved = [r * s for r, s in zip(lowered, sizes)]
    assert moved[2:] == [20.0, 0.0]
    assert moved[0] == moved[1] == pytest.approx(49.0)  # the level 50, rounded down, less one
    assert sum(moved) <= 120.0
    assert capped(ratios, sizes, 0.0) == (0.0, 0.0, 0.0, 0.0)


def test_capped_ratios_keep_every_stage_within_the_cap():
    cost, _, chunks = setup(32.0)
    full = tuple((1.0,) * 15 + (0.0,) for _ in range(4))
    cap = 0.5 * min(host_bytes(cost, chunks, full))
    lowered = capped_ratios(cost, chunks, full, cap)
    assert all(b <= cap for b in host_bytes(cost, chunks, lowered))
    for stage, row in enumerate(lowered):
        moved = [a * offloadable_bytes(cost, stage, chunk) for a, chunk in zip(row, chunks)]
        level = max(moved)
        cut = [j for j, a in enumerate(row) if a < full[stage][j]]
        assert cut and cut == list(range(len(cut)))  # the longest (first) subsequences
        assert all(moved[j] == pytest.approx(level) for j in cut)
        assert all(moved[j] <= level for j in range(len(cut), len(row)))
        assert sum(moved) == pytest.approx(cap, abs=2 * len(cut))  # less the level rounding
