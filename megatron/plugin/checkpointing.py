"""Checkpoints in Megatron's distributed format (``megatron.core.dist_checkpointing``).

Layout as Megatron-LM: ``<dir>/iter_0000010/`` plus ``<dir>/latest_checkpointed_iteration.txt``;
model chunks under ``model`` (``model0``, ``model1``, ... with virtual stages), the optimizer,
the LR scheduler, the iteration, the data position and every rank's RNG state.

Atomicity: all ranks write into ``iter_XXXXXXX.partial``; after a barrier rank 0 renames it and
then replaces the tracker file, so a crash leaves either the previous checkpoint or the new one,
never a half-written one under a name ``--load`` would pick up. A failed save removes its
partial directory.
"""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_sharded_state_dict(model_chunks) -> dict:
    """Sharded state of every model chunk, keyed like Megatron-LM (``model`` / ``model{i}``)."""
    modules = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def load_model_state(model_chunks, loaded: dict) -> None:
    modules = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    keys = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    for module, key in zip(modules, keys):
        module.load_state_dict(loaded[key], strict=True)


def _rng_object() -> ShardedObject:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _set_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _full_state(model_chunks, optimizer, scheduler, iteration, extra, is_loading):
    state = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        model_state = {}
        for value in state.values():
            model_state.update(value)
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    state["extra"] = extra or {}
    state["rng_state"] = _rng_object()
    return state


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer=None, scheduler=None,
                    extra: dict | None = None) -> str:
    """Save atomically; returns the final directory."""
    final = iteration_dir(root, iteration)
    partial = final + ".partial"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    state = _full_state(model_chunks, optimizer, scheduler, iteration, extra, is_loading=False)
    try:
        dist_checkpointing.save(state, partial)
        dist.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return final


def latest_iteration(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def load_checkpoint(root: str, model_chunks, optimizer=None, scheduler=None):
    """Load the latest checkpoint under ``root``; returns ``(iteration, extra)``.

    Raises ``FileNotFoundError`` naming ``--load`` when there is none.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        raise FileNotFoundError(
            f"--load {root}: no {TRACKER} there; point --load at a directory written by --save")
    directory = iteration_dir(root, iteration)
    state = _full_state(model_chunks, optimizer, scheduler, iteration, None, is_loading=True)
    loaded = dist_checkpointing.load(state, directory)
    load_model_state(model_chunks, loaded)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng(loaded["rng_state"])
    return int(loaded["iteration"]), loaded.get("extra", {})


def save_model(directory: str, model_chunks) -> None:
    """Model weights only (used to seed runs with identical parameters in any layout)."""
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model_sharded_state_dict(model_chunks), directory)
    dist.barrier()


def load_model(directory: str, model_chunks) -> None:
    loaded = dist_checkpointing.load(model_sharded_state_dict(model_chunks), directory)
    load_model_state(model_chunks, loaded)
