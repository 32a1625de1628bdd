"""The CPU benchmarks' document workloads, written as Megatron datasets that a benchmark's
ranks read through ``--data-path`` (their train split, ``--split 100,0,0``) as a training run
reads its data.

Each is a mix of document lengths against the run's ``--seq-length`` S (a document longer than
S trains as pieces of S tokens, :mod:`megatron.plugin.sources`):

* ``short``: log-normal lengths, median S/8, at most S/2 tokens: Megatron packs several
  documents into each of its rows;
* ``long``: every document 3 S tokens: every unit of a batch is a whole row of one document's
  piece, and a schedule that slices it runs attention over the K/V context of earlier slices;
* ``github-like``: the lengths of :func:`elastic_pipe.workloads.github_like` in tokens (most
  documents short, a long tail cut into S-token pieces).

``corpus`` is no dataset: the embedded corpus the benchmarks read by default.

The tokens are a learnable pattern (an arithmetic progression of byte values per document, as
``--mock-data`` writes them) of the byte-level vocabulary (``--vocab-size 257``); only the
lengths matter to the benchmarks.
"""
import os

import numpy as np

#: Documents written per dataset; the ranks' draws wrap around into further epochs.
DOCUMENTS = 512
#: The embedded corpus's name, which writes nothing.
CORPUS = "corpus"


def short(seq_length: int, rng: np.random.Generator) -> np.ndarray:
    lengths = rng.lognormal(np.log(seq_length / 8), 0.8, DOCUMENTS)
    return np.clip(lengths.astype(np.int64), 2, seq_length // 2)


def long(seq_length: int, rng: np.random.Generator) -> np.ndarray:
    return np.full(DOCUMENTS // 8, 3 * seq_length + 1, dtype=np.int64)


def github_like(seq_length: int, rng: np.random.Generator) -> np.ndarray:
    from elastic_pipe.workloads import github_like as mixture

    return np.maximum(np.array(mixture(DOCUMENTS, int(rng.integers(2**31)))), 2)


#: Workload name -> ``lengths(seq_length, rng)``.
LENGTHS = {"short": short, "long": long, "github-like": github_like}
NAMES = (CORPUS, *LENGTHS)


def check_names(names: list[str], known=NAMES) -> None:
    """Refuse a workload name that is not one of ``known``, naming those that are."""
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"unknown workload {', '.join(unknown)}: choose from "
                         f"{', '.join(known)}")


def data_flags(name: str, seq_length: int, directory: str, seed: int = 0) -> list[str]:
    """The data flags of workload ``name`` at ``--seq-length seq_length``: none for the
    embedded corpus, else ``--data-path`` of its dataset, written under ``directory``."""
    if name == CORPUS:
        return []
    from megatron.plugin.corpus import BYTE_VOCAB_SIZE, write_dataset

    rng = np.random.default_rng(seed)
    lengths = LENGTHS[name](seq_length, rng)
    documents = ((rng.integers(0, 256) + rng.integers(1, 8) * np.arange(n)) % 256
                 for n in lengths)
    prefix = os.path.join(directory, f"{name}_{seq_length}_text_document")
    write_dataset(prefix, documents, BYTE_VOCAB_SIZE)
    return ["--data-path", prefix, "--split", "100,0,0"]
