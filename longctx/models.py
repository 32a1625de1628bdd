"""GPT model shapes the planner prices (presets and explicit shapes).

The presets follow the usual GPT-3-style shapes (feed-forward width 4h, multi-head attention,
the GPT-2 vocabulary padded to a multiple of 128, as Megatron-LM pads it), trained in BF16;
gpt-65b is the largest model of SPPO's evaluation, in the same style.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes of one element of each training precision (Megatron's ``params_dtype``)."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only GPT model."""

    name: str
    """Label used in reports ("gpt-13b" or "custom")."""
    num_layers: int
    """Transformer layers, split over the pipeline stages."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads; Ulysses sequence parallelism needs them divisible by sp x tp."""
    ffn_hidden_size: int
    """Width of the MLP's inner layer."""
    vocab_size: int
    """Vocabulary (padded); sizes the embedding, the output layer and the logits."""
    dtype: str = "bfloat16"
    """Element type of the weights and activations: a key of :data:`DTYPE_BYTES`."""
    gated_mlp: bool = False
    """SwiGLU-style MLP: the first projection is ``2f`` wide (gate and value), ``f`` after."""
    hidden_dropout: bool = False
    """Dropout after the attention and after the MLP (Megatron's ``--hidden-dropout`` > 0):
    each keeps a one-byte mask per element for its backward."""

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model {self.name}: dtype must be one of "
                             f"{', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name}: {field} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name}: hidden_size {self.hidden_size} must be "
                             f"divisible by num_heads {self.num_heads}")

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def mlp_width(self) -> int:
        """Output width of the MLP's first projection: ``2f`` gated, ``f`` otherwise."""
        return 2 * self.ffn_hidden_size if self.gated_mlp else self.ffn_hidden_size

    def params_per_layer(self) -> int:
        """Weights and biases of one layer: QKV + output projection, the MLP, two LayerNorms."""
        h, f, w = self.hidden_size, self.ffn_hidden_size, self.mlp_width
        return 4 * h * h + 4 * h + h * w + w + h * f + h + 4 * h


PRESETS: dict[str, ModelConfig] = {
    "gpt-7b": ModelConfig("gpt-7b", 32, 4096, 32, 16384, 50304),
    "gpt-13b": ModelConfig("gpt-13b", 40, 5120, 40, 20480, 50304),
    "gpt-30b": ModelConfig("gpt-30b", 48, 7168, 56, 28672, 50304),
    "gpt-65b": ModelConfig("gpt-65b", 80, 8192, 64, 32768, 50304),
}


def get_model(name: str) -> ModelConfig:
    """The preset called ``name``; unknown names raise with the valid ones listed."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(PRESETS))}") from None
