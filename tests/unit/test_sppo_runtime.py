"""Pure parts of the ``sppo`` training runtime: cutting a batch's documents into subsequences,
their offload ratios and schedule, and the flags."""
import argparse
import math

import pytest

from megatron.plugin.arguments import parse
from megatron.plugin.pipeline.ir import Kind
from megatron.plugin.pipeline.validation import validate

from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig

from sppo_offload.pipeline import build_schedule
from longctx.cost_model import GB

from sppo_offload.batch_plan import auto_subsequences, check_budget, plan_subsequences, replay
from sppo_offload.partition import packed_documents
from sppo_offload.flags import offload_flag, subsequences_flag
from sppo_offload.multiplex import multiplexed_peaks
from sppo_offload.subsequence_batch import _check_multiplexable


def cost_model(pp=2):
    return CostModel(ModelConfig("tiny", 4, 32, 4, 128, 256), load_profile("a800"),
                     ParallelConfig(pp=pp))


def test_documents_are_cut_in_order_and_short_ones_packed():
    """The longest subsequence of the documents' wanted cuts (6 each) is the unit length:
    documents no longer than it are packed whole into one row of at most that many tokens, a
    longer one is cut into no more subsequences than keep them about that long."""
    lengths = [61, 3, 1, 40]
    plan = plan_subsequences(lengths, cost_model(), 6, 0.5)
    capacity = plan.chunks[0].tokens
    assert plan.counts == (6, 1, math.ceil(40 / capacity)) == (6, 1, 4)
    assert [[p.doc for p in chunk.pieces] for chunk in plan.chunks] == \
        [[0]] * 6 + [[1, 2]] + [[3]] * 4
    packed = plan.chunks[6].pieces
    assert [(p.start, p.end, p.final) for p in packed] == [(0, 3, True), (0, 1, True)]
    assert [plan.is_slice(unit) for unit in range(len(plan.chunks))] == \
        [True] * 6 + [False] + [True] * 4
    assert all(chunk.tokens <= capacity for chunk in plan.chunks)
    for doc in (0, 3):
        mine = [c.pieces[0] for c in plan.chunks if c.pieces[0].doc == doc]
        assert [p.slice for p in mine] == list(range(len(mine)))
        assert mine[0].start == 0 and mine[-1].end == lengths[doc] and mine[-1].final
        assert all(a.end == b.start for a, b in zip(mine, mine[1:]))
        tokens = [p.tokens for p in mine]
        assert tokens == sorted(tokens, reverse=True)  # context makes later ones shorter
    # A ratio applies to every unit but each sequence's last, on every stage.
    last = {5, 6, 10}
    for row in plan.alphas:
        assert [unit for unit, a in enumerate(row) if a == 0] == sorted(last)
        assert all(a == 0.5 for unit, a in enumerate(row) if unit not in last)


def test_the_longest_document_gets_the_subsequences_asked():
    """Where attention dominates (16K tokens, hidden 64) FLOPs-balanced cuts are far from
    equal: the first of 8 is 5,613 tokens, so 16,384 / 5,613 rounds up to only 3. The
    document that sets the unit length is still cut into the 8 asked; a shorter one into the
    fewest balanced subsequences whose first fits that length."""
    from sppo_offload.partition import balanced_lengths

    cost = CostModel(ModelConfig("tiny", 4, 64, 4, 256, 257), load_profile("a800"),
                     ParallelConfig(pp=2))
    plan = plan_subsequences([16384, 9000], cost, 8, 1.0)
    capacity = plan.chunks[0].tokens
    assert plan.counts[0] == 8 and math.ceil(16384 / capacity) == 3
    fewest = next(k for k in range(1, 9) if balanced_lengths(
        9000, k, cost.linear_per_token, cost.alpha1)[0] <= capacity)
    assert plan.counts[1] == fewest < 8
    assert all(chunk.tokens <= capacity for chunk in plan.chunks)


def test_short_documents_are_packed_first_fit_in_decreasing_length():
    """32 documents of at most 4K tokens cut in two: the short ones fill rows of the longest
    subsequence instead of two units each (Megatron packs such a batch into 4K rows)."""
    lengths = [4096, 3000, 2500, 1900, 1800, 1200, 900, 700, 300, 200, 100, 50] * 2 \
        + [64] * 8
    plan = plan_subsequences(lengths, cost_model(), 2, "off")
    capacity = max(chunk.tokens for chunk in plan.chunks)
    rows = [chunk for unit, chunk in enumerate(plan.chunks) if not plan.is_slice(unit)]
    assert sorted(p.doc for row in rows for p in row.pieces) == \
        [doc for doc, tokens in enumerate(lengths) if tokens <= capacity]
    assert sum(row.tokens for row in rows) > (len(rows) - 1) * capacity / 2
    assert len(plan.chunks) < len(lengths)  # cut in two each, they made 2 x 32 units
    assert packed_documents([5, 3, 4, 2, 6], 7) == [[0, 3], [1, 2], [4]]


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
    # The shorter document is cut into no more than keep its subsequences about as long.
    assert plan.counts == (4, 3)


