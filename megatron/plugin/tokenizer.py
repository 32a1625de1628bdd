"""The project's tokenizer: bytes in, token ids out (no vocabulary file, no download).

``--tokenizer-type ByteLevel``: token ``b`` is the byte value ``b`` (0-255) and token 256 is the
end-of-document marker that ``scripts/preprocess_data.py --append-eod`` appends (Megatron-LM's
convention). The vocabulary size is 257; the model pads it like Megatron-LM
(``--make-vocab-size-divisible-by`` x TP).
"""
from __future__ import annotations

import numpy as np

TOKENIZER_TYPES = ("ByteLevel",)


class ByteLevelTokenizer:
    """UTF-8 bytes as tokens plus an end-of-document token."""

    eod = 256
    vocab_size = 257

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) != self.eod)
        return data.decode("utf-8", errors="replace")


def build_tokenizer(tokenizer_type: str) -> ByteLevelTokenizer:
    """The tokenizer named by ``--tokenizer-type``; others are refused with the valid names."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type} is not supported (it needs vocabulary files this "
            f"project does not ship); use one of: {', '.join(TOKENIZER_TYPES)}")
    return ByteLevelTokenizer()
