"""Simulator: exact 1F1B figures for uniform costs, memory timeline, traces and Gantt charts."""
import json

import pytest

from megatron.plugin.pipeline.gantt import write_gantt
from megatron.plugin.pipeline.ir import Action, Kind, parse_schedule
from megatron.plugin.pipeline.passes import add_communication, add_recomputation
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.simulator import Deadlock, UniformCosts, simulate
from megatron.plugin.pipeline.chrome_trace import write_chrome_trace


def planned(pp, m):
    return add_communication(one_f_one_b(pp, m), num_stages=pp)


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (2, 2), (2, 5), (3, 7), (4, 3), (4, 4),
                                  (4, 9), (8, 8), (8, 33)])
def test_1f1b_bubble_ratio_is_exact(pp, m):
    result = simulate(planned(pp, m))
    assert result.iteration_time == (m + pp - 1) * 3
    assert result.bubble_ratio == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert result.busy == [3.0 * m] * pp


@pytest.mark.parametrize("pp,m", [(2, 5), (4, 3), (4, 9), (6, 6)])
def test_1f1b_peak_stashed_units(pp, m):
    result = simulate(planned(pp, m))
    assert result.peak_memory == [float(min(pp - i, m)) for i in range(pp)]
    for timeline in result.memory_timeline:
        assert timeline[-1][1] == 0.0  # everything released at the end


def test_costs_change_time_not_order():
    costs = UniformCosts(forward=2.0, backward=3.0, transfer=0.5)
    result = simulate(planned(3, 4), costs)
    # first unit through 3 stages with 2 transfers, then the slowest stage's 1F1B steady state
    # and the backward of the last unit back through 2 stages with 2 transfers
    assert result.iteration_time > (4 + 3 - 1) * 5
    events = [e for e in result.events if e.rank == 2]
    assert [e.name for e in events][:2] == ["2F0", "2B0"]
    assert events[0].start == pytest.approx(2 * 2.0 + 2 * 0.5)


def test_recompute_costs_time_and_adds_memory():
    schedule = add_communication(
        add_recomputation(one_f_one_b(2, 3), lambda a: a.stage == 0), num_stages=2)

    class Costs(UniformCosts):
        def activation_bytes(self, action):
            if action.stage == 0 and action.kind is Kind.FORWARD:
                return 0.25  # only the checkpointed input is stashed
            return 1.0

        def static_bytes(self, rank):
            return 10.0

    result = simulate(schedule, Costs())
    plain = simulate(planned(2, 3))
    assert result.busy[0] == plain.busy[0] + 3 * 1.0
    assert result.iteration_time > plain.iteration_time
    # rank 0 holds 2 checkpointed units, then one re-materialised while its backward runs
    assert result.peak_memory[0] == pytest.approx(10.0 + 0.25 + 0.25 + 1.0)
    assert result.memory_timeline[0][-1][1] == pytest.approx(10.0)


def test_each_link_runs_its_groups_in_posting_order():
    """NCCL runs one communicator's groups one after the other: rank 0's second send, posted
    at 1.0 while the first is in flight until 1.5, starts at 1.5 and arrives at 2.5 (not at
    2.0, as it would with each transfer on its own)."""
    schedule = parse_schedule("0: 0F0 0SEND_F0>1 0F1 0SEND_F1>1\n"
                              "1: 1RECV_F0<0 1RECV_F1<0")
    result = simulate(schedule, UniformCosts(forward=0.5, transfer=1.0), eager_sends=True)
    assert result.iteration_time == pytest.approx(2.5)
    assert result.idle[1] == pytest.approx(2.5)


def test_links_in_opposite_directions_do_not_wait_for_each_other():
    """Two ranks that each send first and receive second, both eagerly: on one communicator per
    pipeline NCCL would queue each receive behind the rank's own send; on links they pass."""
    schedule = parse_schedule("0: 0F0 0SEND_F0>1 0F2 0RECV_F1<1 0F3\n"
                              "1: 1F1 1SEND_F1>0 1F4 1RECV_F0<0 1F5")
    result = simulate(schedule, UniformCosts(transfer=1.0), eager_sends=True)
    assert result.iteration_time == pytest.approx(4.0)  # F, F, the later post + 1, F


