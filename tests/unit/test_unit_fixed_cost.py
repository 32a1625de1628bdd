"""A unit's fixed cost decides how many units a plan has (#44): with a large per-unit cost
(50 ms of host time per forward or backward action, about what an H200 run paid a micro-batch)
every planner that chooses a unit count plans a batch in no more units than Megatron-LM's
micro-batches; with none, the same batches are planned in more units at PP >= 2 (slicing buys
pipeline overlap there), so the bound comes from the cost and not from the batch. The refit
(``--elastic-refit-interval``, on by default) recovers such a cost from measured action times
that the spec-derived profile does not know, and the plans priced with it obey the bound."""
import dataclasses
import random

import pytest

from megatron.plugin.packing import micro_batch_rows

from elastic_pipe.baselines import seq1f1b
from elastic_pipe.refit import observations, refit
from elastic_pipe.run_costs import AUTO, AUTO_ATTEMPTS, Measured, refit_interval
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.sequence_processor import ChunkingConfig
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig

#: The H200 run's model (8 layers x 1024, 16 heads, bf16, Megatron's default dropout).
MODEL = ModelConfig("gpu-run", 8, 1024, 16, 4096, 257, dtype="bfloat16", hidden_dropout=True)
LARGE, NONE = 0.05, 0.0
LONG = 32768
SHORT = 4096


