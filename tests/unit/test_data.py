"""Data: preprocessing into Megatron .bin/.idx, document-level batches, embedded corpus."""
import argparse
import json
import os

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron.plugin import corpus, cpu_compat, sources
from scripts import preprocess_data

#: Megatron-LM's NullTokenizer: a text is its space-separated token ids. Its end-of-document
#: token is 256 (0.18 and later count it within --vocab-size) or 257 (0.17 adds it on top).
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "257"]
TOKENIZER = preprocess_data.build_tokenizer(preprocess_data.parser().parse_args(NULL))
VOCAB = TOKENIZER.vocab_size


def data_args(**overrides):
    values = dict(mock_data=False, data_path=None, split="8,1,1", global_batch_size=4,
                  seq_length=16, seed=7, mmap_bin_files=True, eval_iters=0)
    values.update(overrides)
    return argparse.Namespace(**values)


LENGTHS = (3, 40, 1, 0, 7, 12, 25, 5, 9, 30, 2, 18)


def preprocess(tmp_path, *flags):
    lines = [{"text": " ".join([str(97 + i)] * n)} for i, n in enumerate(LENGTHS)]
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert preprocess_data.main(["--input", str(source), "--output-prefix",
                                 str(tmp_path / "docs"), "--append-eod", *NULL, *flags]) == 0
    # Named as Megatron-LM's tools/preprocess_data.py names it.
    return str(tmp_path / "docs_text_document")


@pytest.fixture
def dataset(tmp_path):
    return preprocess(tmp_path)


def test_preprocess_writes_megatron_dataset_with_megatron_tokenizer(dataset, tmp_path):
    data = IndexedDataset(dataset)
    eod = TOKENIZER.eod
    # The empty text is dropped (no end-of-document token alone), as by Megatron-LM's tool.
    assert len(data.index.document_indices) - 1 == 11
    assert list(data.get(0)) == [97] * 3 + [eod]
    assert list(data.get(3)) == [101] * 7 + [eod]
    # Parallel tokenizing writes the same dataset, documents in input order.
    (tmp_path / "parallel").mkdir()
    parallel = IndexedDataset(preprocess(tmp_path / "parallel", "--workers", "2",
                                         "--log-interval", "5"))
    for i in range(11):
        np.testing.assert_array_equal(parallel.get(i), data.get(i))


def test_preprocess_refuses_unknown_tokenizers_and_needs_one(tmp_path):
    with pytest.raises(SystemExit):
        preprocess_data.main(["--input", "x", "--output-prefix", "y",
                              "--tokenizer-type", "ByteLevel"])
    (tmp_path / "x.txt").write_text("1 2")
    with pytest.raises(SystemExit):
        preprocess_data.main(["--input", str(tmp_path / "x.txt"), "--output-prefix",
                              str(tmp_path / "y")])


def test_byte_level_writes_the_embedded_corpus_reading_of_a_users_text(tmp_path):
    """--byte-level: each document's UTF-8 bytes, one token each, and 256 after it with
    --append-eod, as the embedded corpus reads the standard library (the same file written
    both ways gives the same ids); Megatron's NullTokenizer with --vocab-size 257 reads 256 as
    its end of document from megatron-core 0.18 on. jsonl lines and text files alike."""
    source = corpus.stdlib_files()[0]
    (tmp_path / "notes.jsonl").write_text(json.dumps({"text": "naïve €"}) + "\n"
                                          + json.dumps({"text": ""}) + "\n")
    prefix = tmp_path / "mine"
    assert preprocess_data.main(["--input", str(source), str(tmp_path / "notes.jsonl"),
                                 "--output-prefix", str(prefix), "--byte-level",
                                 "--append-eod"]) == 0
    mine = IndexedDataset(f"{prefix}_text_document")
    embedded = IndexedDataset(corpus.embedded_corpus(tmp_path / "stdlib"))
    assert len(mine.index.document_indices) - 1 == 2
    np.testing.assert_array_equal(mine.get(0), embedded.get(0))
    assert list(mine.get(1)) == [*"naïve €".encode("utf-8"), 256]
    if not cpu_compat.megatron_core_version().startswith("0.17."):
        assert TOKENIZER.eod == corpus.BYTE_EOD and VOCAB == corpus.BYTE_VOCAB_SIZE


