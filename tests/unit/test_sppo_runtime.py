"""Pure parts of the ``sppo`` training runtime: cutting a batch's documents into subsequences,
their offload ratios and schedule, and the flags."""
import argparse

import pytest

from megatron.plugin.arguments import build_parser, validate_args
from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.validation import validate

from elastic_pipe.cost_model import CostModel, ParallelConfig
from elastic_pipe.hardware import load_profile
from elastic_pipe.models import ModelConfig

from sppo_offload.pipeline import build_schedule
from sppo_offload.runtime import (auto_subsequences, offload_flag, plan_subsequences,
                                  subsequences_flag)


def cost_model(pp=2):
    return CostModel(ModelConfig("tiny", 4, 32, 4, 128, 256), load_profile("a800"),
                     ParallelConfig(pp=pp))


def test_documents_are_cut_in_order_with_short_ones_in_single_tokens():
    plan = plan_subsequences([61, 3, 1, 40], cost_model(), 6, 0.5)
    assert plan.counts == (6, 3, 1, 6)
    pieces = [chunk.pieces[0] for chunk in plan.chunks]
    assert [p.doc for p in pieces] == [0] * 6 + [1] * 3 + [2] + [3] * 6
    for doc, tokens in enumerate([61, 3, 1, 40]):
        mine = [p for p in pieces if p.doc == doc]
        assert [p.slice for p in mine] == list(range(len(mine)))
        assert mine[0].start == 0 and mine[-1].end == tokens and mine[-1].final
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        lengths = [p.tokens for p in mine]
        assert lengths == sorted(lengths, reverse=True)  # context makes later ones shorter
    # A ratio applies to every subsequence but each document's last, on every stage.
    last = {5, 8, 9, 15}
    for row in plan.alphas:
        assert [unit for unit, a in enumerate(row) if a == 0] == sorted(last)
        assert all(a == 0.5 for unit, a in enumerate(row) if unit not in last)


def test_offload_off_and_auto():
    off = plan_subsequences([64], cost_model(), 4, "off")
    assert off.alphas == ((0.0,) * 4,) * 2
    auto = plan_subsequences([64], cost_model(), 4, "auto")
    assert all(0 < a <= 1 for row in auto.alphas for a in row[:-1])
    assert all(row[-1] == 0 for row in auto.alphas)


def test_auto_subsequences_follow_the_solver_band():
    assert auto_subsequences(64, 4, 1) == 4  # shorter than the band: N = PP
    assert auto_subsequences(1_000_000, 2, 8) == 8  # 16K tokens per device at most
    plan = plan_subsequences([64, 50], cost_model(pp=4), "auto", "off")
    assert plan.counts == (4, 4)


def test_the_batch_schedule_offloads_what_the_plan_says_and_validates():
    plan = plan_subsequences([30, 2, 25], cost_model(), 4, 1.0)
    schedule = build_schedule(2, plan.counts, lambda a: plan.alphas[a.stage][a.unit] > 0)
    validate(schedule)
    for row in schedule:
        offloaded = sorted(a.unit for a in row if a.kind is Kind.OFFLOAD)
        reloaded = sorted(a.unit for a in row if a.kind is Kind.RELOAD)
        assert offloaded == reloaded == [0, 1, 2, 4, 6, 7, 8]
        backwards = [a.unit for a in row if a.kind is Kind.BACKWARD]
        assert backwards == [3, 2, 1, 0, 5, 4, 9, 8, 7, 6]


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("6", 6)])
def test_subsequences_flag(value, expected):
    assert subsequences_flag(value) == expected


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_subsequences_flag_refuses(value):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'auto'"):
        subsequences_flag(value)


def test_offload_flag():
    assert offload_flag("off") == "off" and offload_flag("0.3") == 0.3
    with pytest.raises(argparse.ArgumentTypeError, match=r"ratio must be in \[0, 1\]"):
        offload_flag("2")


TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "sppo"]


@pytest.mark.parametrize("flags,message", [
    (["--sppo-subsequences", "3"], "--sppo-subsequences 3 is smaller than "
                                   "--pipeline-model-parallel-size 4"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "sppo runs one model chunk per rank"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "drop --recompute-granularity"),
    (["--sppo-host-memory-gb", "0"], "--sppo-host-memory-gb must be > 0"),
])
def test_check_args_refuses_what_sppo_cannot_run(flags, message):
    args = build_parser().parse_args([*TINY, *flags])
    with pytest.raises(ValueError, match=message):
        validate_args(args)


def test_check_args_accepts_n_equal_to_pp():
    validate_args(build_parser().parse_args([*TINY, "--sppo-subsequences", "4"]))
