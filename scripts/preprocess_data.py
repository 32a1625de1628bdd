"""Build a Megatron ``.bin/.idx`` dataset from jsonl or text files with Megatron-LM's tokenizers.

    python scripts/preprocess_data.py --input docs.jsonl --output-prefix data/my_corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8
    python scripts/preprocess_data.py --input a.txt b.txt --output-prefix data/texts \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH --append-eod
    python scripts/preprocess_data.py --input a.txt notes.jsonl --output-prefix data/mine \
        --byte-level --append-eod      # offline, no vocabulary: one token per UTF-8 byte
    python scripts/preprocess_data.py --embedded-corpus     # the default training corpus

Flags as Megatron-LM's ``tools/preprocess_data.py``: the tokenizer group is Megatron-LM's own
(``--tokenizer-type``, ``--vocab-file``, ``--merge-file``, ``--tokenizer-model``,
``--vocab-size``, ...), built by its ``build_tokenizer``, so a dataset written here and one
written by Megatron-LM's tool read the same. A ``.jsonl`` input gives one document per line
(the ``--json-keys`` field); any other file is one document. ``--workers`` processes tokenize
in parallel (documents keep their input order); progress goes to stderr every
``--log-interval`` documents. The files are named as Megatron-LM's tool names them,
``PREFIX_{key}_document.bin/.idx`` with ``key`` the ``--json-keys`` field (``text`` by default,
also for plain text files): read the dataset with ``--data-path PREFIX_text_document`` and the
same tokenizer flags.

``--byte-level`` (the project's, in place of the tokenizer flags) writes each document's UTF-8
bytes, one token each, and with ``--append-eod`` the end-of-document token 256
(:func:`megatron.plugin.corpus.byte_ids`, the embedded corpus's reading): no vocabulary file, no
package, no network; train on it with ``--tokenizer-type NullTokenizer --vocab-size 257``.
Megatron's ``NullTokenizer`` itself reads a text as its token ids separated by spaces, and a
document that is not is refused naming ``--byte-level``. A tokenizer whose files or package
this machine lacks is refused before any document is read
(:mod:`megatron.plugin.tokenizer_needs`).
"""
import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from megatron.plugin import tokenizer_needs
from megatron.plugin.corpus import BYTE_EOD, BYTE_VOCAB_SIZE, byte_ids, embedded_corpus, \
    write_dataset

#: The worker's reading of a text into token ids, and the id it appends (``None``: none).
_tokenize = None
_eod = None


def texts(paths, json_key):
    for path in paths:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if json_key not in record:
                        raise SystemExit(f"error: {path}:{number} has no {json_key!r} field; "
                                         "set --json-keys")
                    yield record[json_key]
        else:
            yield path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(args):
    """Megatron-LM's tokenizer from its tokenizer flags (the rest at Megatron's defaults);
    ``GPT2BPETokenizer`` from local ``--vocab-file``/``--merge-file`` needs no network
    (:mod:`megatron.plugin.gpt2_bpe`)."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as megatron_build

    from megatron.plugin import gpt2_bpe
    from megatron.plugin.arguments import megatron_defaults

    gpt2_bpe.install(args)

    full = argparse.Namespace(**{dest: default for dest, (_, default)
                                 in megatron_defaults().items()})
    vars(full).update(vars(args), rank=0)
    return megatron_build(full)


def _start_worker(args) -> None:
    global _tokenize, _eod
    if args.byte_level:
        _tokenize, eod = byte_ids, BYTE_EOD
    else:
        tokenizer = build_tokenizer(args)
        _tokenize, eod = tokenizer.tokenize, tokenizer.eod
        if args.tokenizer_type == "NullTokenizer":
            _tokenize = _token_ids(tokenizer.tokenize)
    _eod = eod if args.append_eod else None


def _token_ids(tokenize):
    """Megatron's ``NullTokenizer`` reading, refusing a text that is not token ids."""
    def read(text: str):
        try:
            return tokenize(text)
        except ValueError:
            raise ValueError(
                f"--tokenizer-type NullTokenizer reads a document as its token ids separated "
                f"by spaces (Megatron-LM's meaning), and this one is text ({text[:40]!r}...): "
                "write text with --byte-level instead of the tokenizer flags (one token per "
                "UTF-8 byte; train with --tokenizer-type NullTokenizer --vocab-size 257)"
            ) from None
    return read


