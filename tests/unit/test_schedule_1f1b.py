"""1F1B as data: golden files of the per-rank order, and its warm-up / steady / cool-down shape.

Regenerate the golden files after an intended change with
``REGENERATE_GOLDEN=1 python -m pytest tests/unit/test_schedule_1f1b.py``.
"""
import os

import pytest

from megatron.plugin.pipeline.ir import Kind, format_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
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
