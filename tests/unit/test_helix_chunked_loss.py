"""``helix.chunked_loss``: the same losses and gradients as the unchunked LM head and loss, one
chunk's logits at a time, and the right labels for each chunk of a sequence-parallel shard."""
import pytest
import torch

from helix.chunked_loss import chunked_loss

SEQ, BATCH, HIDDEN, VOCAB = 10, 2, 8, 48


class Head(torch.nn.Module):
    """An LM head and a per-token cross entropy (``[b, n]``) that records its logits' rows."""

    def __init__(self):
        super().__init__()
        self.out = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.rows = []

    def forward(self, hidden, labels):
        logits = self.out(hidden)
        self.rows.append(logits.shape[0])
        return torch.nn.functional.cross_entropy(logits.permute(1, 2, 0), labels,
                                                 reduction="none")


@pytest.mark.parametrize("rows", [1, 3, 4, 10, 16])
def test_matches_unchunked_loss(rows):
    torch.manual_seed(0)
    head = Head()
    hidden = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    weights = torch.rand(BATCH, SEQ)

    reference = head(hidden, labels)
    (reference * weights).sum().backward()
    expected = [head.out.weight.grad.clone(), hidden.grad.clone()]
    head.zero_grad()
    hidden.grad = None

    head.rows.clear()
    losses = chunked_loss(head, hidden, labels, rows)
    chunks = [min(rows, SEQ - i) for i in range(0, SEQ, rows)]
    assert head.rows == chunks
    torch.testing.assert_close(losses, reference)
    (losses * weights).sum().backward()
    assert head.rows == 2 * chunks  # the backward recomputed chunk by chunk
    torch.testing.assert_close(head.out.weight.grad, expected[0])
    torch.testing.assert_close(hidden.grad, expected[1])


def test_keeps_only_the_hidden_state_and_labels():
    head = Head()
    hidden = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    saved = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_loss(head, hidden, labels, 4)
    assert sorted(saved) == sorted([hidden.numel(), labels.numel()])


def test_sequence_parallel_chunks_take_each_shards_positions():
    """With 2 shards of 5 rows, a 2-row chunk covers positions 0-1 and 5-6, then 2-3 and 7-8,
    then 4 and 9; every loss lands at its position."""
    hidden = torch.randn(SEQ // 2, BATCH, HIDDEN, requires_grad=True)
    labels = torch.arange(SEQ).repeat(BATCH, 1)
    seen = []

    def head_loss(piece, piece_labels):
        seen.append(piece_labels[0].tolist())
        assert piece_labels.shape[1] == 2 * piece.shape[0]
        return piece_labels.float() + 0 * piece.sum()

    losses = chunked_loss(head_loss, hidden, labels, 2, shards=2)
    assert seen == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]
    torch.testing.assert_close(losses, labels.float())


def test_bad_input():
    hidden = torch.zeros(4, 1, HIDDEN)
    with pytest.raises(ValueError, match="positive"):
        chunked_loss(Head(), hidden, torch.zeros(1, 4, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="6 labels a row for 4 hidden rows on each of 1"):
        chunked_loss(Head(), hidden, torch.zeros(1, 6, dtype=torch.long), 2)
