"""Capture and replay of the random state a recomputation must see again.

A recomputed forward (checkpointed layers, helix boundaries, chunked MLP) has to draw the same
dropout masks as the forward it replaces: :func:`rng_state` captures the host generator,
Megatron's model-parallel RNG tracker and, on CUDA, the device generator; :func:`rng_restored`
runs a block under such a state and then puts back the state it found, so the draws that
follow the recomputation are the ones they would have been without it.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def rng_restored(state: dict):
    """Run the block from ``state``; afterwards continue from the state found on entry."""
    saved = rng_state()
    _set(state)
    try:
        yield
    finally:
        _set(saved)
