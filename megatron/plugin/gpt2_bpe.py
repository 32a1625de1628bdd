"""Megatron-LM's ``GPT2BPETokenizer`` from local ``--vocab-file`` and ``--merge-file`` alone.

megatron-core (0.17 on) builds it with Hugging Face's ``AutoTokenizer.from_pretrained("gpt2",
vocab_file=..., merges_file=...)``: the files give the vocabulary and the merges, the hub's
``gpt2`` entry only the tokenizer class, and without network access or a cached copy of that
entry the start-up fails. :func:`install` points Megatron's ``GPT2BPETokenizer`` at
``gpt2_tokenizer/``, a directory shipped here that names the class (``GPT2Tokenizer``,
GPT-2's byte-level BPE, with GPT-2's 1024-token model length), so the local files are enough
and nothing is fetched. Everything else is Megatron's own path: its wrapper, its
end-of-document id (the vocabulary's ``<|endoftext|>``), its vocabulary size. Without
``--vocab-file``/``--merge-file`` Megatron still downloads GPT-2's files itself.
"""
from __future__ import annotations

import os

DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_tokenizer")


def install() -> None:
    """Make megatron-core's ``GPT2BPETokenizer`` read its tokenizer class from
    :data:`DIRECTORY` instead of the Hugging Face hub (idempotent)."""
    from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer

    megatron_hf_tokenizer.MEGATRON_CONFIG_MAP["GPT2BPETokenizer"]["tokenizer_name"] = DIRECTORY
