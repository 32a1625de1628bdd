"""The flags of ``sppo`` (training and drawing) and what it refuses."""
from __future__ import annotations

import argparse

from longctx import fixed_checkpointing as fixed
from longctx.job_costs import CPU_MEMORY_GB, device_memory_gb

from sppo_offload.offload import AUTO, OFF, parse_offload

NAME = "sppo"


def subsequences_flag(value: str):
    """``--sppo-subsequences``: ``"auto"`` or a positive integer."""
    if value == AUTO:
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'auto', got {value!r}")
    return int(value)


def offload_flag(value: str):
    """``--sppo-offload``: ``"auto"``, ``"off"`` or a ratio in ``[0, 1]``."""
    try:
        return parse_offload(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("subsequence pipeline with offloading (SPPO)")
    g.add_argument("--sppo-subsequences", default=AUTO, type=subsequences_flag,
                   help="subsequences N per document (N >= pipeline stages), or auto: the "
                        "fewest, at least PP, that keep 16K tokens per device or fewer, or "
                        "Megatron's own micro-batches where they are predicted no slower "
                        "(not with a fixed --sppo-offload ratio or --sppo-multiplex)")
    g.add_argument("--sppo-offload", default=AUTO, type=offload_flag,
                   help="auto (ratios sized to the host link of the hardware profile), off, "
                        "or a ratio in [0, 1] of every subsequence's offloadable activations "
                        "(a document's last subsequence is never offloaded)")
    g.add_argument("--sppo-host-memory-gb", type=float, default=None,
                   help="host memory one rank's offloaded activations may use, GB; default: "
                        "no limit")
    g.add_argument("--sppo-multiplex", action="store_true",
                   help="multiplexed sequence partitioning: the first subsequence's forward "
                        "and backward run split over the stages that would idle in the "
                        "warm-up and cool-down (one document per data-parallel replica; see "
                        "sppo_offload/multiplex.py)")
    g.add_argument("--sppo-memory-gb", type=float, default=None,
                   help="device memory budget per rank the batch's plan is checked against "
                        f"before computing, GB; default: the CUDA device's memory (divided by "
                        f"the ranks sharing it under LONGCTX_SHARE_GPU=1), {CPU_MEMORY_GB:g} "
                        f"on CPU")


def add_draw_arguments(parser: argparse.ArgumentParser) -> None:
    """SPPO's drawing flag (``scripts/show_schedule.py``, :func:`sppo_offload.pipeline.sppo_ir`)."""
    parser.add_argument("--offload", action="store_true",
                        help="offload every subsequence but the last, reload it before its "
                             "backward")


def check_args(args: argparse.Namespace) -> None:
    """Refuse what ``sppo`` cannot run, naming the flag to change. Each subsequence is one
    row; ``--micro-batch-size`` keeps Megatron's meaning for the loss (the micro-batches whose
    token means Megatron's default loss averages, :mod:`megatron.plugin.default_loss`)."""
    pp = args.pipeline_model_parallel_size
    fixed.check_args(args, alternative=", or offload instead of recomputing (--sppo-offload)")
    if fixed.fixed_checkpointing(args) is not None:
        if args.sppo_offload not in (AUTO, OFF):
            raise ValueError(f"--sppo-offload {args.sppo_offload} with --recompute-granularity "
                             f"full: sppo recomputes Megatron's layers or offloads, not both; "
                             f"drop --sppo-offload (auto offloads nothing when layers are "
                             f"recomputed) or the recompute flags")
        if args.sppo_multiplex:
            raise ValueError("--recompute-granularity full with --sppo-multiplex: the "
                             "multiplexed helpers run the first subsequence's layers without "
                             "recomputation; drop the recompute flags or --sppo-multiplex")
    if args.sppo_subsequences != AUTO and args.sppo_subsequences < pp:
        raise ValueError(f"--sppo-subsequences {args.sppo_subsequences} is smaller than "
                         f"--pipeline-model-parallel-size {pp}: the subsequence pipeline needs "
                         f"N >= PP; use at least {pp} subsequences, or auto")
    if args.sppo_multiplex:
        if pp < 2:
            raise ValueError("--sppo-multiplex fills pipeline bubbles: it needs "
                             "--pipeline-model-parallel-size >= 2")
        if args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1:
            raise ValueError("--sppo-multiplex runs with --tensor-model-parallel-size 1 and "
                             "--context-parallel-size 1: set both to 1, or drop "
                             "--sppo-multiplex")
        uneven = [flag for flag, name in (
            ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
            ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
            ("--account-for-embedding-in-pipeline-split",
             "account_for_embedding_in_pipeline_split"),
            ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"))
            if getattr(args, name, None)]
        if uneven:
            raise ValueError(f"{', '.join(uneven)} with --sppo-multiplex: the multiplexed "
                             f"helpers run another stage's layers on their own modules, so the "
                             f"stages must hold equal layers; drop {', '.join(uneven)} or "
                             f"--sppo-multiplex")
        if args.transformer_impl == "transformer_engine":
            raise ValueError(
                "--sppo-multiplex with --transformer-impl transformer_engine: the multiplexing "
                "helpers run another stage's layers on broadcast copies of its weights "
                "(torch.func.functional_call), and Transformer Engine's modules have not run "
                "that way on a GPU yet. Drop --sppo-multiplex (sppo builds TE layers without "
                "it), or pass --transformer-impl local")
        if args.attention_output_gate:
            raise ValueError(
                "--sppo-multiplex with --attention-output-gate: no test proves the multiplexing "
                "helpers' attention shares with the gate yet. Drop --sppo-multiplex (sppo "
                "applies the gate without it)")
    if args.sppo_host_memory_gb is not None and args.sppo_host_memory_gb <= 0:
        raise ValueError(f"--sppo-host-memory-gb must be > 0, got {args.sppo_host_memory_gb}")
    if args.sppo_memory_gb is not None and args.sppo_memory_gb <= 0:
        raise ValueError(f"--sppo-memory-gb must be > 0, got {args.sppo_memory_gb}")


def memory_budget_gb(args: argparse.Namespace) -> float:
    """``--sppo-memory-gb``, by default one rank's share of the CUDA device's memory
    (:func:`~longctx.job_costs.device_memory_gb`), ``CPU_MEMORY_GB`` on CPU."""
    if args.sppo_memory_gb is not None:
        return args.sppo_memory_gb
    return device_memory_gb()
