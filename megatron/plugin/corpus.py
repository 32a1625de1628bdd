"""Writing Megatron ``.bin/.idx`` datasets, and the embedded default corpus.

:func:`write_dataset` is the one writer (used by ``scripts/preprocess_data.py`` and by the
embedded corpus): megatron-core's ``IndexedDatasetBuilder``, one document per item, written
under a temporary prefix and renamed into place (``.bin`` first, ``.idx`` last), so a reader
never sees a half-written dataset.

The embedded corpus (used when no ``--data-path`` is given) is the Python standard library's own
``.py`` files on this machine (``site-packages`` excluded), one token per UTF-8 byte (ids 0-255)
and the end-of-document token 256 (read it with Megatron-LM's
``--tokenizer-type NullTokenizer --vocab-size 257``): about 1,800 documents and 31 MB of real code whose length distribution is
skewed like GitHub's (median 6.5 KB, max 757 KB). Nothing is downloaded. It is built on first use
and cached under the repository's ignored ``data/`` folder.
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
#: The embedded corpus's end-of-document token and vocabulary (bytes, then the marker).
EMBEDDED_EOD = 256
EMBEDDED_VOCAB_SIZE = 257


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
            data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
            yield np.append(data, EMBEDDED_EOD)

    count = write_dataset(prefix, documents(), EMBEDDED_VOCAB_SIZE)
    if count == 0:
        raise FileNotFoundError(
            "no .py files found in the Python standard library to build the embedded corpus; "
            "pass --data-path PREFIX (see scripts/preprocess_data.py)")
    return prefix
