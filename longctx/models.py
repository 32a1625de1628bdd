"""GPT model shapes the planner prices (presets and explicit shapes).

The presets follow the usual GPT-3-style shapes (feed-forward width 4h, multi-head attention,
the GPT-2 vocabulary padded to a multiple of 128, as Megatron-LM pads it), trained in BF16;
gpt-65b is the largest model of SPPO's evaluation, in the same style.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: Bytes of an element of Megatron's ``--moe-router-dtype`` choices.
ROUTER_DTYPE_BYTES = {"fp32": 4, "fp64": 8}
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
    each keeps a mask of ``dropout_mask_bytes`` per element for its backward."""
    dropout_mask_bytes: int = 1
    """Bytes a dropout mask keeps per element: 1 on CUDA (torch's fused dropout keeps a
    boolean mask), the element size on a CPU (torch keeps the scaled noise in the input's
    dtype)."""
    num_experts: int = 0
    """Routed experts of every layer's mixture-of-experts MLP (Megatron's ``--num-experts``);
    0: a dense MLP of ``ffn_hidden_size``."""
    moe_router_topk: int = 2
    """Experts each token is routed to (``--moe-router-topk``); read with ``num_experts``."""
    moe_ffn_hidden_size: int | None = None
    """Inner width of each expert (``--moe-ffn-hidden-size``); ``None``: ``ffn_hidden_size``,
    as Megatron-LM defaults it."""
    moe_shared_expert_intermediate_size: int | None = None
    """Inner width ``S`` of the shared expert every token passes through beside its routed
    ones (``--moe-shared-expert-intermediate-size``: an MLP of the model's kind); ``None``:
    none."""
    moe_shared_expert_gate: bool = False
    """The shared expert's output scaled by a per-token sigmoid gate (``h x 1`` weights,
    ``--moe-shared-expert-gate``)."""
    moe_router_dtype: str | None = None
    """Element type of the router's logits and probabilities (``--moe-router-dtype``: a key
    of :data:`ROUTER_DTYPE_BYTES`); ``None``: the model's."""
    qk_layernorm: bool = False
    """Norms on the queries and keys before the attention (``--qk-layernorm``): they keep their
    inputs and per-head statistics for the backward."""
    attention_output_gate: bool = False
    """The attention's output scaled by a sigmoid gate that the QKV projection also computes
    (``--attention-output-gate``: ``h`` more rows of it); the product keeps both its
    operands."""
    learned_positions: bool = True
    """Learned absolute position embeddings (Megatron-LM's default
    ``--position-embedding-type``): the embedding keeps the position ids for its backward as
    well as the token ids; ``False`` under RoPE, which adds no embedding."""
    rope: bool = False
    """Rotary position embeddings (``--position-embedding-type rope``), applied to the queries
    and keys in the attention: each rotation keeps its cosines and sines, and the attention
    keeps the rotated queries and keys (new tensors) beside the QKV projection's output."""
    rotary_percent: float = 1.0
    """Share of each head's channels RoPE rotates (``--rotary-percent``)."""
    normalization: str = "LayerNorm"
    """Megatron's ``--normalization``: ``"LayerNorm"`` or ``"RMSNorm"``, for every norm of the
    model (the layers' two, the final one and the Q and K norms)."""
    fused_norms: bool = True
    """The norms run a fused kernel that keeps only its input and FP32 statistics (CUDA:
    torch's fused RMSNorm, Transformer Engine's); ``False``: torch's composite RMSNorm of a
    CPU, which keeps an FP32 copy of its input (the input itself in FP32), its reciprocal
    deviation and the FP32 normalized input. Read only for ``RMSNorm``."""
    num_query_groups: int | None = None
    """Key/value heads of grouped-query attention (``--num-query-groups``); ``None``: one per
    attention head."""

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model {self.name}: dtype must be one of "
                             f"{', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        for field in ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"model {self.name}: {field} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if self.num_experts < 0:
            raise ValueError(f"model {self.name}: num_experts must be >= 0 (0: dense MLP), "
                             f"got {self.num_experts}")
        if self.num_experts and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"model {self.name}: moe_router_topk must be in [1, num_experts="
                             f"{self.num_experts}], got {self.moe_router_topk}")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ValueError(f"model {self.name}: moe_ffn_hidden_size must be >= 1, "
                             f"got {self.moe_ffn_hidden_size}")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (shared < 1 or not self.num_experts):
            raise ValueError(f"model {self.name}: moe_shared_expert_intermediate_size must be "
                             f">= 1 beside num_experts >= 1, got {shared} beside "
                             f"{self.num_experts}")
        if self.moe_router_dtype is not None and self.moe_router_dtype not in ROUTER_DTYPE_BYTES:
            raise ValueError(f"model {self.name}: moe_router_dtype must be one of "
                             f"{', '.join(ROUTER_DTYPE_BYTES)} or None, got "
                             f"{self.moe_router_dtype!r}")
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError(f"model {self.name}: moe_shared_expert_gate gates the shared "
                             f"expert: give moe_shared_expert_intermediate_size too")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"model {self.name}: normalization must be LayerNorm or RMSNorm, "
                             f"got {self.normalization!r}")
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"model {self.name}: rotary_percent must be in (0, 1], "
                             f"got {self.rotary_percent}")
        groups = self.num_query_groups
        if groups is not None and (groups < 1 or self.num_heads % groups):
            raise ValueError(f"model {self.name}: num_query_groups must divide num_heads "
                             f"{self.num_heads}, got {groups}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model {self.name}: hidden_size {self.hidden_size} must be "
                             f"divisible by num_heads {self.num_heads}")

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or activation element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or one per attention head."""
        return self.num_query_groups or self.num_heads

    @property
    def kv_width(self) -> int:
        """Channels of the keys (and of the values): ``groups x h / heads``."""
        return self.query_groups * (self.hidden_size // self.num_heads)

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (0 without RoPE)."""
        if not self.rope:
            return 0
        return int(self.hidden_size // self.num_heads * self.rotary_percent)

    @property
    def mlp_width(self) -> int:
        """Output width of the MLP's first projection: ``2f`` gated, ``f`` otherwise."""
        return 2 * self.ffn_hidden_size if self.gated_mlp else self.ffn_hidden_size

    @property
    def expert_ffn(self) -> int:
        """Inner width ``F`` of one expert (after the gate of a gated MLP)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def expert_width(self) -> int:
        """Output width of an expert's first projection: ``2F`` gated, ``F`` otherwise."""
        return 2 * self.expert_ffn if self.gated_mlp else self.expert_ffn

    @property
    def shared_ffn(self) -> int:
        """Inner width ``S`` of the shared expert (0 without one)."""
        return self.moe_shared_expert_intermediate_size or 0

    @property
    def shared_width(self) -> int:
        """Output width of the shared expert's first projection: ``2S`` gated, ``S``
        otherwise (0 without one)."""
        return 2 * self.shared_ffn if self.gated_mlp else self.shared_ffn

    @property
    def mlp_label(self) -> str:
        """What kind of MLP a layer has, as a measured profile records it: ``"dense"``, or the
        experts' shape (a profile measured on one kind prices no other)."""
        if not self.num_experts:
            return "dense"
        label = (f"{self.num_experts} experts, top {self.moe_router_topk}, "
                 f"width {self.expert_ffn}")
        if self.shared_ffn:
            label += f", shared width {self.shared_ffn}" + (
                " gated" if self.moe_shared_expert_gate else "")
        if self.moe_router_dtype:
            label += f", router {self.moe_router_dtype}"
        return label

    @property
    def router_bytes(self) -> int:
        """Bytes of an element of the router's logits and probabilities."""
        return ROUTER_DTYPE_BYTES[self.moe_router_dtype] if self.moe_router_dtype \
            else self.element_bytes

    def params_per_layer(self) -> int:
        """Weights and biases of one layer: QKV (and the attention output gate's ``h`` rows) +
        output projection, the MLP, two LayerNorms. A mixture-of-experts MLP is the router's ``h x E`` and ``E`` experts of ``h x w + F x h``
        without biases (Megatron's local experts need ``--disable-bias-linear``), and a shared
        expert's ``h x w_s + S x h`` (its gate's ``h``)."""
        h, f, w = self.hidden_size, self.ffn_hidden_size, self.mlp_width
        if self.num_experts:
            mlp = h * self.num_experts + self.num_experts * h * (self.expert_width
                                                                 + self.expert_ffn) \
                + h * (self.shared_width + self.shared_ffn) \
                + (h if self.moe_shared_expert_gate else 0)
        else:
            mlp = h * w + w + h * f + h
        gate = h * h + h if self.attention_output_gate else 0
        return 4 * h * h + 4 * h + gate + mlp + 4 * h


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
