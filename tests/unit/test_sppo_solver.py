"""SPPO solver: layouts, budgets, error messages, baselines, largest trainable length."""
import dataclasses

import pytest

from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.validation import validate

from longctx.cost_model import GB, CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import get_model

from sppo_offload.solver import (MEGATRON, SEQ1F1B, SPPO, NoFit, SolverConfig, fits,
                                 largest_length, layouts, solve, subsequence_counts,
                                 token_floor)

HW = load_profile("a100")
GPT7B = get_model("gpt-7b")


def test_layouts_are_blocks_of_a_node_or_of_whole_nodes():
    """SP 16 and 32 span two and four nodes (SPPO's tuned Megatron-LM runs SP 32); SP 12
    would split a node, and 3 does not divide its 8 GPUs."""
    found = layouts(GPT7B, HW, 32)
    assert {(l.sp, l.pp, l.dp) for l in found} >= {(8, 4, 1), (4, 4, 2), (1, 32, 1), (16, 2, 1),
                                                   (32, 1, 1)}
    assert not {l.sp for l in found} & {3, 6, 12, 24}
    wide = next(l for l in found if (l.sp, l.pp) == (32, 1))
    cost = CostModel(GPT7B, HW, ParallelConfig(pp=1, tp=wide.sp))
    # Four TP collectives a layer over 32 GPUs, each a ring gathering (or scattering) the
    # whole [tokens, h] activation; the ring crosses each node's NICs once, at the node's
    # whole network (8 GPUs' shares), slower than NVLink.
    assert 8 * HW.cross_node_gbps < HW.intra_node_gbps
    expected = 4 * 2 * 4096 * 31 / 32 / (8 * HW.cross_node_gbps * GB)
    assert cost.comm_per_token == pytest.approx(expected, rel=1e-12)
    for l in found:
        assert (HW.gpus_per_node % l.sp == 0 or l.sp % HW.gpus_per_node == 0) and \
            l.sp * l.pp * l.dp == 32 and l.pp <= 32


def test_a_fixed_layout_is_the_only_one_searched():
    plan = solve(SPPO, 1 << 20, GPT7B, HW, SolverConfig(gpus=32, memory_gb=80, layout=(4, 8)))
    assert (plan.layout.sp, plan.layout.pp, plan.layout.dp) == (4, 8, 1)
    with pytest.raises(ValueError, match="must divide the 32 GPUs"):
        SolverConfig(gpus=32, memory_gb=80, layout=(3, 4))
    with pytest.raises(ValueError, match=r"not one the solver can run.*block of one 8-GPU node"):
        solve(SPPO, 1 << 20, GPT7B, HW, SolverConfig(gpus=48, memory_gb=80, layout=(12, 4)))


def test_subsequence_counts_respect_the_band_and_pp():
    config = SolverConfig(gpus=32, memory_gb=80)
    layout = layouts(GPT7B, HW, 32)[-1]
    for seq in (1 << 16, 1 << 20, 1 << 22):
        for n in subsequence_counts(seq, layout, config):
            assert n >= layout.pp
            per_device = seq / (n * layout.sp)
            assert per_device <= config.max_tokens
            assert per_device >= config.min_tokens or n == layout.pp


def test_a_kernel_efficiency_curve_moves_the_bands_low_end_down_to_its_first_point():
    """Without a curve short subsequences are not priced and the band's 2K floor stands in for
    that; with one they are, and the floor is the curve's first point (below it the curve is
    held, not measured), never above min_tokens."""
    config = SolverConfig(gpus=32, memory_gb=80)
    layout = next(l for l in layouts(GPT7B, HW, 32) if (l.sp, l.pp) == (8, 4))
    plain = CostModel(GPT7B, HW, ParallelConfig(pp=4, tp=8))
    curved = CostModel(GPT7B, dataclasses.replace(HW, kernel_efficiency=((512, 0.4),
                                                                          (8192, 1.0))),
                       ParallelConfig(pp=4, tp=8))
    assert token_floor(plain, config) == 2048
    assert token_floor(curved, config) == 512
    assert token_floor(curved, SolverConfig(gpus=32, memory_gb=80, min_tokens=256)) == 256
    seq = 1 << 20  # 128K tokens a device
    assert max(subsequence_counts(seq, layout, config)) == (1 << 17) // 2048
    assert max(subsequence_counts(seq, layout, config, token_floor(curved, config))) == \
        (1 << 17) // 512


@pytest.mark.parametrize("gpus,seq", [(8, 262144), (16, 524288)])
def test_sppo_plan_fits_and_is_valid(gpus, seq):
    config = SolverConfig(gpus=gpus, memory_gb=80)
    plan = solve(SPPO, seq, GPT7B, HW, config)
    assert max(plan.peak_memory_bytes) <= 80 * GB
    assert sum(plan.lengths) == seq and all(s % plan.layout.sp == 0 for s in plan.lengths)
    assert len(plan.lengths) >= plan.layout.pp and not any(plan.checkpointed)
    assert plan.layout.sp * plan.layout.pp * plan.layout.dp == gpus
    assert plan.tokens_per_s == pytest.approx(plan.layout.dp * seq / plan.iteration_time_s)
    validate(plan.schedule)
    offloaded = {(a.stage, a.unit) for row in plan.schedule for a in row if a.kind is Kind.OFFLOAD}
    assert offloaded == {(s, j) for s, row in enumerate(plan.alphas)
                         for j, alpha in enumerate(row) if alpha > 0}


