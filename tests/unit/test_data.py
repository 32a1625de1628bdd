"""Data: preprocessing into Megatron .bin/.idx, document-level batches, embedded corpus."""
import argparse
import json

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.plugin import corpus, sources
from megatron.plugin.tokenizer import ByteLevelTokenizer, build_tokenizer
from scripts import preprocess_data


def data_args(**overrides):
    values = dict(tokenizer_type="ByteLevel", mock_data=False, data_path=None, split="8,1,1",
                  global_batch_size=4, seq_length=16, seed=7)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture
def dataset(tmp_path):
    lengths = (3, 40, 1, 0, 7, 12, 25, 5, 9, 30, 2, 18)
    lines = [{"text": chr(ord("a") + i) * n} for i, n in enumerate(lengths)]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    prefix = str(tmp_path / "docs")
    assert preprocess_data.main(["--input", str(source), "--output-prefix", prefix,
                                 "--append-eod"]) == 0
    return prefix


def test_preprocess_writes_megatron_dataset(dataset):
    data = IndexedDataset(dataset)
    tokenizer = ByteLevelTokenizer()
    # The empty text gives a 1-token document (EOD only); nothing is dropped but empty items.
    assert len(data.index.document_indices) - 1 == 12
    first = data.get(0)
    assert list(first) == [ord("a")] * 3 + [tokenizer.eod]
    assert tokenizer.detokenize(first) == "aaa"


def test_batches_are_deterministic_resumable_and_truncated(dataset):
    train = sources.build_document_sources(data_args(data_path=[dataset]))[0]["train"]
    again = sources.build_document_sources(data_args(data_path=[dataset]))[0]["train"]
    seen = []
    for iteration in range(6):
        batch = train.documents(iteration)
        assert len(batch) == 4
        assert all(2 <= len(doc) <= 17 for doc in batch)  # seq_length + 1 tokens at most
        for a, b in zip(batch, again.documents(iteration)):
            np.testing.assert_array_equal(a, b)
        seen.extend(tuple(doc) for doc in batch)
    # The train split is the first 10 documents; 9 have >= 2 tokens (with EOD). One epoch
    # of all 9 before any repeats.
    assert len(train) == 9
    assert len(set(seen[:9])) == 9 and set(seen) == set(seen[:9])
    # The 41-token document is cut to seq_length + 1 tokens.
    assert max(len(doc) for doc in seen) == 17


def test_split_and_blend():
    assert sources.split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert sources.split_ranges("1,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert sources.batch_shares([0.7, 0.3], 10) == [7, 3]
    assert sources.batch_shares([1, 1, 1], 4) in ([2, 1, 1], [1, 2, 1], [1, 1, 2])
    assert sources.parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert sources.parse_data_path(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    with pytest.raises(ValueError, match="pairs"):
        sources.parse_data_path(["0.3", "a", "0.7"])


def test_missing_data_path_names_the_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.bin, .*nope\.idx not found.*"
                                                 r"preprocess_data\.py"):
        sources.build_document_sources(data_args(data_path=[str(tmp_path / "nope")]))


def test_tokens_outside_the_vocabulary_are_refused(tmp_path):
    prefix = str(tmp_path / "wide")
    corpus.write_dataset(prefix, [np.array([1, 2, 300])], vocab_size=70000)
    train = sources.build_document_sources(data_args(data_path=[prefix], split="1,0,0"))[0]
    with pytest.raises(ValueError, match="outside the 257-token vocabulary"):
        train["train"].documents(0)


def test_unknown_tokenizer_is_refused():
    with pytest.raises(ValueError, match="use one of: ByteLevel"):
        build_tokenizer("GPT2BPETokenizer")


def test_mock_data_is_seeded_and_skewed():
    mock = sources.build_document_sources(data_args(mock_data=True, global_batch_size=64,
                                                    seq_length=256))[0]["train"]
    batch = mock.documents(3)
    assert [len(d) for d in batch] == [len(d) for d in mock.documents(3)]
    lengths = np.array([len(d) for d in batch])
    assert lengths.min() >= 2 and lengths.max() <= 257 and np.median(lengths) < lengths.max()


def test_embedded_corpus_is_the_standard_library(tmp_path):
    files = corpus.stdlib_files()
    assert len(files) > 500 and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    prefix = corpus.embedded_corpus(tmp_path / "stdlib")
    data = IndexedDataset(prefix)
    assert len(data.index.document_indices) - 1 == len(files)
    first = data.get(0)
    assert first[-1] == ByteLevelTokenizer.eod
    assert bytes(first[:-1].astype(np.uint8)) == files[0].read_bytes()
