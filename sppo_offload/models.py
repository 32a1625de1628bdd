"""Model shapes for SPPO planning: the elastic planner's presets plus GPT-65B.

GPT-65B follows the presets' GPT-3-style shape (80 layers, width 8192, 64 heads, MLP width
4h, the padded GPT-2 vocabulary). It lives here rather than in ``longctx.models`` so
that the elastic planner's list of names (and the messages that quote it) stays as it is.
"""
from __future__ import annotations

from longctx.models import PRESETS, ModelConfig

MODELS: dict[str, ModelConfig] = {
    **PRESETS,
    "gpt-65b": ModelConfig("gpt-65b", 80, 8192, 64, 32768, 50304),
}


def get_model(name: str) -> ModelConfig:
    """The shape called ``name``; unknown names raise with the valid ones listed."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(sorted(MODELS))}") from None
