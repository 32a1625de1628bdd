"""Sequence processor invariants over random and odd workloads."""
import random

import pytest

from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile
from longctx.models import get_model
from elastic_pipe.sequence_processor import (ChunkingConfig, balanced_mesh, chunk_balance,
                                             make_chunks, slice_candidates)

COST = CostModel(get_model("gpt-7b"), load_profile("a800"), ParallelConfig(pp=4, sp=8))


def workload(seed, count=60, longest=65536):
    rng = random.Random(seed)
    lengths = [max(1, int(rng.lognormvariate(7, 1.5))) for _ in range(count)]
    lengths = [min(n, longest) for n in lengths]
    lengths[rng.randrange(count)] = longest
    return list(enumerate(lengths))


def test_mesh_is_balanced_and_front_loaded():
    mesh = balanced_mesh(65536, 8, COST)
    sizes = [b - a for a, b in zip(mesh, mesh[1:])]
    assert mesh[0] == 0 and mesh[-1] == 65536
    assert all(x > y for x, y in zip(sizes, sizes[1:])), sizes
    work = [COST.piece_work(a, b - a) for a, b in zip(mesh, mesh[1:])]
    assert max(work) / min(work) < 1.001


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slices", [1, 3, 8])
def test_every_token_in_exactly_one_slice_and_thresholds_hold(seed, slices):
    docs = workload(seed)
    chunking = make_chunks(docs, slices, COST, perturbation=0.1 * (seed % 2))
    covered = {doc: [] for doc, _ in docs}
    position = {}
    for index, chunk in enumerate(chunking.chunks):
        assert sum(piece.is_tail for piece in chunk.pieces) <= 1
        if chunk.kind != "split":
            assert chunk.tokens <= chunking.token_threshold
            assert COST.layer_forward(chunk) <= chunking.time_threshold * (1 + 1e-12)
        for piece in chunk.pieces:
            covered[piece.doc].append((piece.slice, piece.start, piece.end))
            position[(piece.doc, piece.slice)] = index
    for doc, length in docs:
        pieces = sorted(covered[doc])
        assert [s for s, _, _ in pieces] == list(range(len(pieces)))
        assert pieces[0][1] == 0 and pieces[-1][2] == length
        assert all(a[2] == b[1] for a, b in zip(pieces, pieces[1:]))
        # slices run in order, in consecutive chunks
        where = [position[(doc, s)] for s, _, _ in pieces]
        assert where == list(range(where[0], where[0] + len(where)))


def test_split_slices_follow_the_mesh_and_tails_are_packed():
    docs = [(0, 40000), (1, 30000), (2, 100), (3, 200)]
    chunking = make_chunks(docs, 4, COST)
    mesh = chunking.mesh
    heads = [c.pieces[0] for c in chunking.chunks if c.kind == "split"]
    assert all(p.start in mesh and p.end in mesh for p in heads)
    tails = [p for c in chunking.chunks for p in c.pieces if p.is_tail]
    assert {p.doc for p in tails} == {0, 1}


def test_slice_candidates_stop_at_the_finest_split():
    assert slice_candidates(65536, ChunkingConfig(min_slice_tokens=4096)) == \
        [1, 2, 3, 4, 6, 8, 12, 16]
    assert slice_candidates(100, ChunkingConfig(slice_counts=(2, 500))) == [2]


def test_balance_statistics():
    chunking = make_chunks(workload(3, count=200), 8, COST)
    time_rsd, length_rsd = chunk_balance(chunking.chunks, COST)
    assert 0 <= time_rsd < length_rsd
