"""A checkpoint that cannot be loaded or written, explained in one message naming it and what
to do.

Megatron-LM's ``load_checkpoint`` fails on a damaged checkpoint (a shard file missing or
unreadable) and on one saved for another model shape or vocabulary with a traceback per rank,
whose cause sits in ``torch.distributed.checkpoint``'s ``CheckpointException`` (the failures
per rank) or Megatron's ``CheckpointingException``. :func:`explained_load` wraps it: the failure
becomes a ``ValueError`` (the training script prints it and exits 2) naming ``--load``, the
iteration and its directory, the first rank's cause, and the way on: an earlier checkpoint
with Megatron-LM's ``--ckpt-step``, or the flags the checkpoint was saved with.

A save that fails (a full disk, a quota, a file-size limit) leaves its ``iter_*`` directory
incomplete and ``latest_checkpointed_iteration.txt`` at the last complete checkpoint (Megatron
updates it after the write). :func:`explained_save` says so: the failure, the free space left
on that file system, and that the same command resumes from the last complete checkpoint.
"""
from __future__ import annotations

import functools
import os
import shutil

from megatron.core.dist_checkpointing.core import CheckpointingException
from torch.distributed.checkpoint.api import CheckpointException

#: What a damaged or mismatched checkpoint raises while it is read or written (an unreadable
#: or unwritable file reaches Megatron inside ``CheckpointException``). Not a ``RuntimeError``: a
#: rank whose own part loaded sees its peer's exit as one, and is not the rank to read.
FAILURES = (CheckpointException, CheckpointingException, OSError)


def cause(error: BaseException) -> str:
    """The underlying failure: ``torch.distributed.checkpoint`` gathers the failures of the
    ranks of its group into ``failures`` (``{group rank: (exception, traceback)}``) and says
    only which group ranks failed."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        inner = first[0] if isinstance(first, tuple) else first
        return f"{type(inner).__name__}: {inner}"
    return f"{type(error).__name__}: {error}"


def iteration_loaded(load: str, ckpt_step: int | None) -> str:
    if ckpt_step:
        return str(ckpt_step)
    try:
        with open(os.path.join(load, "latest_checkpointed_iteration.txt")) as f:
            return f.read().strip()
    except OSError:
        return "?"


def message(load: str, ckpt_step: int | None, error: BaseException) -> str:
    iteration = iteration_loaded(load, ckpt_step)
    where = (os.path.join(load, f"iter_{int(iteration):07d}") if iteration.isdigit()
             else load)
    return (f"--load {load}: the checkpoint of iteration {iteration} ({where}) cannot be "
            f"loaded ({cause(error)}). If a file of it is missing or damaged, resume from an "
            f"earlier checkpoint in {load} with --ckpt-step ITERATION, or start in another "
            f"--save directory; if it was saved for another model shape or vocabulary, load "
            f"it with the flags it was saved with")


def save_message(save: str, iteration: int, error: BaseException) -> str:
    latest = iteration_loaded(save, None)
    kept = (f"{save}/latest_checkpointed_iteration.txt still names iteration {latest}, a "
            f"complete checkpoint, which the same command resumes from" if latest.isdigit()
            else f"{save} holds no complete checkpoint yet")
    try:
        free = f"; {shutil.disk_usage(save).free / 2**30:.1f} GiB free there"
    except OSError:
        free = ""
    return (f"--save {save}: the checkpoint of iteration {iteration} could not be written "
            f"({cause(error)}{free}). {os.path.join(save, f'iter_{iteration:07d}')} is "
            f"incomplete; {kept} once the file system takes the write (free space, raise the "
            f"quota or limit)")


def _explained(function, describe):
    """``function`` whose :data:`FAILURES` raise ``describe(megatron_args, call_args, error)``
    as a ``ValueError``."""

    @functools.wraps(function)
    def call(*args, **kwargs):
        from megatron.training import get_args

        try:
            return function(*args, **kwargs)
        except FAILURES as error:
            raise ValueError(describe(get_args(), args, error)) from error

    call.explains_failures = True
    return call


def explained_load(load_checkpoint):
    """``load_checkpoint`` whose failures raise :func:`message`."""
    return _explained(load_checkpoint, lambda margs, _, error: message(
        margs.load, getattr(margs, "ckpt_step", None), error))


def explained_save(save_checkpoint):
    """``save_checkpoint`` (first argument: the iteration) whose failures raise
    :func:`save_message`."""
    return _explained(save_checkpoint, lambda margs, args, error: save_message(
        margs.save, args[0], error))
