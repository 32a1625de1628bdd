"""Passes alone: communication and recomputation added to compute-only schedules."""
import pytest

from megatron.plugin.pipeline.ir import Kind, parse_schedule
from megatron.plugin.pipeline.passes import add_communication, add_recomputation, align_sends
from megatron.plugin.pipeline.simulator import Deadlock, dry_run
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.validation import validate


def test_add_communication_places_transfers_around_compute():
    schedule = parse_schedule("0: 0F0 0B0\n1: 1F0 1B0\n2: 2F0 2B0")
    assert add_communication(schedule) == parse_schedule(
        "0: 0F0 0SEND_F0>1 0RECV_B0<1 0B0\n"
        "1: 1RECV_F0<0 1F0 1SEND_F0>2 1RECV_B0<2 1B0 1SEND_B0>0\n"
        "2: 2RECV_F0<1 2F0 2B0 2SEND_B0>1")


def test_add_communication_refuses_a_schedule_with_transfers():
    with pytest.raises(ValueError, match="compute actions only"):
        add_communication(add_communication(one_f_one_b(2, 2)))


def test_add_recomputation_before_backward_and_its_receive():
    schedule = add_recomputation(one_f_one_b(2, 2), lambda a: a.unit == 1)
    assert [str(a) for a in schedule[0]] == ["0F0", "0F1", "0B0", "0R1", "0B1"]
    full = add_communication(schedule)
    row = [str(a) for a in full[0]]
    assert row[row.index("0R1") + 1] == "0RECV_B1<1"
    validate(full)


def test_recompute_by_part():
    schedule = parse_schedule("0: 0F0[0:2] 0F0[2:4] 0B0[2:4] 0B0[0:2]")
    out = add_recomputation(schedule, lambda a: a.layer_range() == (0, 2))
    assert [str(a) for a in out[0]] == ["0F0[0:2]", "0F0[2:4]", "0B0[2:4]", "0R0[0:2]",
                                        "0B0[0:2]"]
    assert sum(a.kind is Kind.RECOMPUTE for a in out[0]) == 1


def test_align_sends_moves_a_send_to_where_its_receiver_takes_it():
    """Rank 0 forwards unit 3 before the backwards of a three-slice document; rank 1 takes it
    only after its last of those backwards. Sent right after the forward it deadlocks under
    rendezvous transfers; aligned, it joins the batch with the receive of that backward."""
    schedule = add_communication(parse_schedule(
        "0: 0F0 0F1 0F2 0F3 0B2 0B1 0B0 0B3\n"
        "1: 1F0 1F1 1F2 1B2 1B1 1B0 1F3 1B3"))
    with pytest.raises(Deadlock):
        dry_run(schedule)
    aligned = align_sends(schedule)
    assert [str(a) for a in aligned[0]] == [
        "0F0", "0SEND_F0>1", "0F1", "0SEND_F1>1", "0F2", "0SEND_F2>1", "0F3", "0RECV_B2<1",
        "0B2", "0RECV_B1<1", "0B1", "0SEND_F3>1", "0RECV_B0<1", "0B0", "0RECV_B3<1", "0B3"]
    assert aligned[1] == schedule[1]
    validate(aligned)


@pytest.mark.parametrize("pp, m", [(1, 3), (2, 5), (4, 4), (4, 9)])
def test_align_sends_leaves_1f1b_alone(pp, m):
    schedule = add_communication(one_f_one_b(pp, m), num_stages=pp)
    assert align_sends(schedule) == schedule
