"""SPPO subsequence pipeline IR: order, offload/reload placement, validation, dry run."""
import pytest

from megatron.plugin.pipeline.ir import Action, Kind, parse_schedule
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.pipeline.validation import ScheduleError, validate

from sppo_offload.pipeline import add_offload, build_schedule, subsequence_schedule

SHAPES = [(p, n) for p in (2, 3, 4) for n in range(4, 9)]


@pytest.mark.parametrize("pp,n", SHAPES)
def test_schedule_is_valid_and_ordered(pp, n):
    schedule = build_schedule(pp, n, lambda a: a.unit < n - 1)
    simulate(schedule)  # no deadlock (validate's dry run did the same)
    for rank, actions in enumerate(schedule):
        compute = [(a.kind, a.unit) for a in actions if a.is_compute()]
        assert compute == [(Kind.FORWARD, j) for j in range(n)] + \
            [(Kind.BACKWARD, j) for j in range(n - 1, -1, -1)]
        steps = {(a.kind, a.unit): i for i, a in enumerate(actions)}
        for j in range(n - 1):
            offload, reload = steps[(Kind.OFFLOAD, j)], steps[(Kind.RELOAD, j)]
            assert steps[(Kind.FORWARD, j)] < offload < steps[(Kind.FORWARD, j + 1)]
            # issued as the next forward starts: nothing but the offload sits in between
            assert actions[offload + 1] == Action(rank, Kind.FORWARD, j + 1)
            # prefetched one backward ahead
            assert actions[reload + 1] == Action(rank, Kind.BACKWARD, j + 1)
        assert (Kind.OFFLOAD, n - 1) not in steps


def test_fewer_subsequences_than_stages_is_refused():
    with pytest.raises(ValueError, match="use at least 4 subsequences"):
        subsequence_schedule(4, 3)


def test_last_forward_offloads_after_its_send_and_prefetch_zero():
    schedule = add_offload(build_schedule(2, 2), lambda a: True, prefetch=0)
    validate(schedule)
    row = [str(a) for a in schedule[0]]
    assert row.index("0OFFLOAD1") == row.index("0SEND_F1>1") + 1
    assert row[row.index("0RELOAD1") + 1] == "0B1"  # prefetch 0: right before its backward


@pytest.mark.parametrize("text,reason", [
    ("0: 0F0 0RELOAD0 0OFFLOAD0 0B0", "reloads what no earlier offload"),
    ("0: 0F0 0OFFLOAD0 0B0", "has no reload after it"),
    ("0: 0OFFLOAD0 0F0 0RELOAD0 0B0", "offloads what no earlier forward"),
    ("0: 0F0 0OFFLOAD0 0B0 0RELOAD0", "has no backward after it"),
])
def test_validation_refuses_misplaced_memory_actions(text, reason):
    with pytest.raises(ScheduleError, match=reason):
        validate(parse_schedule(text))