def test_the_batch_schedule_offloads_what_the_plan_says_and_validates():
    plan = plan_subsequences([30, 2, 25], cost_model(), 4, 1.0)
    schedule = build_schedule(2, plan.counts, lambda a: plan.alphas[a.stage][a.unit] > 0)
    validate(schedule)
    for row in schedule:
        offloaded = sorted(a.unit for a in row if a.kind is Kind.OFFLOAD)
        reloaded = sorted(a.unit for a in row if a.kind is Kind.RELOAD)
        assert offloaded == reloaded == [0, 1, 2, 5, 6, 7]
        backwards = [a.unit for a in row if a.kind is Kind.BACKWARD]
        assert backwards == [3, 2, 1, 0, 4, 8, 7, 6, 5]


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


def test_a_host_cap_lowers_auto_ratios_and_check_budget_accepts_what_fits():
    lengths, cost = [61, 3, 40], cost_model()
    free = plan_subsequences(lengths, cost, 4, "auto", most_saving=True)
    peak, host = replay(free, cost)
    cap = 0.5 * max(host)
    plan = plan_subsequences(lengths, cost, 4, "auto", 1, cap, most_saving=True)
    assert max(replay(plan, cost)[1]) <= cap
    assert sum(map(sum, plan.alphas)) < sum(map(sum, free.alphas))
    # The budget is the plan's own peak, rounded up to the next float (GB is 1e9 bytes).
    least = math.nextafter(max(replay(plan, cost)[0]) / GB, math.inf)
    check_budget(lengths, plan, cost, 4, "auto", least, math.nextafter(cap / GB, math.inf))
    assert max(replay(plan, cost)[0]) > max(peak)  # what the host does not take stays


def test_check_budget_names_the_smallest_device_budget_that_fits():
    lengths, cost = [61, 3, 40], cost_model()
    plan = plan_subsequences(lengths, cost, 4, "auto")
    with pytest.raises(ValueError, match="the smallest budget that fits is") as err:
        check_budget(lengths, plan, cost, 4, "auto", 1e-4, None)
    least = float(str(err.value).split("fits is ")[1].split(" GB")[0])
    saver = plan_subsequences(lengths, cost, 4, "auto", most_saving=True)
    check_budget(lengths, saver, cost, 4, "auto", least, None)
    with pytest.raises(ValueError, match="--sppo-offload auto"):
        check_budget(lengths, plan_subsequences(lengths, cost, 4, 0.5), cost, 4, 0.5, 1e-4, None)
    huge = CostModel(ModelConfig("big", 4, 8192, 64, 32768, 256), load_profile("a800"),
                     ParallelConfig(pp=2))
    long = [1 << 20]
    with pytest.raises(ValueError, match="cannot fit even fully offloaded"):
        check_budget(long, plan_subsequences(long, huge, 4, "auto"), huge, 4, "auto", 80, None)


def test_check_budget_refuses_a_fixed_ratio_the_host_cap_cannot_hold():
    lengths, cost = [61, 3, 40], cost_model()
    plan = plan_subsequences(lengths, cost, 4, 1.0, 1, 1e3)  # a fixed ratio is not lowered
    with pytest.raises(ValueError, match="more than --sppo-host-memory-gb 1e-06; raise it to "
                                         "at least") as err:
        check_budget(lengths, plan, cost, 4, 1.0, 16, 1e-6)
    need = float(str(err.value).split("at least ")[1].split(",")[0])
    check_budget(lengths, plan, cost, 4, 1.0, 16, need)


TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "4", "--pipeline-schedule", "sppo",
        "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--calculate-per-token-loss", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


@pytest.mark.parametrize("flags,message", [
    (["--sppo-subsequences", "3"], "--sppo-subsequences 3 is smaller than "
                                   "--pipeline-model-parallel-size 4"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "sppo runs one model chunk per rank"),
    (["--recompute-granularity", "selective"],
     "selective is not supported by --pipeline-schedule sppo: .* or offload instead"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--sppo-offload", "0.5"],
     "--sppo-offload 0.5 with --recompute-granularity full: sppo recomputes"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1", "--sppo-multiplex"],
     "--recompute-granularity full with --sppo-multiplex"),
    (["--sppo-host-memory-gb", "0"], "--sppo-host-memory-gb must be > 0"),
    (["--sppo-memory-gb", "-1"], "--sppo-memory-gb must be > 0"),
    (["--sppo-multiplex", "--tensor-model-parallel-size", "2"],
     "--sppo-multiplex runs with --tensor-model-parallel-size 1"),
    (["--sppo-multiplex", "--decoder-first-pipeline-num-layers", "1",
      "--decoder-last-pipeline-num-layers", "1"],
     "--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers with "
     "--sppo-multiplex: .* equal layers"),
])
def test_check_args_refuses_what_sppo_cannot_run(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8" if {"--tensor-model-parallel-size",
                                             "--use-distributed-optimizer"} & set(flags) else "4")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asks it of TP on CUDA
    with pytest.raises(ValueError, match=message):
        parse([*TINY, *flags])


