"""Megatron-LM's full recomputation as a fixed checkpointing table of the schedules that plan
their own (``elastic``, ``seq1f1b``, ``sppo``).

Megatron's meaning (``TransformerBlock``'s checkpointed forward), per pipeline stage of ``L_p``
layers, with ``--recompute-granularity full``:

* ``--recompute-method uniform --recompute-num-layers N``: the stage's layers in groups of ``N``,
  each group checkpointed: every layer of the stage is recomputed, whatever ``N``;
* ``--recompute-method block --recompute-num-layers N``: the first ``N`` layers of the stage,
  each checkpointed; the others keep their activations.

The table: ``ckpt[p][k] = L_p`` (uniform) or ``min(N, L_p)`` (block) for every chunk ``k`` of
every pipeline, so the layers that recompute are Megatron's. Under ``elastic`` and ``seq1f1b``
CP-SAT does not choose checkpoints then; the chunking, the grouping into pipelines and the
forward lookahead are chosen as without the flags, each candidate priced with this table (a
candidate the table does not fit is dropped). Under ``sppo`` every subsequence of a stage
checkpoints the table's layers, and nothing is offloaded (:mod:`sppo_offload.batch_plan`).

What is saved differs from Megatron's: the runtime keeps only the checkpointed range's input
(the stage input) and rebuilds the whole range in one ``RECOMPUTE`` before the chunk's backward
(:mod:`megatron.plugin.pipeline.layer_checkpoint`), where Megatron saves each group's input
(uniform: ``L_p / N`` of them) or each checkpointed layer's (block: ``N``) and rebuilds one
group at a time inside the backward. The memory held is therefore the runtime's: one boundary
per chunk in flight, and during a chunk's backward the whole range rematerialised at once. The
planners' memory models (:func:`elastic_pipe.checkpointing.memory_peaks`, SPPO's replay) are
that of the runtime with this table, and ``--elastic-memory-gb`` / ``--sppo-memory-gb`` are
checked against them: a table that does not fit stops the planning with the smallest budget
that fits it.

``--recompute-granularity selective`` is refused under these schedules (:func:`check_args`):
Megatron checkpoints the core attention with ``tensor_parallel.checkpoint``, which runs it
without autograd and again inside the backward, but a split document's slice records its K and
V inside the core attention with their graph, as roots of its own backward for the gradients
later slices send back (:mod:`megatron.plugin.layers.kv_store`); under Megatron's checkpoint
they would have none.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from megatron.plugin.substitutions import Substitution

METHODS = ("uniform", "block")

SELECTIVE_REFUSAL = (
    "--recompute-granularity selective is not supported by --pipeline-schedule {schedule}: "
    "Megatron checkpoints the core attention by running it without autograd and again inside "
    "the backward, but a split document's slices keep their K and V with the graph for the "
    "gradients later slices send back, which Megatron's checkpoint would drop. Use "
    "--recompute-granularity full with --recompute-method block or uniform (layers recomputed "
    "per chunk){alternative}")


@dataclass(frozen=True)
class FixedCheckpointing:
    """Megatron's ``--recompute-method`` and ``--recompute-num-layers`` under
    ``--recompute-granularity full`` (see the module docstring)."""

    method: str
    """``uniform``: every layer of each stage; ``block``: the first ``num_layers``."""
    num_layers: int
    """``--recompute-num-layers``: the group size (uniform) or the leading layers (block)."""

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError("--recompute-granularity full needs a --recompute-method: pass "
                             "uniform (every layer of each stage recomputed) or block (the "
                             "first --recompute-num-layers of each stage)")
        if self.num_layers is None or self.num_layers < 1:
            given = "" if self.num_layers is None else f" (got {self.num_layers})"
            raise ValueError(f"--recompute-granularity full needs --recompute-num-layers N >= 1"
                             f"{given}: the layers of one checkpointed group (uniform) or the "
                             f"leading layers of each stage recomputed (block)")

    def layers(self, stage_layers: int) -> int:
        """Checkpointed leading layers of a stage of ``stage_layers`` layers, for every chunk."""
        return stage_layers if self.method == "uniform" else min(self.num_layers, stage_layers)

    def table(self, stage_layers: Sequence[int], chunks: int) -> tuple[tuple[int, ...], ...]:
        """``[stage][chunk]`` checkpointed layers of a pipeline of ``chunks`` chunks."""
        return tuple((self.layers(n),) * chunks for n in stage_layers)

    def flags(self) -> str:
        """The command-line flags that ask for this table."""
        return (f"--recompute-granularity full --recompute-method {self.method} "
                f"--recompute-num-layers {self.num_layers}")


def fixed_checkpointing(args: argparse.Namespace) -> FixedCheckpointing | None:
    """The table Megatron's recompute flags fix, or ``None`` when they ask for none (the
    planner chooses)."""
    if args.recompute_granularity != "full":
        return None
    return FixedCheckpointing(args.recompute_method, args.recompute_num_layers)


def check_args(args: argparse.Namespace, alternative: str = "") -> None:
    """Refuse the recompute flags these schedules cannot honour, naming what to pass, and
    ``alternative`` (the rest of a sentence: what else the schedule offers)."""
    if args.recompute_granularity == "selective":
        raise ValueError(SELECTIVE_REFUSAL.format(schedule=args.pipeline_schedule,
                                                  alternative=alternative))
    fixed_checkpointing(args)


def _rebuilt_together(args: argparse.Namespace) -> str:
    return (f"{fixed_checkpointing(args).flags()} under --pipeline-schedule "
            f"{args.pipeline_schedule}: the plan recomputes the layers Megatron's method names, "
            f"but keeps only the input of each stage's checkpointed range and rebuilds the range "
            f"in one pass before each unit's backward, where Megatron-LM keeps each checkpointed "
            f"group's input and rebuilds one group at a time inside the backward: the same loss "
            f"and gradients, other memory")


#: What a schedule that plans Megatron's full recomputation as this table says at start-up.
SUBSTITUTION = Substitution("--recompute-granularity",
                            lambda args: args.recompute_granularity == "full", _rebuilt_together)
