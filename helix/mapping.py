"""The helix mapping of layer parts to pipeline stages (pure; see :mod:`helix.model`)."""
from __future__ import annotations


def boundaries_of(stage: int, num_stages: int, num_layers: int) -> list[int]:
    """Layer boundaries stage ``stage`` computes: ``post(b - 1)`` + ``pre(b)`` for each."""
    return list(range(stage, num_layers + 1, num_stages))


def attention_stage(layer: int, microbatch: int, num_stages: int) -> int:
    """Stage that runs ``attn(layer)`` of ``microbatch``: ``(layer + microbatch + 1) mod p``."""
    return (layer + microbatch + 1) % num_stages


def check_layout(num_layers: int, num_stages: int) -> None:
    """Raise ``ValueError`` unless the helix mapping applies to ``L`` layers on ``p`` stages."""
    if num_layers % num_stages:
        raise ValueError(f"helix places layer l's parts on stage l mod p, so --num-layers "
                         f"({num_layers}) must be a multiple of "
                         f"--pipeline-model-parallel-size ({num_stages})")
