"""The flags of ``helix`` (training and drawing) and what it refuses."""
from __future__ import annotations

import argparse


from helix.mapping import check_layout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("helix pipeline (HelixPipe)")
    g.add_argument("--helix-folds", type=int, default=2,
                   help="micro-batches in flight per slot (2: the two-fold FILO schedule)")
    g.add_argument("--helix-recompute-without-attention", action="store_true",
                   help="recompute pre/post-attention parts before their backward, never the "
                        "attention")
    g.add_argument("--helix-mlp-chunk-size", type=int, default=None, metavar="TOKENS",
                   help="run each MLP block over chunks of TOKENS sequence positions, keeping "
                        "one chunk's intermediate activations at a time (see "
                        "helix/chunked_mlp.py)")


def add_draw_arguments(parser: argparse.ArgumentParser) -> None:
    """Helix's drawing flags (``scripts/show_schedule.py``, :func:`helix.schedule.helix_ir`);
    ``--num-layers`` is shared (:func:`longctx.model_flags.add_num_layers`)."""
    parser.add_argument("--helix-folds", type=int, default=2,
                        help="micro-batches in flight per slot")
    parser.add_argument("--recompute", action="store_true",
                        help="recompute pre/post-attention parts before their backward")
    parser.add_argument("--pre-cost", type=float, default=1.0,
                        help="pre-attention forward (input norm, QKV projection)")
    parser.add_argument("--attention-cost", type=float, default=1.0, help="attention forward")
    parser.add_argument("--post-cost", type=float, default=2.0,
                        help="post-attention forward (output projection, residual, norm, MLP)")


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for settings helix cannot run (called by the training script's
    ``check_args``)."""
    if args.num_layers is not None:  # else Megatron-LM's own check names --num-layers
        check_layout(args.num_layers, args.pipeline_model_parallel_size)
    if args.helix_folds < 1:
        raise ValueError(f"--helix-folds must be >= 1, got {args.helix_folds}")
    chunk = args.helix_mlp_chunk_size
    if chunk is not None:
        tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
        if chunk < 1:
            raise ValueError(f"--helix-mlp-chunk-size must be >= 1, got {chunk}")
        shards = cp * (tp if args.sequence_parallel else 1)
        if chunk % shards:
            raise ValueError(
                f"--helix-mlp-chunk-size {chunk} must be a multiple of {shards}, the ranks "
                f"that share a sequence (--context-parallel-size {cp}"
                + (f" x --tensor-model-parallel-size {tp} with --sequence-parallel"
                   if args.sequence_parallel else "")
                + "): each rank chunks its shard of the sequence")
        if getattr(args, "num_experts", None):
            raise ValueError("--helix-mlp-chunk-size needs a dense MLP: MoE routing sees the "
                             "whole sequence; drop --num-experts or the chunk size")
