"""Megatron's default loss as per-token weights (megatron/plugin/default_loss.py): documents cut
into units of a schedule's own, each unit's loss divided as Megatron's ``forward_step`` divides
it and the context-parallel shares averaged as Megatron's DDP averages them, give Megatron's
mean over its micro-batches of their token means, at every context-parallel degree the mean over
the ranks of Megatron's shares' token means."""
from argparse import Namespace

import numpy as np
import pytest
import torch

from megatron.plugin import batches as batches_module
from megatron.plugin import default_loss
from megatron.plugin.batches import loss_func, micro_batch_rows, pack_micro_batches
from megatron.plugin.context_loss import megatron_share_weights
from longctx.chunk_rows import chunk_batch
from longctx.chunks import Chunk, Piece

SEQ = 16
#: The end-of-document token of the tests that mask it (``--eod-mask-loss``).
EOD = 0


def _documents(rng, count, vocab=50):
    lengths = rng.integers(2, SEQ + 2, size=count)
    return [rng.integers(0, vocab, size=n).astype(np.int64) for n in lengths]


def _zigzag(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Megatron's ``get_batch_on_this_cp_rank``: chunks ``rank`` and ``2 cp - 1 - rank`` of
    ``2 cp`` equal ones."""
    chunk = seq // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def _megatron_loss(token_losses, masks, micro_batch_size, dp, cp):
    """Megatron's default loss over its packing at ``cp`` context-parallel ranks, averaged over
    the replicas: each micro-batch's rows filled document after document, the mean over the
    ranks of each rank's two chunks' token mean, averaged over the micro-batches."""
    lengths = [len(mask) for mask in masks]
    batches = micro_batch_rows(lengths, SEQ, micro_batch_size, dp)
    total = 0.0
    for rows in batches:
        losses = torch.zeros(micro_batch_size, SEQ, dtype=torch.float64)
        mask = torch.zeros(micro_batch_size, SEQ, dtype=torch.float64)
        for row, members in enumerate(rows):
            start = 0
            for i in members:
                losses[row, start:start + lengths[i]] = torch.from_numpy(token_losses[i])
                mask[row, start:start + lengths[i]] = torch.from_numpy(masks[i])
                start += lengths[i]
        for rank in range(cp):
            part = _zigzag(SEQ, cp, rank)
            tokens = float(mask[:, part].sum())
            total += float((losses[:, part] * mask[:, part]).sum()) / max(tokens, 1) / cp
    return total / len(batches)


def _units(lengths, rng):
    """Documents cut at random points into slices, each slice its own unit, and the whole
    documents packed three to a unit, with a document's last slice when there is one."""
    split, whole = [], []
    for doc, n in enumerate(lengths):
        cuts = sorted(set(rng.integers(1, n, size=2).tolist())) if n > 2 and doc % 2 else []
        bounds = [0, *cuts, n]
        pieces = [Piece(doc, j, bounds[j], bounds[j + 1], j == len(bounds) - 2)
                  for j in range(len(bounds) - 1)]
        (split if len(pieces) > 1 else whole).append(pieces)
    units = [Chunk((piece,)) for pieces in split for piece in pieces[:-1]]
    tails = [pieces[-1] for pieces in split]
    for i in range(0, len(whole), 3):
        group = tuple(pieces[0] for pieces in whole[i:i + 3])
        units.append(Chunk(((tails.pop(),) if tails else ()) + group))
    units += [Chunk((tail,)) for tail in tails]
    return units


@pytest.mark.parametrize("micro_batch_size,dp,cp,eod", [
    (1, 1, 1, False), (2, 1, 1, False), (1, 2, 1, False), (2, 1, 1, True), (2, 2, 2, False),
    (3, 1, 2, False), (1, 1, 2, True), (2, 2, 2, True), (1, 1, 4, False), (2, 1, 4, True)])
def test_weighted_units_give_megatrons_default_loss(micro_batch_size, dp, cp, eod, monkeypatch):
    rng = np.random.default_rng(7 + micro_batch_size + dp + cp + eod)
    documents = _documents(rng, 11, vocab=4 if eod else 50)
    lengths = [len(doc) - 1 for doc in documents]
    token_losses = [rng.random(n) for n in lengths]
    monkeypatch.setattr(batches_module, "eod_mask_token", lambda: EOD if eod else None)
    masks = [np.ones(n) if not eod else (doc[:-1] != EOD).astype(np.float64)
             for doc, n in zip(documents, lengths)]
    monkeypatch.setattr(default_loss.parallel_state, "get_data_parallel_world_size", lambda: dp)
    monkeypatch.setattr(default_loss.parallel_state, "get_context_parallel_world_size",
                        lambda: cp)
    args = Namespace(calculate_per_token_loss=False, seq_length=SEQ,
                     micro_batch_size=micro_batch_size)
    # The documents dealt to the replicas round-robin: the weights do not depend on where a
    # document trains.
    total = 0.0
    for replica in range(dp):
        ids = list(range(replica, len(documents), dp))
        units = _units([lengths[i] for i in ids], rng)
        weights = default_loss.unit_weights(args, documents, len(units))
        for unit in units:
            batch = chunk_batch(unit, documents, ids, multiple=cp, weights=weights)
            if eod:  # as forward_step masks the end-of-document inputs
                batch.loss_mask = batch.loss_mask * (batch.tokens != EOD)
            losses = np.zeros(batch.seq_length)
            start = 0
            for piece in unit.pieces:
                losses[start:start + piece.tokens] = \
                    token_losses[ids[piece.doc]][piece.start:piece.end]
                start += piece.tokens
            for rank in range(cp):  # Ulysses shares; DDP divides by DP x CP
                share = batch.context_share(rank, cp)
                part = slice(rank * batch.seq_length // cp, (rank + 1) * batch.seq_length // cp)
                loss, tokens, _ = loss_func(share.loss_mask, torch.tensor(losses[part]),
                                            share.loss_weights)
                # Megatron's forward_step without --calculate-per-token-loss.
                total += float(loss) / max(int(tokens), 1) / len(units) / (dp * cp)
    expected = _megatron_loss(token_losses, masks, micro_batch_size, dp, cp)
    assert total == pytest.approx(expected, rel=1e-5)
    if cp > 1:  # the degree changes Megatron's value here (padded rows): not CP = 1's
        assert expected != pytest.approx(
            _megatron_loss(token_losses, masks, micro_batch_size, dp, 1), rel=1e-4)


@pytest.mark.parametrize("micro_batch_size,dp", [(1, 1), (2, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("eod", [False, True])
def test_token_weights_are_those_of_megatrons_micro_batches(micro_batch_size, dp, cp, eod):
    """Token by token, the weights equal what Megatron's ``1f1b`` at the same degree gives the
    same batch: the micro-batches Megatron's schedules run here (``pack_micro_batches``), each
    weighed by ``context_loss.megatron_share_weights`` and divided by ``CP x M``."""
    rng = np.random.default_rng(100 * cp + 10 * micro_batch_size + dp + eod)
    for count in (1, 5, 13):
        documents = _documents(rng, count, vocab=4 if eod else 50)
        masks = [np.ones(len(doc) - 1) if not eod else (doc[:-1] != EOD).astype(np.float64)
                 for doc in documents]
        weights = default_loss.token_weights(masks, SEQ, micro_batch_size, dp, cp)
        packed = pack_micro_batches(documents, SEQ, micro_batch_size, dp)
        layout = micro_batch_rows([len(doc) - 1 for doc in documents], SEQ, micro_batch_size,
                                  dp)
        per_replica = len(packed) // dp
        seen = set()
        for batch, rows in zip(packed, layout):
            mask = batch.loss_mask * (batch.tokens != EOD) if eod else batch.loss_mask
            expected = megatron_share_weights(mask, cp) / (cp * per_replica)
            for row, members in enumerate(rows):
                for index, segment in zip(members, batch.segments[row]):
                    np.testing.assert_allclose(
                        weights[index], expected[row, segment.start:segment.stop].numpy(),
                        rtol=1e-12)
                    seen.add(index)
        assert seen == set(range(count))


def test_the_reported_loss_stays_the_plain_sum():
    """The logged ``lm loss`` is the per-token mean under either loss (Megatron's train_step
    divides the reported sums by the reported tokens)."""
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    losses = torch.tensor([[2.0, 4.0, 9.0]])
    loss, tokens, report = loss_func(mask, losses, torch.tensor([[0.5, 0.25, 0.0]]))
    assert int(tokens) == 2
    assert report["lm loss"].tolist() == [6.0, 2.0]
    assert float(loss) == (2.0 * 0.5 + 4.0 * 0.25) * 2


def test_per_token_loss_carries_no_weights():
    args = Namespace(calculate_per_token_loss=True, seq_length=SEQ, micro_batch_size=2)
    assert default_loss.unit_weights(args, [np.arange(5)], 3) is None


def test_each_micro_batch_weighs_one_over_the_micro_batches():
    """On a replica, a micro-batch's tokens weigh 1 / M in all; padding micro-batches none."""
    lengths = [15, 3, 9, 2, 12, 7, 1]
    for micro_batch_size, dp in [(1, 1), (2, 1), (2, 2), (1, 4)]:
        weights = default_loss.document_weights(lengths, SEQ, micro_batch_size, dp)
        batches = micro_batch_rows(lengths, SEQ, micro_batch_size, dp)
        per_replica = len(batches) // dp
        for rows in batches:
            members = [i for row in rows for i in row]
            if members:
                assert sum(weights[i] * lengths[i] for i in members) == \
                    pytest.approx(1 / per_replica)


@pytest.mark.parametrize("cp", [2, 4])
def test_ulysses_shares_weighted_as_megatrons_chunks_give_megatrons_cp_loss(cp):
    """Megatron's default loss under context parallelism (megatron/plugin/context_loss.py):
    rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every row, its loss its sum over its
    token count; DDP averages the ranks. The project's contiguous Ulysses shares, weighted by
    ``megatron_share_weights``, through ``loss_func`` and Megatron's division by each share's
    own count, give that loss; with padding at the rows' ends it differs from the micro-batch's
    token mean (the loss at one rank), which it equals when every share counts alike."""
    from megatron.plugin.batches import MicroBatch

    rng = np.random.default_rng(cp)
    rows, seq = 3, 8 * cp
    losses = torch.tensor(rng.random((rows, seq)))
    mask = torch.ones(rows, seq)
    mask[0, seq - 2 * cp - 1:] = 0  # padding
    mask[2, seq // 3:] = 0
    mask[1, 1] = 0  # an end-of-document input under --eod-mask-loss

    def megatron(mask):
        return sum(float((losses[:, _zigzag(seq, cp, r)] * mask[:, _zigzag(seq, cp, r)]).sum())
                   / max(float(mask[:, _zigzag(seq, cp, r)].sum()), 1) for r in range(cp)) / cp

    def ulysses(mask):
        zeros = torch.zeros(rows, seq, dtype=torch.long)
        batch = MicroBatch(zeros, zeros, mask, zeros, (), None, megatron_share_weights(mask, cp))
        total = 0.0
        for rank in range(cp):
            share = batch.context_share(rank, cp)
            part = slice(rank * seq // cp, (rank + 1) * seq // cp)
            loss, tokens, _ = loss_func(share.loss_mask, losses[:, part].contiguous(),
                                        share.loss_weights)
            total += float(loss) / max(int(tokens), 1) / cp
        return total

    assert ulysses(mask) == pytest.approx(megatron(mask), rel=1e-6)
    token_mean = float((losses * mask).sum() / mask.sum())
    assert megatron(mask) != pytest.approx(token_mean, rel=1e-4)
    full = torch.ones(rows, seq)
    assert ulysses(full) == pytest.approx(float(losses.mean()), rel=1e-6)


def test_megatrons_chunks_must_divide_the_row():
    with pytest.raises(ValueError, match="must be divisible by 4"):
        megatron_share_weights(torch.ones(1, 6), 2)
