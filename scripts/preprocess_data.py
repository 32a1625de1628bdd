"""Build a Megatron ``.bin/.idx`` dataset from jsonl or text files with Megatron-LM's tokenizers.

    python scripts/preprocess_data.py --input docs.jsonl --output-prefix data/my_corpus \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json \\
        --merge-file gpt2-merges.txt --append-eod --workers 8
    python scripts/preprocess_data.py --input a.txt b.txt --output-prefix data/texts \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH --append-eod
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
"""
import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

import numpy as np

from megatron.plugin.corpus import embedded_corpus, write_dataset

_tokenizer = None
_append_eod = False


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
    global _tokenizer, _append_eod
    _tokenizer = build_tokenizer(args)
    _append_eod = args.append_eod


def _encode(text: str) -> np.ndarray:
    """A document's token ids; an empty text is an empty document (skipped when written, no
    end-of-document token: as Megatron-LM's tool)."""
    ids = np.asarray(_tokenizer.tokenize(text) if text else [], dtype=np.int64)
    return np.append(ids, _tokenizer.eod) if _append_eod and len(ids) else ids


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
    group.add_argument("--embedded-corpus", action="store_true",
                       help="build the embedded corpus (Python's standard library) if missing")
    _add_tokenizer_args(p)
    return p


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
    if args.tokenizer_type is None:
        p.error("--tokenizer-type is required (as for Megatron-LM's tools/preprocess_data.py)")
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    missing = [str(path) for path in args.input if not path.is_file()]
    if missing:
        p.error(f"input files not found: {', '.join(missing)}")
    vocab_size = build_tokenizer(args).vocab_size
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
    if args.workers == 1:
        _start_worker(args)
        count = write_dataset(prefix, progress(map(_encode, stream)), vocab_size)
    else:
        with multiprocessing.get_context("spawn").Pool(
                args.workers, initializer=_start_worker, initargs=(args,)) as pool:
            count = write_dataset(prefix,
                                  progress(pool.imap(_encode, stream, chunksize=16)), vocab_size)
    print(f"wrote {count} documents ({state['tokens']} tokens) to {prefix}.bin/.idx in "
          f"{time.perf_counter() - start:.1f} s (train with --data-path {prefix})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