def _encode(text: str) -> np.ndarray:
    """A document's token ids; an empty text is an empty document (skipped when written, no
    end-of-document token: as Megatron-LM's tool)."""
    ids = np.asarray(_tokenize(text) if text else [], dtype=np.int64)
    return np.append(ids, _eod) if _eod is not None and len(ids) else ids


def output_name(prefix: str, json_key: str) -> str:
    """The dataset's prefix as Megatron-LM's tool writes it (one document per item)."""
    return f"{prefix}_{json_key}_document"


def parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import _add_tokenizer_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    group = p.add_argument_group("input and output")
    group.add_argument("--input", nargs="+", type=Path, help="jsonl or text files")
    group.add_argument("--output-prefix",
                       help="writes PREFIX_{key}_document.bin/.idx (key: --json-keys), as "
                            "Megatron-LM's tools/preprocess_data.py")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="jsonl field holding the text (one key)")
    group.add_argument("--append-eod", action="store_true",
                       help="end each document with the tokenizer's end-of-document token")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument("--log-interval", type=int, default=1000,
                       help="report progress every this many documents")
    group.add_argument("--byte-level", action="store_true",
                       help="one token per UTF-8 byte (ids 0-255, end of document 256), in place "
                            "of --tokenizer-type: train with --tokenizer-type NullTokenizer "
                            "--vocab-size 257")
    group.add_argument("--embedded-corpus", action="store_true",
                       help="build the embedded corpus (Python's standard library) if missing")
    _add_tokenizer_args(p)
    return p


def _tokenizer_flags_given(args) -> list[str]:
    """The flags of Megatron-LM's tokenizer group that ``args`` sets to a non-default value."""
    from megatron.training.arguments import _add_tokenizer_args

    group = _add_tokenizer_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    return [action.option_strings[0] for action in group._actions
            if getattr(args, action.dest) != action.default]


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.embedded_corpus:
        print(f"embedded corpus: {embedded_corpus()}")
        return 0
    if not args.input or not args.output_prefix:
        p.error("--input and --output-prefix are required (or --embedded-corpus)")
    if len(args.json_keys) != 1:
        p.error("--json-keys takes one key: the project writes one dataset per call")
    given = _tokenizer_flags_given(args)
    if args.byte_level and given:
        p.error(f"--byte-level is the tokenizer (one token per UTF-8 byte): drop "
                f"{', '.join(given)}, or --byte-level")
    if args.tokenizer_type is None and not args.byte_level:
        p.error("--tokenizer-type is required (as for Megatron-LM's tools/preprocess_data.py), "
                "or --byte-level (one token per UTF-8 byte, offline)")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    missing = [str(path) for path in args.input if not path.is_file()]
    if missing:
        p.error(f"input files not found: {', '.join(missing)}")
    if not args.byte_level and (refusal := tokenizer_needs.refusal(
            args, byte_level="--byte-level in place of the tokenizer flags")):
        p.error(refusal)
    vocab_size = BYTE_VOCAB_SIZE if args.byte_level else build_tokenizer(args).vocab_size
    start = time.perf_counter()
    state = {"documents": 0, "tokens": 0}

    def progress(ids_stream):
        for ids in ids_stream:
            state["documents"] += 1
            state["tokens"] += len(ids)
            if state["documents"] % args.log_interval == 0:
                took = time.perf_counter() - start
                print(f"processed {state['documents']} documents, {state['tokens']} tokens "
                      f"({state['documents'] / took:.1f} documents/s)", file=sys.stderr,
                      flush=True)
            yield ids

    stream = texts(args.input, args.json_keys[0])
    prefix = output_name(args.output_prefix, args.json_keys[0])
    try:
        if args.workers == 1:
            _start_worker(args)
            count = write_dataset(prefix, progress(map(_encode, stream)), vocab_size)
        else:
            with multiprocessing.get_context("spawn").Pool(
                    args.workers, initializer=_start_worker, initargs=(args,)) as pool:
                count = write_dataset(
                    prefix, progress(pool.imap(_encode, stream, chunksize=16)), vocab_size)
    except ValueError as err:
        if args.tokenizer_type != "NullTokenizer":
            raise
        p.error(str(err))
    print(f"wrote {count} documents ({state['tokens']} tokens) to {prefix}.bin/.idx in "
          f"{time.perf_counter() - start:.1f} s (train with --data-path {prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