def test_check_args_accepts_n_equal_to_pp(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    parse([*TINY, "--sppo-subsequences", "4"])


def test_multiplexing_needs_one_document_and_a_long_enough_first_subsequence():
    cost = cost_model()
    with pytest.raises(ValueError, match="a data-parallel replica got 2 documents"):
        _check_multiplexable(plan_subsequences([61, 40], cost, 4, "off"), cost, 80)
    deep = cost_model(pp=4)
    with pytest.raises(ValueError, match="a first subsequence of at least .* use fewer "
                                         "--sppo-subsequences"):
        _check_multiplexable(plan_subsequences([9], deep, 4, "off"), deep, 80)
    _check_multiplexable(plan_subsequences([61], cost, 4, "off"), cost, 80)


@pytest.mark.parametrize("pp,offload", [(2, "off"), (4, "off"), (2, "1")])
def test_multiplexing_over_the_budget_the_plain_plan_fits_is_refused(pp, offload):
    """The multiplexed schedule's helpers hold borrowed weights: its simulated peak is above
    the plain schedule's; with a budget between the two the plain plan trains and multiplexing
    is refused, naming the stage and the budget that would fit."""
    cost = cost_model(pp)
    plan = plan_subsequences([4096], cost, 4, offload)
    plain = max(replay(plan, cost)[0])
    peaks = multiplexed_peaks(cost, [chunk.pieces[0].tokens for chunk in plan.chunks],
                              plan.alphas)
    assert max(peaks) > plain
    budget = (plain + max(peaks)) / 2 / GB
    check_budget([4096], plan, cost, 4, offload, budget, None)  # the plain plan fits
    stage = peaks.index(max(peaks))
    with pytest.raises(ValueError, match=rf"--sppo-multiplex: the multiplexed schedule of this "
                                         rf"batch needs [0-9.]+ GB on stage {stage} .* more than "
                                         rf"--sppo-memory-gb {budget:g}, which the plain "
                                         rf"schedule fits: raise --sppo-memory-gb"):
        _check_multiplexable(plan, cost, budget)
    _check_multiplexable(plan, cost, max(peaks) / GB * 1.01)


def test_a_synchronous_host_tier_takes_the_bytes_off_at_the_offload():
    """Replayed with the copies made at their actions (the CPU's tier), offloading every
    subsequence but the last lowers every stage's peak below the plan without offloading; the
    host bytes do not depend on the copies' speed."""
    lengths, cost = [61, 3, 40], cost_model()
    off = replay(plan_subsequences(lengths, cost, 4, "off"), cost)[0]
    plan = plan_subsequences(lengths, cost, 4, 1.0)
    assert replay(plan, cost, math.inf)[1] == replay(plan, cost)[1]
    assert all(s < o for s, o in zip(replay(plan, cost, math.inf)[0], off))


def test_megatrons_recompute_flags_checkpoint_every_unit_and_offload_nothing():
    """With each stage's layers checkpointed (Megatron's uniform recomputation: both of a
    stage's 2) the plan offloads nothing even under ``auto``, its schedule recomputes every
    unit once right before that unit's backward, and the replayed peak of every stage is below
    the plan's without recomputation by at least the layers' stash the checkpoints drop."""
    lengths, cost = [61, 3, 40], cost_model()
    plain = plan_subsequences(lengths, cost, 4, "off")
    plan = plan_subsequences(lengths, cost, 4, "auto", checkpointed=(2, 2))
    assert plan.checkpointed == (2, 2) and plan.recomputes(1) == 2
    assert plan.chunks == plain.chunks and not any(a for row in plan.alphas for a in row)
    schedule = build_schedule(cost.pp, plan.counts, recomputed=lambda a: plan.recomputes(a.stage))
    validate(schedule)
    for row in schedule:
        compute = [(a.kind, a.unit) for a in row if a.is_compute()]
        backwards = [i for i, (kind, _) in enumerate(compute) if kind is Kind.BACKWARD]
        assert len(backwards) == len(plan.chunks)
        assert all(compute[i - 1] == (Kind.RECOMPUTE, compute[i][1]) for i in backwards)
        assert sum(kind is Kind.RECOMPUTE for kind, _ in compute) == len(backwards)
    saved = cost.stash_bytes(0, plan.chunks[0]) - cost.stash_bytes(0, plan.chunks[0], 2)
    assert saved > 0
    for with_ckpt, without in zip(replay(plan, cost)[0], replay(plain, cost)[0]):
        assert with_ckpt <= without - saved
    assert plan.to_dict()["checkpointed"] == [2, 2]
