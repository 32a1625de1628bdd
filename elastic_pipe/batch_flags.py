"""The flags that give one batch of documents to plan, the model and layout it is priced for
and the planner's limits, and what they make (:func:`planning_inputs`): shared by
``python -m elastic_pipe.plan`` and the drawing of ``elastic`` and ``seq1f1b``
(:mod:`elastic_pipe.drawing`). ``--pp`` and ``--num-layers`` belong to the command that adds
these (:func:`~longctx.model_flags.add_num_layers`)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from longctx.cost_model import CostModel, ParallelConfig
from longctx.hardware import load_profile, profiles_help
from longctx.model_flags import add_model_arguments, missing_shape_flags, model_config
from elastic_pipe.scheduler import SchedulerConfig
from elastic_pipe.sequence_processor import ChunkingConfig
from elastic_pipe.workloads import WORKLOADS, dataset_lengths, read_lengths, sample, truncate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--lengths", help="file with one document length a line (.gz allowed)")
    source.add_argument("--data-path", help="Megatron dataset prefix (PREFIX.bin/PREFIX.idx)")
    source.add_argument("--workload", choices=sorted(WORKLOADS),
                        help="generated document lengths (--global-batch-size of them)")
    parser.add_argument("--global-batch-size", type=int,
                        help="documents sampled from the source (default: all of them)")
    parser.add_argument("--seed", type=int, default=1234, help="sampling seed")
    parser.add_argument("--seq-length", type=int, default=131072,
                        help="context length; longer documents are truncated")
    add_model_arguments(parser)
    parser.add_argument("--hardware", default="a800", help=f"{profiles_help()} or a profile .json")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    parser.add_argument("--memory-gb", type=float, help="GB per GPU (default: the profile's)")
    parser.add_argument("--solver-time-limit", type=float, default=0.2,
                        help="CP-SAT time limit per pipeline (deterministic seconds)")
    parser.add_argument("--workers", type=int, default=2, help="solver processes")


@dataclass(frozen=True)
class PlanningInputs:
    """One batch, truncated to the context, and what it is planned with."""

    lengths: list[int]
    truncated: int
    """Documents cut to ``--seq-length``."""
    cost: CostModel
    config: SchedulerConfig


def missing_flags(args: argparse.Namespace) -> list[str]:
    """What the flags of :func:`add_arguments` and ``--num-layers`` leave out, each entry a
    flag (or a choice of flags) with what it is for: the batch's source, the documents a
    ``--workload`` draws, the shape of a ``--model custom``."""
    missing = []
    if not (args.lengths or args.data_path or args.workload):
        missing.append("--lengths FILE, --data-path PREFIX or --workload NAME (the batch)")
    if args.workload and not args.global_batch_size:
        missing.append("--global-batch-size (the documents --workload draws)")
    shape = missing_shape_flags(args)
    if shape:
        missing.append(f"{' '.join(shape)} (the shape of --model custom)")
    return missing


def batch_lengths(args: argparse.Namespace) -> list[int]:
    """The document lengths of the batch the flags name (``ValueError`` naming everything
    :func:`missing_flags` finds)."""
    missing = missing_flags(args)
    if missing:
        raise ValueError("missing " + "; ".join(missing))
    if args.workload:
        return WORKLOADS[args.workload](args.global_batch_size, args.seed)
    lengths = read_lengths(args.lengths) if args.lengths else dataset_lengths(args.data_path)
    if args.global_batch_size:
        lengths = sample(lengths, args.global_batch_size, args.seed)
    return lengths


def planning_inputs(args: argparse.Namespace) -> PlanningInputs:
    """The batch, cost model and planner configuration of the flags of :func:`add_arguments`,
    ``--num-layers`` and ``--pp``."""
    lengths, truncated = truncate(batch_lengths(args), args.seq_length)
    hardware = load_profile(args.hardware)
    parallel = ParallelConfig(pp=args.pp, sp=args.sp, tp=args.tp, dp=args.dp,
                              memory_gb=args.memory_gb or hardware.hbm_gb)
    return PlanningInputs(lengths, truncated, CostModel(model_config(args), hardware, parallel),
                          SchedulerConfig(ChunkingConfig(seq_length=args.seq_length),
                                          solver_time_limit=args.solver_time_limit,
                                          workers=args.workers))