@pytest.mark.parametrize("flags,named", [
    (["--byte-level", "--tokenizer-type", "NullTokenizer"],
     "--byte-level is the tokenizer (one token per UTF-8 byte): drop --tokenizer-type"),
    (["--byte-level", "--vocab-size", "300"], "drop --vocab-size, or --byte-level"),
    (NULL, "--tokenizer-type NullTokenizer reads a document as its token ids separated by "
           "spaces (Megatron-LM's meaning), and this one is text ('def f"),
    ([], "--tokenizer-type is required (as for Megatron-LM's tools/preprocess_data.py), or "
         "--byte-level"),
])
def test_text_without_a_tokenizer_that_reads_it_is_refused_naming_byte_level(
        tmp_path, capsys, flags, named):
    (tmp_path / "code.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(SystemExit) as refused:
        preprocess_data.main(["--input", str(tmp_path / "code.py"), "--output-prefix",
                              str(tmp_path / "out"), *flags])
    assert refused.value.code == 2
    assert named in capsys.readouterr().err


def test_batches_are_deterministic_and_resumable(dataset):
    train = sources.build_document_sources(data_args(data_path=[dataset]), VOCAB)["train"]
    for iteration in (5, 0, 3):  # a fresh source at any iteration: a resumed run
        again = sources.build_document_sources(data_args(data_path=[dataset]), VOCAB)["train"]
        batch = train.documents(iteration)
        assert len(batch) == 4
        assert all(2 <= len(doc) <= 17 for doc in batch)  # seq_length + 1 tokens at most
        for a, b in zip(batch, again.documents(iteration)):
            np.testing.assert_array_equal(a, b)


def test_an_epoch_trains_every_token_of_long_documents_once(dataset):
    """The train split is the first 9 documents (8,1,1 of 11) of 4, 41, 2, 8, 13, 26, 6, 10
    and 31 tokens with their end-of-document token; at --seq-length 16, those of 41, 26 and 31
    tokens are cut into 3, 2 and 2 pieces: 13 units holding 132 labels. Four epochs of 13
    units are 13 batches of 4: every label of every document is trained 4 times, in Megatron's
    micro-batches as in the pieces."""
    from megatron.plugin.batches import pack_micro_batches

    args = data_args(data_path=[dataset])
    train = sources.build_document_sources(args, VOCAB)["train"]
    assert len(train) == 13
    assert train.summary() == (
        "train split: 9 documents, 132 tokens to train an epoch; 3 documents longer than "
        "--seq-length 16 + 1 tokens are cut into 7 pieces, each trained as a document of "
        "its own")
    data = IndexedDataset(dataset)
    documents = [np.asarray(data.get(i), dtype=np.int64) for i in range(9)]
    pairs = {}  # (input, label) pairs of each document: the document's first token names it
    for iteration in range(13):
        batch = train.documents(iteration)
        for unit in batch:
            key = int(unit[0])
            pairs.setdefault(key, []).extend(zip(unit[:-1].tolist(), unit[1:].tolist()))
        trained = sum(float(m.loss_mask.sum()) for m in pack_micro_batches(batch, args.seq_length))
        assert trained == sum(len(unit) - 1 for unit in batch)
    for doc in documents:
        if len(doc) >= 2:
            expected = list(zip(doc[:-1].tolist(), doc[1:].tolist())) * 4
            assert sorted(pairs.pop(int(doc[0]))) == sorted(expected)
    assert not pairs


def test_no_mmap_bin_files_reads_the_same_documents_into_memory(dataset, monkeypatch):
    opened = []
    original = sources.IndexedDataset

    def recording(prefix, mmap):
        opened.append(mmap)
        return original(prefix, mmap=mmap)

    monkeypatch.setattr(sources, "IndexedDataset", recording)
    monkeypatch.setattr(recording, "exists", original.exists, raising=False)
    mapped = sources.build_document_sources(data_args(data_path=[dataset]), VOCAB)["train"]
    read = sources.build_document_sources(data_args(data_path=[dataset], mmap_bin_files=False),
                                          VOCAB)["train"]
    assert opened == [True, False]
    for a, b in zip(mapped.documents(2), read.documents(2)):
        np.testing.assert_array_equal(a, b)


def test_split_and_data_path():
    assert sources.split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert sources.split_ranges("1,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    assert sources.parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert sources.parse_data_path(["a", "b"]) == [(1.0, "a"), (1.0, "b")]
    with pytest.raises(ValueError, match="pairs"):
        sources.parse_data_path(["0.3", "a", "0.7"])


def _datasets(tmp_path, lengths_per_dataset):
    """One dataset per list of document lengths; dataset ``k``'s tokens are all ``k + 1``
    (the end-of-document token aside), so a drawn unit names its dataset."""
    prefixes = []
    for k, lengths in enumerate(lengths_per_dataset):
        prefix = str(tmp_path / f"blend{k}")
        corpus.write_dataset(prefix, [np.full(n, k + 1) for n in lengths], vocab_size=VOCAB)
        prefixes.append(prefix)
    return prefixes


@pytest.mark.parametrize("weights,batch", [([0.05, 0.95], 8), ([1, 1, 1], 4), ([3, 1], 5)])
def test_blended_datasets_give_megatrons_token_shares_over_the_run(tmp_path, weights, batch):
    """Megatron-LM's blend gives sample ``i`` (``--seq-length`` tokens) to the dataset its
    helper names; here each dataset's labels over the run match Megatron's samples of it in
    tokens, to within the bound of :mod:`megatron.plugin.blending` (one unit for the blocks
    the run covers, plus the block it is in), however long its documents are: short documents
    in dataset 0, long ones (cut into pieces) in the others."""
    from megatron.core.datasets import helpers_cpp

    rng = np.random.default_rng(0)
    lengths = [rng.integers(2, 9, 60)] + [rng.integers(10, 60, 40)
                                          for _ in weights[1:]]
    data_path = [str(x) for pair in zip(weights, _datasets(tmp_path, lengths)) for x in pair]
    args = data_args(data_path=data_path, split="1,0,0", global_batch_size=batch)
    train = sources.build_document_sources(args, VOCAB)["train"]
    labels = np.zeros(len(weights), dtype=np.int64)
    for iteration in range(300):
        for unit in train.documents(iteration):
            labels[int(unit[0]) - 1] += len(unit) - 1
    total = int(labels.sum())
    samples = total // args.seq_length
    dataset = np.zeros(samples, dtype=np.int16)
    helpers_cpp.build_blending_indices(dataset, np.zeros(samples, dtype=np.int64),
                                       np.asarray(weights, float) / sum(weights),
                                       len(weights), samples, False)
    megatron = np.bincount(dataset, minlength=len(weights)) * args.seq_length
    assert np.abs(labels - megatron).max() <= (len(weights) + 2) * args.seq_length, \
        (labels, megatron)
    assert (labels > 0).all()
    resumed = sources.build_document_sources(args, VOCAB)["train"]
    for a, b in zip(resumed.documents(250), train.documents(250)):
        np.testing.assert_array_equal(a, b)


def test_missing_data_path_names_the_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.bin, .*nope\.idx not found.*"
                                                 r"preprocess_data\.py"):
        sources.build_document_sources(data_args(data_path=[str(tmp_path / "nope")]), VOCAB)
    # The prefix given to the tool, not the dataset's name: the message names the dataset.
    written = preprocess(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"exist: pass --data-path {written}$"):
        sources.build_document_sources(data_args(data_path=[str(tmp_path / "docs")]), VOCAB)


def test_splits_weighted_zero_are_not_built_and_empty_evaluated_splits_are_refused(dataset):
    built = sources.build_document_sources(data_args(data_path=[dataset], split="9,2,0",
                                                     eval_iters=2), VOCAB)
    assert built["test"] is None and len(built["valid"]) > 0
    with pytest.raises(ValueError, match=r"--split 100,1,0 leaves the valid split without "
                                         r"documents .* --eval-iters 2 evaluates on it"):
        sources.build_document_sources(data_args(data_path=[dataset], split="100,1,0",
                                                 eval_iters=2), VOCAB)
    sources.build_document_sources(data_args(data_path=[dataset], split="100,1,0",
                                             eval_iters=0), VOCAB)


def test_tokens_outside_the_vocabulary_are_refused(tmp_path):
    prefix = str(tmp_path / "wide")
    corpus.write_dataset(prefix, [np.array([1, 2, 300])], vocab_size=70000)
    train = sources.build_document_sources(data_args(data_path=[prefix], split="1,0,0"), VOCAB)
    with pytest.raises(ValueError, match=f"token id 300 is outside the {VOCAB}-token vocabulary"):
        train["train"].documents(0)


def test_mock_data_is_seeded_and_skewed():
    mock = sources.build_document_sources(data_args(mock_data=True, global_batch_size=64,
                                                    seq_length=256), VOCAB)["train"]
    batch = mock.documents(3)
    assert [len(d) for d in batch] == [len(d) for d in mock.documents(3)]
    lengths = np.array([len(d) for d in batch])
    assert lengths.min() >= 2 and lengths.max() <= 257 and np.median(lengths) < lengths.max()
    small = sources.build_document_sources(data_args(mock_data=True, global_batch_size=64,
                                                     seq_length=256), 100)["train"]
    assert max(int(doc.max()) for doc in small.documents(3)) < 100


def test_embedded_corpus_is_the_standard_library(tmp_path):
    files = corpus.stdlib_files()
    assert len(files) > 500 and all(p.suffix == ".py" for p in files)
    assert not any("site-packages" in p.parts for p in files)
    prefix = corpus.embedded_corpus(tmp_path / "stdlib")
    data = IndexedDataset(prefix)
    assert len(data.index.document_indices) - 1 == len(files)
    first = data.get(0)
    assert first[-1] == corpus.BYTE_EOD
    assert bytes(first[:-1].astype(np.uint8)) == files[0].read_bytes()


@pytest.mark.parametrize("damage,message", [
    ("truncate_bin", r"docs_text_document\.bin holds \d+ bytes where "
                     r".*docs_text_document\.idx describes \d+: the \.bin is "
                     r"truncated; write the dataset again with scripts/preprocess_data\.py"),
    ("grow_bin", r"docs_text_document\.bin holds \d+ bytes .* not the one its index was "
                 r"written with"),
    ("truncate_idx", r"docs_text_document\.idx cannot be read .*: it is damaged or not a "
                     r"Megatron-LM index; write the dataset again"),
    ("foreign_idx", r"docs_text_document\.idx cannot be read \(bad header"),
])
def test_damaged_or_mismatched_files_are_refused_naming_the_file(dataset, damage, message):
    path = dataset + (".bin" if damage.endswith("bin") else ".idx")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write({"truncate_bin": data[:-6], "grow_bin": data + data[:8],
                 "truncate_idx": data[:len(data) // 2], "foreign_idx": b"x" * len(data)}[damage])
    with pytest.raises(ValueError, match=message):
        sources.build_document_sources(data_args(data_path=[dataset]), VOCAB)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
    the others take the code points from 256 on, in byte order (the space is ``Ġ``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = iter(range(256, 512))
    return {byte: chr(byte) if byte in printable else chr(next(others)) for byte in range(256)}


#: A tiny GPT-2 vocabulary: the 256 byte symbols (id = byte value), five merges, the
#: end-of-document token.
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("hell", "o")]


def _gpt2_files(directory):
    vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
    for first, second in MERGES:
        vocab[first + second] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            str(directory / "vocab.json"), "--merge-file", str(directory / "merges.txt")]


_OFFLINE = """
import json, sys
from megatron.plugin import launch
from megatron.training import get_tokenizer
from scripts import preprocess_data

tokenizer_flags, text, prefix = json.loads(sys.argv[1])
preprocess_data.main(["--input", text, "--output-prefix", prefix, "--append-eod",
                      *tokenizer_flags])
# Training's start-up: Megatron-LM's parsing, validation and global tokenizer.
launch.initialize([*tokenizer_flags, "--num-layers", "2", "--hidden-size", "32",
                   "--num-attention-heads", "4", "--seq-length", "64",
                   "--max-position-embeddings", "64", "--micro-batch-size", "1",
                   "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3"])
tokenizer = get_tokenizer()
print(json.dumps({"ids": tokenizer.tokenize("hello world"), "eod": tokenizer.eod,
                  "vocab_size": tokenizer.vocab_size}))
launch.shutdown()
"""


def test_gpt2_bpe_needs_only_the_local_vocab_and_merges(tmp_path):
    """Megatron's GPT2BPETokenizer with --vocab-file/--merge-file, offline with no Hugging Face
    cache, in scripts/preprocess_data.py and in training. GPT-2's byte-level BPE by hand:
    "hello world" splits into "hello" and " world"; "hello" merges h+e, l+l, he+ll, hell+o
    into one token (id 260); " world" merges Ġ+w (259), then o r l d are bytes 111 114 108
    100; the end-of-document token is <|endoftext|> (261)."""
    import subprocess
    import sys

    from harness import REPO, free_port, python_path

    pytest.importorskip("transformers", reason="Megatron's GPT2BPETokenizer needs it")
    flags = _gpt2_files(tmp_path)
    (tmp_path / "hello.txt").write_text("hello world")
    prefix = str(tmp_path / "hello")
    written = prefix + "_text_document"
    offline = {"HF_HOME": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "http_proxy": "http://127.0.0.1:9",
               "https_proxy": "http://127.0.0.1:9", "PYTHONPATH": python_path(),
               "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
    result = subprocess.run([sys.executable, "-c", _OFFLINE,
                             json.dumps([flags, str(tmp_path / "hello.txt"), prefix])],
                            cwd=REPO, env={**os.environ, **offline}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = json.loads(result.stdout.strip().splitlines()[-1])
    assert trained == {"ids": [260, 259, 111, 114, 108, 100], "eod": 261, "vocab_size": 262}
    assert list(IndexedDataset(written).get(0)) == [260, 259, 111, 114, 108, 100, 261]
