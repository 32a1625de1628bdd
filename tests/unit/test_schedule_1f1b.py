"""1F1B as data: golden files of the per-rank order, and its warm-up / steady / cool-down shape.

Regenerate the golden files after an intended change with
``REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_1f1b.py``.
"""
import os
import random

import pytest

from megatron.plugin.pipeline.ir import Kind, format_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b, reversed_within_groups
from megatron.plugin.pipeline.validation import validate

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_schedules")
#: (pp, micro-batches): m < pp, m = pp, odd values, m = 1, pp = 1.
SWEEP = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 7), (4, 3), (4, 4), (4, 9),
         (5, 12)]


@pytest.mark.parametrize("pp,m", SWEEP)
def test_matches_golden_file(pp, m):
    text = format_schedule(add_communication(one_f_one_b(pp, m), num_stages=pp)) + "\n"
    path = os.path.join(GOLDEN, f"1f1b_pp{pp}_m{m}.txt")
    if os.environ.get("REGENERATE_GOLDEN"):
        with open(path, "w") as f:
            f.write(text)
    with open(path) as f:
        assert f.read() == text


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
