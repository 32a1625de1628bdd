"""The generator a draw on a device reads, and capture and replay of the random state a
recomputation must see again.

:func:`device_generator` names the generator Megatron's RNG tracker forks on a device; the
project's own random draws (the matrix-product attention's dropout) read it. A recomputed
forward (checkpointed layers, helix boundaries, chunked MLP) has to draw the same dropout masks
as the forward it replaces: :func:`rng_state` captures the host generator, Megatron's
model-parallel RNG tracker and, on CUDA, the device generator; :func:`rng_restored` runs a
block under such a state and then puts back the state it found, so the draws that follow the
recomputation are the ones they would have been without it.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker


def device_generator(device: torch.device) -> torch.Generator:
    """The default generator of ``device``: the one a draw on its tensors reads, and the one
    Megatron's RNG tracker forks there.

    On CUDA, ``CudaRNGStatesTracker.fork`` (megatron-core's ``tensor_parallel/random.py``)
    swaps the state of the current GPU's generator for the named one (``model-parallel-rng``:
    ``seed + 2718 + tp_rank``) and leaves the CPU generator alone (it warns when the CPU state
    changed inside the fork); on the CPU the compat layer's twin of the fork swaps the CPU
    generator's. A draw from this generator inside the fork therefore takes each
    tensor-parallel rank's own stream, as Megatron's dropout does; a draw from the CPU generator
    on CUDA would read a stream the fork does not touch, the same on every tensor-parallel
    rank."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index]
    if device.type == "cpu":
        return torch.default_generator
    raise ValueError(f"no RNG tracker forks the generator of {device.type} tensors: "
                     f"train on CUDA or on the CPU")


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
