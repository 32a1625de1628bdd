"""The links a schedule declares (``megatron.plugin.pipeline.p2p``): only those are created, and
a schedule whose transfers leave them is refused before anything runs."""
import pytest

from megatron.plugin.pipeline.p2p import check_links, every_link, neighbour_links
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b

from helix.schedule import planned_helix
from sppo_offload.multiplex import multiplexed_schedule
from sppo_offload.pipeline import build_schedule


def test_neighbours_are_each_stage_to_the_next_and_back():
    assert neighbour_links(1) == frozenset()
    assert neighbour_links(3) == {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert len(every_link(8)) == 56 and len(neighbour_links(8)) == 14
    # the most one rank of an 8-stage pipeline sits on: 14 links of every pair, 4 of neighbours
    assert max(sum(r in pair for pair in every_link(8)) for r in range(8)) == 14
    assert max(sum(r in pair for pair in neighbour_links(8)) for r in range(8)) == 4


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_the_1f1b_family_uses_neighbour_links_only(pp):
    check_links(add_communication(one_f_one_b(pp, 2 * pp + 1)), neighbour_links(pp))
    check_links(build_schedule(pp, (pp + 1, 2, 1), lambda action: False), neighbour_links(pp))
    check_links(multiplexed_schedule(pp, pp + 2), neighbour_links(pp))


def test_helix_sends_beyond_neighbours_and_declares_every_link():
    schedule = planned_helix(4, 8, 8)
    check_links(schedule, every_link(4))
    with pytest.raises(ValueError, match=r"travels on link \(\d, \d\), which the schedule did "
                                         r"not declare"):
        check_links(schedule, neighbour_links(4))