def short_documents(seed=0, count=48):
    rng = random.Random(seed)
    return [max(2, min(SHORT // 4, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(count)]


#: (batch, --seq-length): long documents of a full context, a skewed mixture, short documents.
BATCHES = {"long": ([LONG] * 2, LONG),
           "mixed": ([LONG, 20000, 9000, 3000, 1500, 700], LONG),
           "short": (short_documents(), SHORT)}


def cost_for(pp, host_action_s, profile="h200"):
    hardware = dataclasses.replace(load_profile(profile), host_action_s=host_action_s)
    return CostModel(MODEL, hardware, ParallelConfig(pp=pp, memory_gb=hardware.hbm_gb))


def sppo_args(seq_length, **flags):
    """The flags ``sppo``'s runtime plans a batch with (its defaults, the H200's memory)."""
    import argparse

    values = dict(tensor_model_parallel_size=1, context_parallel_size=1, seq_length=seq_length,
                  micro_batch_size=1, sppo_subsequences="auto", sppo_offload="auto",
                  sppo_host_memory_gb=None, sppo_memory_gb=141.0, sppo_multiplex=False)
    values.update(flags)
    return argparse.Namespace(**values)


def planned_units(planner, lengths, seq_length, cost, **flags):
    if planner == "sppo":
        from sppo_offload.subsequence_batch import _plan

        return len(_plan(lengths, cost, sppo_args(seq_length, **flags), (), None).chunks)
    config = SchedulerConfig(ChunkingConfig(seq_length=seq_length), solver_time_limit=0.05,
                             workers=1)
    plan = (plan_elastic if planner == "elastic" else seq1f1b)(lengths, cost, config)
    return len(plan.chunks())


def megatron_units(lengths, seq_length):
    return len(micro_batch_rows(lengths, seq_length, 1))


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("planner", ["elastic", "seq1f1b", "sppo"])
def test_a_large_per_unit_cost_plans_no_more_units_than_megatron(planner, pp, batch):
    lengths, seq_length = BATCHES[batch]
    units = planned_units(planner, lengths, seq_length, cost_for(pp, LARGE))
    assert units <= megatron_units(lengths, seq_length)


SPLIT_FINER = [(planner, pp, batch) for planner in ("elastic", "seq1f1b")
               for pp in (2, 4) for batch in ("long", "mixed")] \
    + [("sppo", 4, "long"), ("sppo", 4, "mixed"), ("sppo", 2, "mixed")]


@pytest.mark.parametrize("planner,pp,batch", SPLIT_FINER)
def test_without_a_per_unit_cost_the_same_batches_split_finer(planner, pp, batch):
    lengths, seq_length = BATCHES[batch]
    units = planned_units(planner, lengths, seq_length, cost_for(pp, NONE))
    assert units > megatron_units(lengths, seq_length)


@pytest.mark.parametrize("flags", [{"sppo_subsequences": 4}, {"sppo_offload": 0.5},
                                   {"sppo_multiplex": True}], ids=["subsequences", "ratio",
                                                                   "multiplex"])
def test_sppo_keeps_its_cut_where_a_flag_asks_for_one(flags):
    """A fixed ``--sppo-subsequences``, a fixed offload ratio (of every subsequence but a
    document's last: whole documents would offload nothing) and ``--sppo-multiplex`` (which
    splits one document's first subsequence) are honoured: no Megatron candidate then."""
    lengths, seq_length = BATCHES["long"]
    units = planned_units("sppo", lengths, seq_length, cost_for(2, LARGE), **flags)
    assert units > megatron_units(lengths, seq_length)


def measured_times(cost, truth, chunks):
    """Observations of ``chunks`` on every stage, timed as ``truth`` prices them."""
    seen = []
    for stage in range(cost.pp):
        times = {unit: (truth.stage_forward(stage, chunk), truth.stage_backward(stage, chunk))
                 for unit, chunk in enumerate(chunks)}
        seen.extend(observations(stage, chunks, times))
    return seen


@pytest.mark.parametrize("pp", [2, 4])
def test_the_refit_picks_up_a_fixed_cost_the_profile_does_not_know(pp):
    """The spec-derived profile prices no host time; the machine pays 50 ms an action. The
    plan made with the profile has many small units; the refit to their measured times prices
    each action's fixed cost, and the plan made with it keeps Megatron's unit count."""
    lengths, seq_length = BATCHES["long"]
    spec, truth = cost_for(pp, NONE), cost_for(pp, LARGE)
    config = SchedulerConfig(ChunkingConfig(seq_length=seq_length), solver_time_limit=0.05,
                             workers=1)
    first = plan_elastic(lengths, spec, config).chunks()
    assert len(first) > megatron_units(lengths, seq_length)
    profile, summary = refit(spec, measured_times(spec, truth, first))
    assert profile is not None, summary
    refitted = CostModel(MODEL, profile, spec.parallel)
    for stage in range(pp):
        for chunk in first:
            assert refitted.stage_forward(stage, chunk) == pytest.approx(
                truth.stage_forward(stage, chunk), rel=1e-6)
    assert sum(refitted.stage_backward(0, c) for c in first) == pytest.approx(
        sum(truth.stage_backward(0, c) for c in first), rel=1e-6)
    assert len(plan_elastic(lengths, refitted, config).chunks()) \
        <= megatron_units(lengths, seq_length)


def run_auto(measured, iterations, fits):
    """Drive ``measured`` through ``iterations`` training iterations under ``auto``, as the
    training loop does (a refit before planning when due, then the iteration, timed or not);
    ``fits(attempt)`` says whether that refit succeeds. Returns the timed iterations and the
    iterations refitted before, both 1-based."""
    timed, refitted = [], []
    for iteration in range(1, iterations + 1):
        if measured.due(AUTO):
            refitted.append(iteration)
            measured.refitted(fits(measured.attempts))
        if measured.timing(AUTO):
            timed.append(iteration)
            measured.record_observations([])
        else:
            measured.ran()
    return timed, refitted


def test_auto_times_two_iterations_after_the_warm_up_and_refits_once():
    timed, refitted = run_auto(Measured(), 20, lambda attempt: True)
    assert timed == [2, 3]
    assert refitted == [4]


def test_auto_tries_again_while_the_refits_are_skipped_then_stops_timing():
    timed, refitted = run_auto(Measured(), 20, lambda attempt: False)
    assert refitted == [4, 6, 8][:AUTO_ATTEMPTS]
    assert timed == [2, 3, 4, 5, 6, 7]
    timed, refitted = run_auto(Measured(), 20, lambda attempt: attempt == 1)
    assert (timed, refitted) == ([2, 3, 4, 5], [4, 6])


@pytest.mark.parametrize("interval", [0, 3])
def test_a_fixed_interval_times_every_iteration_or_none(interval):
    measured = Measured()
    assert measured.timing(interval) == (interval > 0)
    for _ in range(3):
        measured.record_observations([])
    assert measured.due(interval) == (interval > 0)


def test_the_refit_flag_defaults_to_auto_and_takes_an_interval():
    import argparse

    from elastic_pipe.flags import add_arguments, interval_flag

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).elastic_refit_interval == AUTO
    assert parser.parse_args(["--elastic-refit-interval", "3"]).elastic_refit_interval == 3
    assert parser.parse_args(["--elastic-refit-interval", "0"]).elastic_refit_interval == 0
    with pytest.raises(argparse.ArgumentTypeError, match="must be auto or an integer >= 0"):
        interval_flag("-1")


@pytest.mark.parametrize("cuda,deterministic,expected", [
    (True, False, AUTO), (False, False, 0), (True, True, 0)])
def test_auto_refits_only_where_the_run_is_not_reproducible_anyway(monkeypatch, cuda,
                                                                   deterministic, expected):
    """On CUDA without Megatron's --deterministic-mode; a CPU run and a deterministic one keep
    plans that do not depend on measured times. An interval asked for stays."""
    import argparse

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = argparse.Namespace(elastic_refit_interval=AUTO, deterministic_mode=deterministic)
    assert refit_interval(args) == expected
    args.elastic_refit_interval = 3
    assert refit_interval(args) == 3
