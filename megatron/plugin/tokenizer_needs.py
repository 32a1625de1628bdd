"""What Megatron-LM's tokenizer of a command line needs that this machine lacks, said at start-up.

megatron-core builds the tokenizer inside Megatron-LM's start-up and fails there with messages
that name no flag: ``GPT2BPETokenizer`` (Megatron-LM's default for GPT when
``--tokenizer-type`` is not given) without ``--vocab-file`` or ``--merge-file`` downloads
GPT-2's files with the ``wget`` package into its cache (``wget library should be isntalled``
where the package is missing), and the tokenizers built on Hugging Face's ``AutoTokenizer``
stop at ``name 'AutoTokenizer' is not defined`` without ``transformers``. :func:`refusal` says
which, naming the flag and the ways on. What would work is left alone: files already in
Megatron's download cache, or the ``wget`` package (Megatron's download, needing the network).
"""
from __future__ import annotations

import importlib.util
import os

#: Megatron-LM's ``--tokenizer-type`` for GPT when none is given (its ``pretrain_gpt.py``).
DEFAULT_TOKENIZER = "GPT2BPETokenizer"

#: Megatron-LM's tokenizers built on Hugging Face's ``transformers`` (megatron-core's
#: ``megatron``, ``huggingface``, ``sft`` and ``multimodal`` libraries).
HUGGING_FACE = ("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase",
                "HuggingFaceTokenizer", "SFTTokenizer", "MultimodalTokenizer")

#: The byte-level way on, for training (``scripts/preprocess_data.py`` says its own flag).
BYTE_LEVEL = ("--tokenizer-type NullTokenizer --vocab-size 257 for text written by "
              "scripts/preprocess_data.py --byte-level")

#: What to pass instead: the byte-level reading first (offline, the project's own install).
WAYS_ON = ("pass {byte_level} (one token per UTF-8 byte, as the embedded corpus; no files, no "
           "package), --tokenizer-type GPT2BPETokenizer --vocab-file VOCAB --merge-file MERGES "
           "or HuggingFaceTokenizer --tokenizer-model PATH (with pip install transformers), or "
           "another of Megatron-LM's: {others}")


def refusal(args, byte_level: str = BYTE_LEVEL) -> str | None:
    """What ``args``' tokenizer needs and this machine lacks, with what to pass instead (the
    byte-level reading as ``byte_level`` says it); or ``None``. ``args.tokenizer_type``
    ``None`` is Megatron-LM's default, :data:`DEFAULT_TOKENIZER`."""
    kind = args.tokenizer_type or DEFAULT_TOKENIZER
    named = (f"--tokenizer-type {kind}" if args.tokenizer_type else
             f"no --tokenizer-type (Megatron-LM's default for GPT is {kind})")
    download = _download_needed(kind, args)
    if download is not None:
        return f"{named}: {download}; {_ways_on(byte_level)}"
    if kind in HUGGING_FACE and importlib.util.find_spec("transformers") is None:
        return (f"{named}: megatron-core builds this tokenizer with Hugging Face's "
                f"transformers package, which is not installed; {_ways_on(byte_level)}")
    return None


def _download_needed(kind: str, args) -> str | None:
    """Why Megatron's download of ``kind``'s files cannot run here, or ``None`` (files given,
    cached, or the ``wget`` package present)."""
    from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer as library

    if kind not in library.MEGATRON_CONFIG_MAP:
        return None
    needed = [] if args.vocab_file else [("--vocab-file", "_vocab")]
    if "gpt" in kind.lower() and not args.merge_file:
        needed.append(("--merge-file", "_merges"))
    absent = [flag for flag, suffix in needed
              if not os.path.exists(os.path.join(library.MEGATRON_CACHE, kind + suffix))]
    if not absent or library.HAVE_WGET:
        return None
    return (f"without {' and '.join(absent)} megatron-core downloads the files with the wget "
            f"package, which is not installed (nor are they in its cache, "
            f"{library.MEGATRON_CACHE})")


def _ways_on(byte_level: str) -> str:
    named = {"NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"}
    return WAYS_ON.format(byte_level=byte_level, others=", ".join(
        t for t in _tokenizer_types() if t not in named))


def _tokenizer_types() -> list[str]:
    """The values Megatron-LM's parser takes for ``--tokenizer-type`` (every supported
    megatron-core release)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    action = next(a for a in parser._actions if a.dest == "tokenizer_type")
    return list(action.choices)
