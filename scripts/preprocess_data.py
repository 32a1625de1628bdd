"""Build a Megatron ``.bin/.idx`` dataset from jsonl or text files (Megatron-LM's flag names).

    python scripts/preprocess_data.py --input docs.jsonl --output-prefix data/my_corpus \
        --tokenizer-type ByteLevel --append-eod [--json-keys text]
    python scripts/preprocess_data.py --input a.txt b.txt --output-prefix data/texts
    python scripts/preprocess_data.py --embedded-corpus     # the default training corpus

A ``.jsonl`` input gives one document per line (the ``--json-keys`` field); any other file is
one document. The dataset is read with ``--data-path data/my_corpus``.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from megatron.plugin.corpus import embedded_corpus, write_dataset
from megatron.plugin.tokenizer import TOKENIZER_TYPES, build_tokenizer


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", type=Path, help="jsonl or text files")
    parser.add_argument("--output-prefix", help="dataset prefix (writes PREFIX.bin, PREFIX.idx)")
    parser.add_argument("--json-keys", default="text", help="jsonl field holding the text")
    parser.add_argument("--tokenizer-type", default="ByteLevel", choices=TOKENIZER_TYPES)
    parser.add_argument("--append-eod", action="store_true",
                        help="end each document with the end-of-document token")
    parser.add_argument("--embedded-corpus", action="store_true",
                        help="build the embedded corpus (Python's standard library) if missing")
    args = parser.parse_args(argv)
    if args.embedded_corpus:
        print(f"embedded corpus: {embedded_corpus()}")
        return 0
    if not args.input or not args.output_prefix:
        parser.error("--input and --output-prefix are required (or --embedded-corpus)")
    missing = [str(p) for p in args.input if not p.is_file()]
    if missing:
        parser.error(f"input files not found: {', '.join(missing)}")
    tokenizer = build_tokenizer(args.tokenizer_type)

    def documents():
        for text in texts(args.input, args.json_keys):
            ids = tokenizer.tokenize(text)
            yield np.append(ids, tokenizer.eod) if args.append_eod else ids

    count = write_dataset(args.output_prefix, documents(), tokenizer.vocab_size)
    print(f"wrote {count} documents to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