def test_baselines_are_priced_by_the_same_simulator():
    config = SolverConfig(gpus=16, memory_gb=80)
    megatron = solve(MEGATRON, 524288, GPT7B, HW, config)
    assert megatron.lengths == (524288,)
    assert megatron.checkpointed == tuple(32 // megatron.layout.pp for _ in
                                          range(megatron.layout.pp))
    assert any(a.kind is Kind.RECOMPUTE for row in megatron.schedule for a in row)
    seq1f1b = solve(SEQ1F1B, 524288, GPT7B, HW, config)
    assert not any(a for row in seq1f1b.alphas for a in row)
    sppo = solve(SPPO, 524288, GPT7B, HW, config)
    assert sppo.tokens_per_s > megatron.tokens_per_s  # no recomputation


def test_no_fit_names_the_smallest_budget_that_fits():
    with pytest.raises(NoFit, match="the smallest budget that fits is") as err:
        solve(SPPO, 262144, GPT7B, HW, SolverConfig(gpus=8, memory_gb=30))
    need = err.value.min_budget_gb
    assert 30 < need <= HW.hbm_gb
    plan = solve(SPPO, 262144, GPT7B, HW, SolverConfig(gpus=8, memory_gb=need))
    assert max(plan.peak_memory_bytes) <= need * GB


def test_a_sequence_too_long_even_fully_offloaded():
    with pytest.raises(NoFit, match="cannot fit even fully offloaded; use more GPUs"):
        solve(SPPO, 1 << 21, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80))


def test_offload_off_suggests_auto_and_fixed_n_limits_pp():
    with pytest.raises(NoFit, match="--sppo-offload auto"):
        solve(SPPO, 442368, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80, offload="off"))
    plan = solve(SPPO, 131072, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80, subsequences=4))
    assert len(plan.lengths) == 4 and plan.layout.pp <= 4  # N >= PP
    with pytest.raises(ValueError, match="no layout of 8 GPUs"):
        solve(SPPO, 7, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80, subsequences=8))
    with pytest.raises(ValueError, match="subsequences must be >= 1"):
        SolverConfig(gpus=8, memory_gb=80, subsequences=0)


def test_largest_length_is_the_boundary():
    config = SolverConfig(gpus=8, memory_gb=80)
    step = 65536
    found = {m: largest_length(m, GPT7B, HW, config, step) for m in (SPPO, SEQ1F1B)}
    for method, length in found.items():
        assert length > 0 and length % step == 0
        assert fits(method, length, GPT7B, HW, config)
        assert not fits(method, length + step, GPT7B, HW, config)
    # resident K/V + dK/dV (8h a token and layer) beat checkpointed input + K/V + dK/dV (10h)
    assert found[SPPO] >= found[SEQ1F1B]
    plan = solve(SPPO, found[SPPO], GPT7B, HW, config)
    assert max(plan.peak_memory_bytes) <= 80 * GB


def test_a_host_cap_lowers_the_largest_ratios_and_is_honoured():
    free = solve(SPPO, 196608, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80))
    cap = 78.0
    assert max(free.host_bytes) > cap * GB  # the uncapped plan needs more than the cap
    plan = solve(SPPO, 196608, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80,
                                                       host_memory_gb=cap))
    assert max(plan.host_bytes) <= cap * GB
    assert max(plan.peak_memory_bytes) <= 80 * GB
    assert max(plan.peak_memory_bytes) > max(free.peak_memory_bytes)  # bytes came back
    assert (plan.layout, plan.lengths) == (free.layout, free.lengths)
    # Largest first: only the first (longest) subsequence's ratio is lowered.
    lowered = [j for j, (a, b) in enumerate(zip(plan.alphas[0], free.alphas[0])) if a < b]
    assert lowered == [0]
    assert plan.alphas[0][1:] == free.alphas[0][1:]
    assert plan.to_dict()["host_memory_gb"] == [b / GB for b in plan.host_bytes]


def test_an_impossible_host_cap_names_the_host_budget_that_fits():
    config = SolverConfig(gpus=8, memory_gb=80, host_memory_gb=40)
    with pytest.raises(NoFit, match="the smallest host budget that fits is") as err:
        solve(SPPO, 262144, GPT7B, HW, config)
    host, device = err.value.min_host_gb, err.value.min_budget_gb
    assert 40 < host and device > 80
    plan = solve(SPPO, 262144, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80,
                                                       host_memory_gb=host))
    assert max(plan.host_bytes) <= host * GB and max(plan.peak_memory_bytes) <= 80 * GB
    smaller = SolverConfig(gpus=8, memory_gb=80, host_memory_gb=host - 0.1)
    with pytest.raises(NoFit):  # the smallest, to 0.1 GB
        solve(SPPO, 262144, GPT7B, HW, smaller)
    plan = solve(SPPO, 262144, GPT7B, HW, SolverConfig(gpus=8, memory_gb=device,
                                                       host_memory_gb=40))
    assert max(plan.host_bytes) <= 40 * GB and max(plan.peak_memory_bytes) <= device * GB


def test_a_fixed_ratio_is_not_lowered_under_a_host_cap():
    config = SolverConfig(gpus=8, memory_gb=80, offload=0.9, host_memory_gb=40)
    with pytest.raises(NoFit, match=r"smallest host budget that fits is .*--sppo-offload auto"):
        solve(SPPO, 131072, GPT7B, HW, config)
    with pytest.raises(ValueError, match="host_memory_gb must be > 0"):
        SolverConfig(gpus=8, memory_gb=80, host_memory_gb=0)


def test_no_sequence_fits_a_host_cap_that_no_host_budget_helps():
    with pytest.raises(NoFit, match="cannot fit even fully offloaded; use more GPUs") as err:
        solve(SPPO, 1 << 21, GPT7B, HW, SolverConfig(gpus=8, memory_gb=80, host_memory_gb=64))
    assert err.value.min_host_gb is None
