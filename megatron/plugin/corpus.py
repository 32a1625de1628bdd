"""Writing Megatron ``.bin/.idx`` datasets, the byte-level reading of text, and the embedded
default corpus.

:func:`write_dataset` is the one writer (used by ``scripts/preprocess_data.py`` and by the
embedded corpus): megatron-core's ``IndexedDatasetBuilder``, one document per item, written
under a temporary prefix and renamed into place (``.bin`` first, ``.idx`` last), so a reader
never sees a half-written dataset.

The byte-level reading (:func:`byte_ids`) needs no vocabulary file and no package: a text is
its UTF-8 bytes, one token each (ids 0-255), and :data:`BYTE_EOD` (256) ends a document.
Megatron-LM reads it with ``--tokenizer-type NullTokenizer --vocab-size 257``: from
megatron-core 0.18 on its end-of-document id is ``--vocab-size - 1``, 256 (0.17 adds one id on
top, 257, and reads 256 as an ordinary token). ``scripts/preprocess_data.py --byte-level``
writes a user's text this way.

The embedded corpus (used when no ``--data-path`` is given) is the Python standard library's own
``.py`` files on this machine (``site-packages`` excluded), read byte-level: about 1,800
documents and 31 MB of real code whose length distribution is skewed like GitHub's (median
6.5 KB, max 757 KB). Nothing is downloaded. It is built on first use and cached under the
repository's ignored ``data/`` folder.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


DATA_DIR = Path(__file__).resolve().parents[2] / "data"
EMBEDDED_PREFIX = DATA_DIR / "stdlib_bytelevel_document"
#: The byte-level reading's end-of-document token and vocabulary (bytes, then the marker).
BYTE_EOD = 256
BYTE_VOCAB_SIZE = 257


def token_dtype(vocab_size: int):
    """Megatron-LM's choice: ``uint16`` when the vocabulary fits, else ``int32``."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_dataset(prefix: str | os.PathLike, documents: Iterable[np.ndarray],
                  vocab_size: int) -> int:
    """Write token-id documents as a Megatron indexed dataset; returns the document count.

    Empty documents are skipped (Megatron-LM's preprocessing does the same).
    """
    prefix = str(prefix)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(tmp + ".bin", dtype=token_dtype(vocab_size))
    count = 0
    try:
        for doc in documents:
            if len(doc) == 0:
                continue
            builder.add_item(torch.from_numpy(np.asarray(doc, dtype=np.int64)))
            builder.end_document()
            count += 1
        builder.finalize(tmp + ".idx")
        os.replace(tmp + ".bin", prefix + ".bin")
        os.replace(tmp + ".idx", prefix + ".idx")
    finally:
        for suffix in (".bin", ".idx"):
            if os.path.exists(tmp + suffix):
                os.remove(tmp + suffix)
    return count


def byte_ids(text: str) -> np.ndarray:
    """``text``'s UTF-8 bytes as token ids (0-255)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (a deterministic document order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def embedded_corpus(prefix: str | os.PathLike = EMBEDDED_PREFIX) -> str:
    """Prefix of the embedded corpus, built first if missing."""
    prefix = str(prefix)
    if IndexedDataset.exists(prefix):
        return prefix
    def documents():
        for path in stdlib_files():
            text = path.read_bytes().decode("utf-8", errors="replace")
            yield np.append(byte_ids(text), BYTE_EOD)

    count = write_dataset(prefix, documents(), BYTE_VOCAB_SIZE)
    if count == 0:
        raise FileNotFoundError(
            "no .py files found in the Python standard library to build the embedded corpus; "
            "pass --data-path PREFIX (see scripts/preprocess_data.py)")
    return prefix
