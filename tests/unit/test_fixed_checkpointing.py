"""Megatron's full recomputation under ``elastic`` and ``seq1f1b``: the flags fix the plan's
checkpointing table (uniform: every layer of each stage; block N: the first min(N, L_p)), no
CP-SAT solve runs, and a table that does not fit the budget stops the planning with what to
change."""
import argparse
import re

import pytest

from elastic_pipe import baselines, checkpointing, scheduler
from elastic_pipe.planning import plan_schedule
from longctx.fixed_checkpointing import FixedCheckpointing, check_args, fixed_checkpointing
from elastic_pipe.scheduler import SchedulerConfig, plan_elastic
from elastic_pipe.sequence_processor import ChunkingConfig
from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import ModelConfig

SMALL = ModelConfig("small", 8, 1024, 8, 4096, 1000)
#: Uneven stages, so that block N differs from uniform on some stages and not on others.
LAYERS = (1, 3, 2, 2)
LENGTHS = [16384, 9000, 3000, 2500, 1200, 800, 700, 300, 200, 90, 40, 17]


def cost_for(memory_gb):
    return CostModel(SMALL, load_profile("a800"),
                     ParallelConfig(pp=4, sp=1, memory_gb=memory_gb, reserved_gb=0.25),
                     layers=LAYERS)


def config_for(fixed):
    return SchedulerConfig(chunking=ChunkingConfig(min_slice_tokens=1024),
                           solver_time_limit=0.02, workers=1, fixed=fixed)


@pytest.mark.parametrize("method,num_layers,expected", [
    ("uniform", 1, (1, 3, 2, 2)), ("uniform", 5, (1, 3, 2, 2)),
    ("block", 1, (1, 1, 1, 1)), ("block", 2, (1, 2, 2, 2)), ("block", 5, (1, 3, 2, 2))])
def test_the_table_is_megatrons_layers(method, num_layers, expected):
    """By hand: uniform recomputes every layer of a stage whatever the group size, block the
    first N layers of each stage (all of a stage with fewer)."""
    table = FixedCheckpointing(method, num_layers).table(LAYERS, 3)
    assert table == tuple((count,) * 3 for count in expected)


@pytest.fixture
def no_solve(monkeypatch):
    def refuse(*args):
        raise AssertionError("CP-SAT ran although the flags fix the table")
    monkeypatch.setattr(checkpointing, "solve", refuse)
    scheduler._memo.clear()


@pytest.mark.parametrize("memory_gb", [2.2, 40.0])
@pytest.mark.parametrize("method,num_layers", [("uniform", 1), ("block", 2)])
def test_elastic_plans_with_the_fixed_table_and_no_solve(no_solve, memory_gb, method,
                                                         num_layers):
    """Whether the budget would make CP-SAT checkpoint (2.2 GB) or nothing (40 GB), every
    pipeline of the plan carries the flags' table, and its memory is that table's."""
    fixed = FixedCheckpointing(method, num_layers)
    cost = cost_for(memory_gb)
    plan = plan_elastic(LENGTHS, cost, config_for(fixed))
    for pipeline in plan.pipelines:
        assert pipeline.ckpt == fixed.table(LAYERS, len(pipeline.chunks))
        assert pipeline.status == "fixed"
    assert not plan.fallbacks
    case = scheduler.pipeline_case(cost, plan.pipelines[0].chunks, plan.pipelines[0].lookahead)
    assert checkpointing.fits(case.problem, plan.pipelines[0].ckpt)


@pytest.mark.parametrize("method,num_layers", [("uniform", 3), ("block", 1)])
def test_seq1f1b_plans_with_the_fixed_table(method, num_layers):
    fixed = FixedCheckpointing(method, num_layers)
    plan = baselines.seq1f1b(LENGTHS, cost_for(40.0), config_for(fixed))
    (pipeline,) = plan.pipelines
    assert pipeline.ckpt == fixed.table(LAYERS, len(pipeline.chunks))
    assert pipeline.status == "fixed"


def test_without_the_flags_the_planner_chooses():
    """The same batch at 2.2 GB: CP-SAT's table, adaptive."""
    scheduler._memo.clear()
    plan = plan_elastic(LENGTHS, cost_for(2.2), config_for(None))
    assert any(len(set(row)) > 1 for row in plan.ckpt_table())
    assert "fixed" not in {p.status for p in plan.pipelines}


def test_a_table_that_does_not_fit_names_the_budget_it_needs(no_solve):
    """Block 1 does not fit 2.2 GB (the planner's own choice does): the error says the fixed
    table's smallest budget, which then plans."""
    fixed = FixedCheckpointing("block", 1)
    with pytest.raises(ValueError, match="--recompute-method block --recompute-num-layers 1 "
                                         "fixes") as error:
        plan_elastic(LENGTHS, cost_for(2.2), config_for(fixed))
    message = str(error.value)
    assert "--elastic-memory-gb" in message and "--recompute-method uniform" in message
    need = float(re.search(r"fits it is ([0-9.]+) GB", message).group(1))
    assert need > 2.2
    assert plan_elastic(LENGTHS, cost_for(need), config_for(fixed)).pipelines


def test_seq1f1b_refuses_a_table_that_does_not_fit():
    cost = cost_for(0.9)
    with pytest.raises(ValueError, match="with the checkpointing table --recompute-granularity "
                                         "full --recompute-method uniform"):
        plan_schedule(tuple(LENGTHS), "seq1f1b", cost.model, cost.hardware, cost.parallel,
                      config_for(FixedCheckpointing("uniform", 1)))


def _args(**flags):
    values = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
                  pipeline_schedule="elastic")
    values.update(flags)
    return argparse.Namespace(**values)


def test_flags_make_the_table_or_none():
    assert fixed_checkpointing(_args()) is None
    assert fixed_checkpointing(_args(recompute_granularity="full", recompute_method="block",
                                     recompute_num_layers=2)) == FixedCheckpointing("block", 2)


@pytest.mark.parametrize("flags,message", [
    (dict(recompute_granularity="selective"),
     "--recompute-granularity selective is not supported by --pipeline-schedule elastic: .*"
     "K and V"),
    (dict(recompute_granularity="full", recompute_num_layers=1),
     "needs a --recompute-method: pass uniform .* or block"),
    (dict(recompute_granularity="full", recompute_method="block"),
     "needs --recompute-num-layers N >= 1: "),
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=0),
     r"needs --recompute-num-layers N >= 1 \(got 0\)"),
])
def test_what_cannot_be_honoured_is_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        check_args(_args(**flags))
