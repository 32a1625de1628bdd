"""Every kind of action has its row in the simulator's and the validator's tables and is run
by the executor or one of its stage extensions (or refused), and a kind from outside ``Kind``
runs as one row in each table (the parser's, the simulator's, the validator's and the
executor's), declared in this file alone."""
import enum
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline import executor, group_cache, ir, simulator, validation
from megatron.plugin.pipeline.chunks import DocumentChunks
from megatron.plugin.pipeline.offloading import Offloading
from megatron.plugin.pipeline.ir import Action, Kind, format_schedule, parse, parse_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import UniformCosts, simulate
from megatron.plugin.pipeline.stage_context import StageContext
from megatron.plugin.pipeline.validation import OrderRule, ScheduleError, validate

#: Kinds the executor runs only through a part program (helix), refusing them otherwise.
PART_PROGRAM_ONLY = {Kind.ATTN_F, Kind.ATTN_B}


def test_every_kind_has_a_simulator_handler():
    assert set(simulator.HANDLERS) == set(Kind)


def test_the_transfer_handler_is_the_transfer_kinds():
    batch = simulator.HANDLERS[Kind.SEND_F]
    assert {k for k, handler in simulator.HANDLERS.items() if handler is batch} == \
        ir.SENDS | ir.RECVS


def test_every_kind_has_validator_rules():
    assert set(validation.ORDER_RULES) == set(Kind)


def _extension_kinds() -> set:
    """The kinds the shipped stage extensions run (document chunks, offloading)."""
    chunks = DocumentChunks(KVStore(), None, lambda unit: 0, lambda unit: ())
    extensions = (chunks, Offloading(offloader=None))
    compute = set(Kind) - ir.SENDS - ir.RECVS
    return {kind for kind in compute for ext in extensions
            if ext.handler(Action(0, kind, 0)) is not None}


def test_every_kind_is_run_or_refused_by_the_executor():
    transfers = ir.SENDS | ir.RECVS  # run as batches, not through HANDLERS
    owned = _extension_kinds()
    assert owned == {Kind.RECOMPUTE, Kind.OFFLOAD, Kind.RELOAD}
    assert set(executor.HANDLERS) | owned | transfers | PART_PROGRAM_ONLY == set(Kind)
    assert not set(executor.HANDLERS) & (owned | transfers | PART_PROGRAM_ONLY)
    with pytest.raises(ValueError, match="simulated only"):
        executor.HANDLERS[Kind.WEIGHT](None, 0, Action(0, Kind.WEIGHT, 0))


class Extra(enum.Enum):
    """A kind of action the IR does not define."""

    NOOP = "NOOP"


def _skip(replay, rank, action):
    return rank.position + 1


@pytest.fixture
def noop(monkeypatch):
    """``NOOP``: one row in the parser's, the simulator's and the validator's tables."""
    monkeypatch.setitem(ir.KIND_OF_TEXT, Extra.NOOP.value, Extra.NOOP)
    monkeypatch.setitem(simulator.HANDLERS, Extra.NOOP, _skip)
    monkeypatch.setitem(validation.ORDER_RULES, Extra.NOOP, ())
    return Extra.NOOP


def _with_noops(schedule):
    """A ``NOOP`` after every compute action (never inside a batch of transfers), numbered
    by its step."""
    out = []
    for actions in schedule:
        row = []
        for a in actions:
            row.append(a)
            if a.is_compute():
                row.append(parse(f"{a.stage}NOOP{len(row)}"))
        out.append(row)
    return out


def test_a_no_op_kind_changes_nothing(noop):
    plain = add_communication(one_f_one_b(3, 5), num_stages=3)
    schedule = _with_noops(plain)
    assert sum(a.kind is noop for actions in schedule for a in actions) == 30
    assert parse_schedule(format_schedule(schedule)) == schedule
    validate(schedule)
    costs = UniformCosts(forward=1.5, backward=2.5, transfer=0.25, workspace=0.5)
    assert simulate(schedule, costs) == simulate(plain, costs)


def test_a_new_kinds_order_is_one_rule(noop, monkeypatch):
    monkeypatch.setitem(validation.ORDER_RULES, noop, (OrderRule(
        lambda a, flow: (Kind.FORWARD, a.stage, a.unit, a.part), "before",
        "{a} comes before its forward"),))
    schedule = add_communication(one_f_one_b(2, 2), num_stages=2)
    schedule[1].insert(0, parse("1NOOP1"))
    with pytest.raises(ScheduleError, match="1NOOP1 comes before its forward") as caught:
        validate(schedule)
    assert caught.value.marks == [(1, 0)]


def test_a_new_kind_runs_through_one_executor_row(noop, monkeypatch, tmp_path):
    """The executor's dispatch loop runs a ``NOOP`` through its row in ``HANDLERS`` and traces
    it like any compute action (one rank, no model work: a stand-in model and Megatron config)."""
    ran = []
    monkeypatch.setitem(executor.HANDLERS, noop,
                        lambda run, index, action: ran.append((index, str(action))))
    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(pipeline_dtype=None, finalize_model_grads_func=None,
                                   no_sync_func=None, grad_sync_func=None,
                                   calculate_per_token_loss=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        ctx = StageContext(forward_step_func=None, data_iterator=None, model=model,
                           num_microbatches=2, shape_of=None, pp_group=dist.group.WORLD,
                           pg_collection=None, is_first_stage=True, is_last_stage=True)
        assert executor.run_schedule([parse("0NOOP0"), parse("0NOOP1")], ctx) == []
    finally:
        group_cache.forget_all()
        dist.destroy_process_group()
    assert ran == [(0, "0NOOP0"), (1, "0NOOP1")]
    assert [event.name for event in ctx.events] == ["0NOOP0", "0NOOP1"]
