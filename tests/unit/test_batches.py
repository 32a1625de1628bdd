"""Megatron's schedules get documents packed best-fit decreasing into padded rows; a batch
knows its positions' extent from the plan."""
import numpy as np
import pytest

from host_syncs import HostSyncCounter
from megatron.plugin.layers.layout import PackedDocuments
from megatron.plugin.batches import micro_batch, pack_micro_batches, pack_row, padding_fraction


def docs(*inputs):
    """Documents of the given input counts (``n + 1`` tokens each), ids telling them apart."""
    return [np.full(n + 1, i + 1) for i, n in enumerate(inputs)]


def rows(batches):
    """The document ids of every row, in row order (padding left out)."""
    return [[int(batch.tokens[r, segment.start]) for segment in row
             if batch.loss_mask[r, segment.start] > 0]
            for batch in batches for r, row in enumerate(batch.segments)]


def test_best_fit_decreasing_pads_nothing_where_first_fit_in_order_pads_a_row():
    # First fit in arrival order: [3, 3, 3] [7] [7] [7], 4 rows of 10 for 30 tokens (25%
    # padding). Longest first, each into the fullest row it fits: [7, 3] three times.
    batches = pack_micro_batches(docs(3, 3, 3, 7, 7, 7), seq_length=10)
    assert rows(batches) == [[4, 1], [5, 2], [6, 3]]
    assert padding_fraction(batches) == 0.0


def test_each_document_goes_to_the_fullest_row_it_fits():
    # 7, 6, 5 open three rows; 3 fits all three and joins the 7; the 2s join the 6.
    batches = pack_micro_batches(docs(5, 3, 6, 2, 7, 2), seq_length=10)
    assert rows(batches) == [[5, 2], [3, 4, 6], [1]]
    assert padding_fraction(batches) == pytest.approx(1 - 25 / 30)


def test_micro_batches_and_data_parallel_rounding_add_padding_only():
    batches = pack_micro_batches(docs(4, 4, 4), seq_length=8, micro_batch_size=2,
                                 multiple_of=2)
    assert len(batches) == 2 and all(batch.tokens.shape == (2, 8) for batch in batches)
    assert sum(batch.num_loss_tokens for batch in batches) == 12
    assert padding_fraction(batches) == pytest.approx(1 - 12 / 32)


def test_a_document_longer_than_the_row_is_refused():
    with pytest.raises(ValueError, match="exceeds --seq-length 8"):
        pack_micro_batches(docs(9), seq_length=8)


def test_the_rotary_length_comes_from_the_plan_not_the_device():
    """A batch knows one past its largest position when it is built (a slice's positions start
    at its context length), keeps it through ``to`` and a context-parallel share, and its layout
    answers the rotary table's length without reading the positions back; a layout built by
    hand without it reads them (a host sync)."""
    doc = np.arange(9, dtype=np.int64)
    batch = micro_batch([pack_row([doc], pad_to=10, slices=[("d", 1, 20)]),
                         pack_row([doc[:4], doc[:3]], pad_to=10)])
    assert batch.positions_end == 28 == int(batch.position_ids.max()) + 1
    assert batch.to("cpu").context_share(1, 2).positions_end == 28
    with HostSyncCounter() as counter:
        assert batch.layout().rotary_length() == 28
    assert not counter.seen
    by_hand = PackedDocuments(position_ids=batch.position_ids)
    with HostSyncCounter() as counter:
        assert by_hand.rotary_length() == 28
    assert counter.seen
