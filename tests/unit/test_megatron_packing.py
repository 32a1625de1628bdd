"""Megatron-LM's packing schedulers (``elastic_pipe.megatron_packing``) on cases worked by hand
from Megatron-LM dev's ``DpBalancedScheduler`` and ``next_hdp_group_packing_aware``."""
import pytest

from elastic_pipe.megatron_packing import CPGroup, dp_balanced, dynamic_cp, ranks_needed
from elastic_pipe.workloads import lognormal


def test_dp_balanced_packs_in_batch_order_up_to_cp_times_the_per_rank_length():
    # capacity 2 x 2048 = 4096: [3000] | [3000] | [3000, 1000] | [500]
    assert dp_balanced([3000, 3000, 3000, 1000, 500], cp=2, dp=2, max_seqlen_per_rank=2048) \
        == [[(0,), (1,)], [(2, 3), (4,)]]


def test_dp_balanced_moves_the_last_documents_out_until_dp_divides_the_packs():
    # [0, 1] [2, 3] [4] -> the last pack holding two gives up its last: [0, 1] [2] [4] [3]
    assert dp_balanced([1000] * 5, cp=1, dp=2, max_seqlen_per_rank=2048) \
        == [[(0, 1), (2,)], [(4,), (3,)]]


def test_dp_balanced_refuses_too_few_documents():
    with pytest.raises(ValueError, match="raise the global batch size"):
        dp_balanced([100], cp=1, dp=2, max_seqlen_per_rank=2048)


def test_ranks_needed_is_the_power_of_two_ring():
    assert [ranks_needed(n, 2048) for n in (128, 2048, 2049, 4096, 8192)] == [1, 1, 2, 2, 4]
    assert ranks_needed(128, 2048, min_cp=2) == 2


def test_dynamic_cp_worked_case():
    # 4096 opens a ring of 2; 2048 and the first 1024 open rings of 1 (no larger workload than
    # the first ring's); the second 1024 joins the 1024's ring (2048 tokens a rank); 512 finds
    # no ring with room under 2048 tokens a rank and waits; alone it opens a ring of 1 that
    # doubles until it fills the 4 ranks.
    assert dynamic_cp([4096, 2048, 1024, 1024, 512], ranks=4, max_seqlen_per_rank=2048) == [
        (CPGroup(2, (0,)), CPGroup(1, (1,)), CPGroup(1, (2, 3))), (CPGroup(4, (4,)),)]


def test_dynamic_cp_falls_back_to_one_ring_of_all_ranks():
    # 5 ranks: rings [2, 1] grow to [2, 2]; neither can double within 5 ranks
    assert dynamic_cp([3000, 1000], ranks=5, max_seqlen_per_rank=2048) == [
        (CPGroup(5, (0, 1)),)]


def test_dynamic_cp_places_every_document_once_within_the_per_rank_length():
    lengths = lognormal(64, 3)
    steps = dynamic_cp(lengths, ranks=16, max_seqlen_per_rank=2048)
    placed = sorted(doc for step in steps for group in step for doc in group.documents)
    assert placed == list(range(len(lengths)))
    for step in steps:
        assert sum(group.size for group in step) == 16
        for group in step:
            assert sum(lengths[d] for d in group.documents) / group.size <= 2048


def test_dynamic_cp_refuses_a_document_longer_than_all_ranks_hold():
    with pytest.raises(ValueError, match="raise it or add ranks"):
        dynamic_cp([20000], ranks=4, max_seqlen_per_rank=2048)