def test_deadlock_is_reported_with_blocked_ranks():
    schedule = parse_schedule("0: 0RECV_B0<1 0F0 0SEND_F0>1 0B0\n"
                              "1: 1RECV_F0<0 1F0 1B0 1SEND_B0>0")
    with pytest.raises(Deadlock) as err:
        simulate(schedule)
    assert err.value.blocked == {0: 0, 1: 0}


def test_trace_round_trips_and_gantt_is_drawn(tmp_path):
    result = simulate(planned(3, 4))
    path = tmp_path / "trace.json"
    write_chrome_trace(result.events, str(path), name="1f1b")
    document = json.loads(path.read_text())
    assert {e["ph"] for e in document["traceEvents"]} == {"M", "X"}
    timed = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in document["traceEvents"]
             if e["ph"] == "X"]
    assert timed == [(e.rank, e.name, e.start * 1e6, e.duration * 1e6) for e in result.events]
    png = tmp_path / "gantt.png"
    write_gantt(result.events, str(png), title="1f1b")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_foreign_kinds_take_their_costs():
    schedule = [[Action(0, Kind.FORWARD, 0), Action(0, Kind.ATTN_F, 0, ".l1", 0),
                 Action(0, Kind.ATTN_B, 0, ".l1", 0), Action(0, Kind.BACKWARD, 0)]]
    assert simulate(schedule).iteration_time == 1 + 1 + 2 + 2


def test_transfers_of_one_group_share_their_link():
    """Two sends posted together on one link (one ``batch_isend_irecv`` group) share its
    bandwidth: the second arrives after both have crossed (2.0), not with the first (1.0)."""
    schedule = parse_schedule("0: 0F0 0F1 0SEND_F0>1 0SEND_F1>1\n"
                              "1: 1RECV_F0<0 1RECV_F1<0")
    result = simulate(schedule, UniformCosts(forward=0.5, transfer=1.0))
    assert result.iteration_time == pytest.approx(1.0 + 2 * 1.0)
    # Opposite directions are two links: a send and a receive of one batch still overlap.
    swap = parse_schedule("0: 0F0 0SEND_F0>1 0RECV_B1<1\n"
                          "1: 1F1 1RECV_F0<0 1SEND_B1>0")
    assert simulate(swap, UniformCosts(transfer=1.0)).iteration_time == pytest.approx(2.0)


def test_a_running_action_holds_its_workspace_on_top_of_the_stash():
    """1F1B on 2 stages, 2 micro-batches, a unit stashed per forward and a workspace of 5 while
    any action runs: stage 0 peaks at its first backward (both forwards stashed + 5), stage 1
    (F B F B) at either backward (1 stashed + 5); the timeline holds only the stash."""
    result = simulate(planned(2, 2), UniformCosts(workspace=5.0))
    assert result.peak_memory == [7.0, 6.0]
    assert max(m for _, m in result.memory_timeline[0]) == 2.0


def test_an_eager_receive_that_names_a_part_is_waited_for_at_its_consumer():
    """Rank 1 posts the receive of unit 0's part, then runs unit 1 and waits for the data only
    before unit 0's part: rank 0 sends at 1.0, the data lands at 2.5 while F1 ran (0-1), and
    F0.l1 runs 2.5-3.5. Without a part the receive is waited for at its batch: F1 runs 2.5-3.5,
    F0 3.5-4.5."""
    costs = UniformCosts(transfer=1.5)
    ahead = parse_schedule("0: 0F0.l0 0SEND_F0.l1>1:x\n1: 1RECV_F0.l1<0:x 1F1 1F0.l1")
    result = simulate(ahead, costs, eager_sends=True)
    assert result.iteration_time == pytest.approx(3.5)
    assert result.idle[1] == pytest.approx(1.5)
    blocking = parse_schedule("0: 0F0 0SEND_F0>1\n1: 1RECV_F0<0 1F1 1F0")
    assert simulate(blocking, costs, eager_sends=True).iteration_time == pytest.approx(4.5)


