"""ZB1P (ZB-H1) against hand calculations: iteration time, stash counts, IR, validator and
executor."""
import pytest

from megatron.plugin.pipeline.executor import HANDLERS
from megatron.plugin.pipeline.ir import Action, Kind, format_schedule, parse_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.schedule_zb1p import zb1p
from megatron.plugin.pipeline.simulator import UniformCosts, simulate
from megatron.plugin.pipeline.validation import ScheduleError, validate

UNIT = UniformCosts(forward=1.0, backward=1.0, weight=1.0)


def test_shape_for_two_stages():
    """Stage 0 runs each W right after its B; stage 1 one backward behind."""
    assert format_schedule(zb1p(2, 3)) == (
        "0: 0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2\n"
        "1: 1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2")


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 3, 9])
def test_iteration_time_is_the_zb_h1_closed_form(p, extra):
    """F = B = W = 1, free transfers: ZB-H1 takes m (F + B + W) + (p - 1)(F + B - W)
    = 3m + p - 1; 1F1B with the same backward unsplit (B + W = 2) takes
    3m + (p - 1)(F + B + W) = 3m + 3(p - 1)."""
    m = p + extra
    schedule = add_communication(zb1p(p, m), num_stages=p)
    validate(schedule)
    found = simulate(schedule, UNIT, eager_sends=True)
    assert found.iteration_time == 3 * m + (p - 1)
    assert found.busy == [3 * m] * p
    baseline = simulate(add_communication(one_f_one_b(p, m), num_stages=p),
                        UniformCosts(forward=1.0, backward=2.0))
    assert baseline.iteration_time == 3 * m + 3 * (p - 1)
    # Rendezvous sends (the executor's batches) stall a B's gradient until the stage upstream
    # reaches its receive: ZB1P needs its sends posted asynchronously.
    assert simulate(schedule, UNIT).iteration_time >= found.iteration_time


@pytest.mark.parametrize("p,m", [(2, 1), (3, 2), (4, 1), (4, 3)])
def test_fewer_microbatches_than_stages(p, m):
    """The pipeline never fills: the last micro-batch's forward reaches the last stage after
    p - 1 hops, the last stage alternates F and B for the m micro-batches and the last B
    travels p - 1 hops back: (p - 1 + m)(F + B) + W = 2(p - 1 + m) + 1."""
    schedule = add_communication(zb1p(p, m), num_stages=p)
    validate(schedule)
    assert simulate(schedule, UNIT, eager_sends=True).iteration_time == 2 * (p - 1 + m) + 1


@pytest.mark.parametrize("p,m", [(2, 5), (3, 3), (4, 9), (4, 2)])
def test_peak_stash_equals_1f1b(p, m):
    """B frees what W does not read: with nothing left for W each stage holds 1F1B's count
    (p - s micro-batches); with the whole stash kept until W every stage holds 1F1B's peak,
    min(p, m)."""
    zb = simulate(add_communication(zb1p(p, m), num_stages=p), UNIT)
    ref = simulate(add_communication(one_f_one_b(p, m), num_stages=p), UNIT)
    assert zb.peak_memory == ref.peak_memory == [min(p - s, m) for s in range(p)]
    kept = simulate(add_communication(zb1p(p, m), num_stages=p),
                    UniformCosts(backward=1.0, weight=1.0, weight_activation=1.0))
    assert kept.peak_memory == [min(p, m)] * p
    assert all(timeline[-1][1] == 0 for timeline in kept.memory_timeline)


def test_text_form_round_trips():
    schedule = add_communication(zb1p(3, 4), num_stages=3)
    assert parse_schedule(format_schedule(schedule)) == schedule


def test_communication_leaves_w_alone():
    schedule = add_communication(zb1p(2, 2), num_stages=2)
    assert [str(a) for a in schedule[1] if a.kind is Kind.WEIGHT or a.is_communication()] == [
        "1RECV_F0<0", "1SEND_B0>0", "1RECV_F1<0", "1SEND_B1>0", "1W0", "1W1"]


def test_validator_refuses_w_before_its_b():
    schedule = add_communication(zb1p(2, 2), num_stages=2)
    row = schedule[0]
    w, b = row.index(Action(0, Kind.WEIGHT, 0)), row.index(Action(0, Kind.BACKWARD, 0))
    row[w], row[b] = row[b], row[w]
    with pytest.raises(ScheduleError, match="0W0 comes before its backward"):
        validate(schedule)
    missing = add_communication(zb1p(2, 2), num_stages=2)
    missing[0] = [a for a in missing[0] if a != Action(0, Kind.BACKWARD, 1)
                  and not (a.kind is Kind.RECV_B and a.unit == 1)]
    with pytest.raises(ScheduleError):
        validate(missing)


def test_executor_refuses_w():
    with pytest.raises(ValueError, match="simulated only"):
        HANDLERS[Kind.WEIGHT](None, 0, Action(0, Kind.WEIGHT, 0))


def test_refuses_empty_pipelines():
    with pytest.raises(ValueError, match="micro-batches >= 1"):
        zb1p(2, 0)
