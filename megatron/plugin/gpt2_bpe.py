"""Megatron-LM's ``GPT2BPETokenizer`` from local ``--vocab-file`` and ``--merge-file`` alone.

megatron-core (0.17 on) builds it with Hugging Face's ``AutoTokenizer.from_pretrained("gpt2",
vocab_file=..., merges_file=...)``: the hub's ``gpt2`` entry gives the tokenizer class, and
without network access or a cached copy of that entry the start-up fails. (0.17 also hands the
vocabulary file over as the merges, under a keyword Hugging Face does not read, so there the
merges came from the hub's copy of GPT-2's, whatever ``--merge-file`` said.)

:func:`install` writes a tokenizer directory in place of the hub's entry: GPT-2's tokenizer
class (``GPT2Tokenizer``, byte-level BPE, GPT-2's 1024-token model length) with copies of the
two files under the names Hugging Face looks for (``vocab.json``, ``merges.txt``), and points
Megatron's ``GPT2BPETokenizer`` at it. The given files are then the vocabulary and the merges
on every supported release, nothing is fetched, and the ids are those of GPT-2's BPE over
them: with GPT-2's own files, the ids Megatron-LM gives. Everything else is Megatron's own
path: its wrapper, its end-of-document id (the vocabulary's ``<|endoftext|>``), its vocabulary
size. Without both files Megatron's own behaviour is left alone (it downloads GPT-2's).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

#: The directory of the latest :func:`install` (removed at exit).
_directory: tempfile.TemporaryDirectory | None = None


def install(args) -> None:
    """Make megatron-core's ``GPT2BPETokenizer`` read ``args.vocab_file`` and
    ``args.merge_file`` from a local tokenizer directory instead of the Hugging Face hub;
    nothing without both, or with another ``--tokenizer-type`` (``None``, not given, is
    ``pretrain_gpt_elastic.py``'s default: GPT-2's)."""
    global _directory
    vocab_file, merge_file = args.vocab_file, args.merge_file
    if args.tokenizer_type not in (None, "GPT2BPETokenizer") or not vocab_file \
            or not merge_file:
        return
    from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer

    for path, flag in ((vocab_file, "--vocab-file"), (merge_file, "--merge-file")):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag} {path}: no such file")
    directory = tempfile.TemporaryDirectory(prefix="gpt2_bpe_")
    shutil.copyfile(vocab_file, os.path.join(directory.name, "vocab.json"))
    shutil.copyfile(merge_file, os.path.join(directory.name, "merges.txt"))
    with open(os.path.join(directory.name, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024}, f)
    megatron_hf_tokenizer.MEGATRON_CONFIG_MAP["GPT2BPETokenizer"]["tokenizer_name"] = \
        directory.name
    _directory = directory
