"""Validation refuses broken schedules and shows the grid with the failing step marked."""
import pytest

from megatron.plugin.pipeline.ir import parse_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.validation import ScheduleError, format_grid, validate

GOOD = add_communication(one_f_one_b(2, 2))


def rows(text):
    return parse_schedule(text)


def refused(schedule, match, shape_of=None):
    with pytest.raises(ScheduleError, match=match) as err:
        validate(schedule, shape_of)
    message = str(err.value)
    assert "step | rank 0" in message and "<-- ERROR HERE" in message
    return err.value


def test_good_schedules_pass():
    validate(GOOD)
    for pp, m in [(1, 1), (3, 2), (4, 9)]:
        validate(add_communication(one_f_one_b(pp, m)), shape_of=lambda a: (8, 1, 4))


def test_missing_receive():
    broken = [list(GOOD[0]), [a for a in GOOD[1] if str(a) != "1RECV_F1<0"]]
    error = refused(broken, "has no matching receive")
    assert error.marks == [(0, GOOD[0].index(broken[0][3]))]


def test_swapped_order_is_refused():
    # rank 1 sends the gradient of unit 1 before that of unit 0, rank 0 waits for unit 0's
    # first: on NCCL (order-matched) this pairs the wrong tensors or hangs.
    schedule = rows("0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1 0RECV_B0<1 0B0 0RECV_B1<1 0B1\n"
                    "1: 1RECV_F0<0 1F0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1B0 1SEND_B0>0")
    error = refused(schedule, "receives from rank 1 out of send order")
    assert len(error.marks) == 2


def test_dry_run_finds_a_cycle():
    schedule = rows("0: 0F0 0RECV_B1<1 0SEND_F0>1 0F1 0SEND_F1>1 0B1 0RECV_B0<1 0B0\n"
                    "1: 1RECV_F0<0 1F0 1RECV_F1<0 1F1 1B1 1SEND_B1>0 1B0 1SEND_B0>0")
    error = refused(schedule, "deadlock")
    assert {rank for rank, _ in error.marks} == {0, 1}


def test_backward_before_forward():
    refused(rows("0: 0B0 0F0"), "comes before its forward")


def test_forward_without_backward():
    refused(rows("0: 0F0 0F1 0B0"), "0F1 has no backward")


def test_recompute_after_backward():
    refused(rows("0: 0F0 0B0 0R0"), "has no backward after it")


def test_send_before_its_forward():
    refused(rows("0: 0SEND_F0>1 0F0 0RECV_B0<1 0B0\n1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0"),
            "sends what no earlier forward")


def test_stage_on_two_ranks_and_duplicates():
    refused(rows("0: 0F0 0B0\n1: 0F1 0B1"), "stage 0 has actions on ranks 0 and 1")
    refused(rows("0: 0F0 0F0 0B0"), "appears twice")


def test_shape_mismatch():
    refused(GOOD, "sends shape", shape_of=lambda a: (8,) if a.is_send() else (4,))


def test_grid_lists_every_rank():
    grid = format_grid(GOOD)
    assert grid.splitlines()[0].split("|")[1:] == [" rank 0     ", " rank 1    "]
    assert "0SEND_F0>1" in grid and "1SEND_B1>0" in grid
