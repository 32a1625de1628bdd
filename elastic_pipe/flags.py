"""The flags of ``elastic`` and ``seq1f1b``, their checks, and the planner's configuration
they make (with Megatron's ``--recompute-*`` flags: :mod:`longctx.fixed_checkpointing`)."""
from __future__ import annotations

import argparse

from longctx.job_costs import CPU_MEMORY_GB

from longctx import fixed_checkpointing as fixed
from elastic_pipe.run_costs import AUTO
from elastic_pipe.scheduler import SchedulerConfig
from elastic_pipe.sequence_processor import ChunkingConfig


def check_args(args: argparse.Namespace) -> None:
    """Megatron's recompute flags as these schedules honour them (``ScheduleSpec.check_args``;
    :mod:`longctx.fixed_checkpointing`), the planner's own checkpointing the alternative."""
    fixed.check_args(args, alternative=", or leave recomputation to the planner (lower "
                                       "--elastic-memory-gb to make it recompute more)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("elastic pipeline (InfiniPipe) and seq1f1b")
    g.add_argument("--elastic-memory-gb", type=float, default=None,
                   help="memory budget per rank, GB; default: the CUDA device's memory "
                        "(divided by the ranks sharing it under LONGCTX_SHARE_GPU=1), "
                        f"{CPU_MEMORY_GB:g} on CPU")
    g.add_argument("--elastic-reserved-gb", type=float, default=None,
                   help="part of the budget never planned for (CUDA context, NCCL buffers, "
                        "fragmentation); default 2 on CUDA, 0 on CPU")
    g.add_argument("--elastic-solver-time-limit", type=float, default=0.2,
                   help="CP-SAT deterministic time limit per candidate pipeline, seconds")
    g.add_argument("--elastic-slices", default="auto", type=slices_flag,
                   help="slices of the longest document: N, or auto (tried 1, 2, 3, 4, 6, ... "
                        "while a slice keeps --elastic-min-slice-tokens; where 1 is tried and "
                        "every document fits --seq-length, Megatron's own micro-batches are a "
                        "candidate too)")
    g.add_argument("--elastic-min-slice-tokens", type=int, default=4096,
                   help="smallest first slice the automatic slice count goes down to")
    g.add_argument("--elastic-refit-interval", type=interval_flag, default=AUTO,
                   help="refit the cost model's eq. 1 coefficients and backward factor (which "
                        "price a unit's fixed cost, and so how many units a plan has) to the "
                        "executor's measured forward and backward times: auto (default) times "
                        "training iterations 2 and 3 and refits once before iteration 4 "
                        "(again on the next two when too few chunk shapes were measured or the "
                        "fit failed its acceptance bounds, at most 3 tries), then times "
                        "nothing; K refits every K training iterations, "
                        "timing every action (on CUDA a wait for the device around each); 0 "
                        "never refits. auto times nothing where a run is otherwise "
                        "reproducible bit for bit (on CPU, under --deterministic-mode) and "
                        "while ranks share a GPU (LONGCTX_SHARE_GPU=1)")


def interval_flag(value: str) -> int | str:
    """``--elastic-refit-interval``: ``auto``, or a number of iterations (``0`` for never)."""
    if value == AUTO:
        return value
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be auto or an integer >= 0 (0: never), "
                                         f"got {value!r}")
    return int(value)


def slices_flag(value: str):
    """``--elastic-slices``: ``"auto"`` or a positive integer."""
    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return int(value)


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    if args.elastic_solver_time_limit <= 0:
        raise ValueError("--elastic-solver-time-limit must be > 0 seconds")
    chunking = ChunkingConfig(min_slice_tokens=args.elastic_min_slice_tokens,
                              slice_counts=None if args.elastic_slices == "auto"
                              else (args.elastic_slices,),
                              seq_length=args.seq_length,
                              micro_batch_size=args.micro_batch_size)
    return SchedulerConfig(chunking=chunking, solver_time_limit=args.elastic_solver_time_limit,
                           workers=1, fixed=fixed.fixed_checkpointing(args))
