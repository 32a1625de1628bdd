"""1F1B as data: golden files of the per-rank order, and its warm-up / steady / cool-down shape.

Regenerate the golden files after an intended change with
``REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_1f1b.py``.
"""
import os
import random

import pytest

from harness import assert_matches_golden
from megatron.plugin.pipeline.ir import Kind, format_schedule
from megatron.plugin.pipeline.passes import add_communication, add_recomputation, align_sends
from megatron.plugin.pipeline.schedule_1f1b import (one_f_one_b, reversed_within_groups,
                                                    window_max)
from megatron.plugin.pipeline.simulator import simulate
from megatron.plugin.pipeline.validation import validate

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_schedules")
#: (pp, micro-batches): m < pp, m = pp, odd values, m = 1, pp = 1.
SWEEP = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 7), (4, 3), (4, 4), (4, 9),
         (5, 12)]


@pytest.mark.parametrize("pp,m", SWEEP)
def test_matches_golden_file(pp, m):
    text = format_schedule(add_communication(one_f_one_b(pp, m), num_stages=pp)) + "\n"
    path = os.path.join(GOLDEN, f"1f1b_pp{pp}_m{m}.txt")
    assert_matches_golden(path, text)


@pytest.mark.parametrize("pp,m", SWEEP)
def test_shape_of_1f1b(pp, m):
    schedule = one_f_one_b(pp, m)
    for rank, actions in enumerate(schedule):
        kinds = [a.kind for a in actions]
        warmup = min(pp - rank - 1, m)
        assert kinds[:warmup] == [Kind.FORWARD] * warmup
        assert [a.unit for a in actions if a.kind is Kind.FORWARD] == list(range(m))
        assert [a.unit for a in actions if a.kind is Kind.BACKWARD] == list(range(m))
        # in flight never exceeds pp - rank
        live = peak = 0
        for a in actions:
            live += 1 if a.kind is Kind.FORWARD else -1
            peak = max(peak, live)
        assert peak == min(pp - rank, m)
    validate(add_communication(schedule, num_stages=pp))


@pytest.mark.parametrize("pp,m", [(0, 1), (2, 0)])
def test_bad_sizes_are_refused(pp, m):
    with pytest.raises(ValueError, match="1F1B needs"):
        one_f_one_b(pp, m)


def test_slices_run_backward_last_slice_first():
    """Units 0-2 are slices of one document: their backwards run 2, 1, 0 on every rank, and
    each rank forwards all three before the backward of slice 2."""
    order = reversed_within_groups([3, 1])
    assert order == [2, 1, 0, 3]
    schedule = one_f_one_b(2, 4, order)
    assert [str(a) for a in schedule[0]] == ["0F0", "0F1", "0F2", "0B2", "0B1", "0F3", "0B0",
                                             "0B3"]
    assert [str(a) for a in schedule[1]] == ["1F0", "1F1", "1F2", "1B2", "1B1", "1B0", "1F3",
                                             "1B3"]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_any_grouping_gives_a_valid_schedule(pp, seed):
    rng = random.Random(seed * 10 + pp)
    groups = [rng.randint(1, 5) for _ in range(rng.randint(1, 6))]
    order = reversed_within_groups(groups)
    schedule = one_f_one_b(pp, sum(groups), order)
    for actions in schedule:
        assert [a.unit for a in actions if a.kind is Kind.BACKWARD] == order
        done = set()
        for a in actions:  # a backward never precedes its own forward
            if a.kind is Kind.FORWARD:
                done.add(a.unit)
            else:
                assert a.unit in done
    validate(add_communication(schedule, num_stages=pp))


def test_bad_backward_orders_are_refused():
    with pytest.raises(ValueError, match="permutation"):
        one_f_one_b(2, 3, [0, 1, 1])
    with pytest.raises(ValueError, match="positive"):
        reversed_within_groups([2, 0])


def test_lookahead_zero_keeps_the_warmup_on_top_of_a_document():
    """Units 0-2 are slices of one document: rank 0 of 3 forwards them and two more units
    (its warm-up) before the backward of slice 2, rank 2 only the three slices."""
    schedule = one_f_one_b(3, 6, reversed_within_groups([3, 1, 1, 1]), lookahead=0)
    assert [str(a) for a in schedule[0]] == ["0F0", "0F1", "0F2", "0F3", "0F4", "0B2", "0B1",
                                             "0B0", "0F5", "0B3", "0B4", "0B5"]
    assert [str(a) for a in schedule[2]] == ["2F0", "2F1", "2F2", "2B2", "2B1", "2B0", "2F3",
                                             "2B3", "2F4", "2B4", "2F5", "2B5"]


def test_lookahead_forwards_a_document_between_the_backwards_before_it():
    """A two-slice document (units 2, 3) after two whole units: with a lookahead of 1 the last
    rank forwards slice 2 before the backward of unit 0 and slice 3 before that of unit 1."""
    order = reversed_within_groups([1, 1, 2])
    assert [str(a) for a in one_f_one_b(2, 4, order, lookahead=0)[1]] == [
        "1F0", "1B0", "1F1", "1B1", "1F2", "1F3", "1B3", "1B2"]
    assert [str(a) for a in one_f_one_b(2, 4, order, lookahead=1)[1]] == [
        "1F0", "1B0", "1F1", "1F2", "1B1", "1F3", "1B3", "1B2"]


@pytest.mark.parametrize("lookahead", [0, 1, 3, 100])
@pytest.mark.parametrize("pp,m", SWEEP)
def test_lookahead_without_slices_is_megatrons_1f1b(pp, m, lookahead):
    assert one_f_one_b(pp, m, lookahead=lookahead) == one_f_one_b(pp, m)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
def test_lookahead_schedules_run_under_rendezvous_transfers(pp, seed):
    """Random documents, lookaheads and recomputation: every rank forwards in unit order and
    backwards in the given order, and with aligned sends the dry run finishes."""
    rng = random.Random(seed * 10 + pp)
    groups = [rng.choice([1, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 7))]
    order = reversed_within_groups(groups)
    lookahead = rng.choice([0, 1, 2, 4, 16])
    schedule = one_f_one_b(pp, sum(groups), order, lookahead)
    for actions in schedule:
        assert [a.unit for a in actions if a.kind is Kind.BACKWARD] == order
        assert [a.unit for a in actions if a.kind is Kind.FORWARD] == list(range(sum(groups)))
    schedule = add_recomputation(schedule, lambda a: (a.unit + a.stage) % 3 == 0)
    validate(align_sends(add_communication(schedule, num_stages=pp)))


def test_window_max_and_a_bad_lookahead():
    rng = random.Random(0)
    for _ in range(100):
        values = [rng.randint(0, 9) for _ in range(rng.randint(0, 12))]
        ahead = rng.randint(0, 13)
        assert window_max(values, ahead) == [max(values[k:k + ahead + 1])
                                             for k in range(len(values))]
    with pytest.raises(ValueError, match="lookahead"):
        one_f_one_b(2, 3, lookahead=-1)


def test_lookahead_fills_the_drain_after_a_document():
    """Unit costs (forward 1, backward 2): a document of 6 slices among whole units drains
    the 4-stage pipeline with the plain rule; keeping the warm-up on top of it (lookahead 0)
    and raising the window before it (lookahead 6) each leave less idle time."""
    order = reversed_within_groups([1, 1, 6, 1, 1, 1, 1, 6, 1, 1])
    times = [simulate(align_sends(add_communication(one_f_one_b(4, 20, order, lookahead),
                                                    num_stages=4)), trace=False).iteration_time
             for lookahead in (None, 0, 6)]
    assert times[0] > times[1] > times[2]