def test_a_recomputation_does_not_wait_for_the_receive_of_its_backward():
    """The consumer of a received gradient is the backward, not the recomputation before it:
    rank 1 recomputes (1.0) while the gradient (sent at 0, 1.5 long) crosses."""
    costs = UniformCosts(transfer=1.5)
    schedule = parse_schedule("0: 0B0.l2 0SEND_B0.l1>1:g\n"
                              "1: 1F0.l1 1RECV_B0.l1<0:g 1R0.l1 1B0.l1")
    result = simulate(schedule, costs, eager_sends=True)
    # B0.l2 runs 0-2 on rank 0 and sends at 2; F0.l1 0-1, R 1-2, the gradient lands at 3.5.
    assert result.iteration_time == pytest.approx(3.5 + 2.0)
    assert result.idle[1] == pytest.approx(1.5)


#: One stage runs units 0, 1, 2 forward, then 2, 1, 0 backward.
SUMS_SCHEDULE = parse_schedule("0: 0F0 0F1 0F2 0B2 0B1 0B0")


class SumsCosts(UniformCosts):
    """Unit 2's backward makes sums of 0.5 for units 0 and 1, unit 1's names unit 0 again."""

    def gradient_sums(self, action):
        return {2: ((0, 0.5), (1, 0.5)), 1: ((0, 0.5),)}.get(action.unit, ())


class LayeredSumsCosts(SumsCosts):
    """The same sums made over 2 layers."""

    def backward_layers(self, action):
        return 2


def test_gradient_sums_join_a_units_stash_at_the_first_backward_that_creates_them():
    """One stage runs units 0, 1, 2 forward, then 2, 1, 0 backward; unit 2's backward creates
    gradient sums of 0.5 for units 0 and 1 (the K/V store's dK/dV of a document's earlier
    slices), unit 1's backward names unit 0 again. The sums are held from unit 2's backward
    until each unit's own backward, once each. Made all at once (one step), the peak is 3
    stashes plus both sums; made layer by layer over 2 layers, the peak is the larger of the 3
    stashes plus the first layer's sums (3.5) and, once the first layer's half of unit 2's
    stash is freed, both sums beside the rest (3 - 0.5 + 1 = 3.5)."""
    result = simulate(SUMS_SCHEDULE, SumsCosts())
    assert result.peak_memory == [pytest.approx(4.0)]
    assert [memory for _, memory in result.memory_timeline[0]] == pytest.approx(
        [0.0, 1.0, 2.0, 3.0, 4.0, 3.0, 1.5, 0.0])
    layered = simulate(SUMS_SCHEDULE, LayeredSumsCosts())
    assert layered.peak_memory == [pytest.approx(3.5)]
    assert layered.memory_timeline == result.memory_timeline


def test_a_backward_frees_its_head_before_its_layers_make_gradient_sums():
    """As above over 2 layers, each unit's stash of 1 holding 0.4 of head (the last stage's
    logits, which the head's backward frees first): unit 2's backward makes its sums on top
    of 3 - 0.4 = 2.6, the first layer's (2.6 + 0.5 = 3.1), then both beside the second
    layer's half of the 0.6 left (2.6 - 0.3 + 1 = 3.3); without the head freed first, 3.5."""
    class HeadCosts(LayeredSumsCosts):
        def head_bytes(self, action):
            return 0.4

    result = simulate(SUMS_SCHEDULE, HeadCosts())
    assert result.peak_memory == [pytest.approx(3.3)]
    assert [memory for _, memory in result.memory_timeline[0]] == pytest.approx(
        [0.0, 1.0, 2.0, 3.0, 4.0, 3.0, 1.5, 0.0])
