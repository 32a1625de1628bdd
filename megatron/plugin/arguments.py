"""Command-line arguments of ``pretrain_gpt_elastic.py``: Megatron-LM's names and meanings.

Only flags whose behaviour is implemented are accepted. A Megatron-LM flag that this script
does not implement is refused with a message naming it (never silently ignored); anything else
unknown is refused by argparse. Schedules add their own argument groups through
:func:`megatron.plugin.registry.register_argument_group`.
"""
from __future__ import annotations

import argparse

from megatron.plugin import registry
from megatron.plugin.pipeline import megatron_ir  # noqa: F401  (registers 1f1b-ir)
import elastic_pipe.runtime  # noqa: F401,E402  (registers elastic, seq1f1b and their flags)
import helix.runtime  # noqa: F401,E402  (registers helix and its flags)
import sppo_offload.runtime  # noqa: F401,E402  (registers sppo and its flags)


#: Megatron-LM flags users commonly pass that this script does not implement.
UNSUPPORTED_MEGATRON_FLAGS = {
    "--num-experts", "--moe-router-topk", "--expert-model-parallel-size", "--fp8-format",
    "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
    "--use-flash-attn", "--apply-query-key-layer-scaling", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split", "--multi-latent-attention", "--mtp-num-layers",
    "--data-cache-path", "--train-samples", "--rampup-batch-size", "--vocab-file",
    "--merge-file", "--tokenizer-model", "--loss-scale", "--initial-loss-scale",
    "--cuda-graph-impl", "--use-torch-fsdp2", "--ckpt-format", "--finetune", "--no-load-optim",
    "--no-load-rng", "--wandb-project", "--pipeline-model-parallel-split-rank",
}


MEGATRON_SCHEDULES = (registry.DEFAULT, "1f1b", "interleaved")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_elastic.py",
        description="Megatron GPT pretraining with long-context pipeline schedules.",
        allow_abbrev=False,
    )
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--use-mcore-models", action="store_true", help="accepted; always mcore")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--pipeline-schedule", default=registry.DEFAULT,
                   help="default (Megatron's own choice), 1f1b, interleaved, or a registered "
                        "schedule (elastic, helix, sppo ...)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--pipeline-timeout-s", type=float, default=600.0,
                   help="IR schedules: seconds a pipeline transfer may wait before failing "
                        "with the rank, action and peer named")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, required=True,
                   help="documents per iteration (document-level batches)")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine",
                                                "inverse-square-root", "WSD"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="dataset prefix (or 'weight prefix ...'); default: the embedded corpus")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="ByteLevel")
    g.add_argument("--mock-data", action="store_true")

    g = parser.add_argument_group("logging and checkpoints")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and exit when the iteration is a multiple of this")
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-jsonl", default=None,
                   help="write one JSON object per iteration to this file (rank 0)")
    g.add_argument("--trace-dir", default=None,
                   help="write Chrome-trace JSON of the executor's actions per rank")
    for add in registry.argument_groups():
        add(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; exits with status 2 and a message naming the flag to change."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    for token in unknown:
        flag = token.split("=", 1)[0]
        if flag in UNSUPPORTED_MEGATRON_FLAGS:
            parser.error(f"Megatron-LM flag {flag} is not supported by pretrain_gpt_elastic.py; "
                         "remove it (the README lists the supported flags)")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        validate_args(args)
    except ValueError as err:
        parser.error(str(err))
    return args


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> None:
    """Checks that need no process group; ``world_size`` adds the divisibility checks."""
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f"--seq-length {args.seq_length} is larger than --max-position-embeddings "
            f"{args.max_position_embeddings}: raise --max-position-embeddings or lower --seq-length")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
        if args.swiglu:
            args.ffn_hidden_size = int((4 * args.hidden_size * 2 / 3) / 64) * 64 or args.hidden_size
    if args.hidden_size % args.num_attention_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by "
                         f"--num-attention-heads {args.num_attention_heads}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_attention_heads % args.num_query_groups:
        raise ValueError("--num-attention-heads must be a multiple of --num-query-groups")
    if args.bf16 and args.fp16:
        raise ValueError("--bf16 and --fp16 are exclusive: choose one")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_attention_heads % tp or args.num_query_groups % tp:
        raise ValueError(f"--num-attention-heads {args.num_attention_heads} and query groups "
                         f"{args.num_query_groups} must be divisible by "
                         f"--tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        raise ValueError(f"--num-layers {args.num_layers} is not divisible by "
                         f"--pipeline-model-parallel-size {pp}: change either")
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp < 2 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise ValueError("--num-layers-per-virtual-pipeline-stage must divide the layers per "
                             "pipeline stage, with --pipeline-model-parallel-size > 1")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel and args.seq_length % tp:
        raise ValueError(f"--seq-length {args.seq_length} must be divisible by "
                         f"--tensor-model-parallel-size {tp} with --sequence-parallel")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        raise ValueError("--recompute-granularity full needs --recompute-method uniform|block")
    if args.mock_data and args.data_path:
        raise ValueError("--mock-data and --data-path are exclusive: choose one")
    if args.save_interval is not None and args.save_interval <= 0:
        raise ValueError("--save-interval must be positive")
    if args.global_batch_size <= 0 or args.train_iters < 0:
        raise ValueError("--global-batch-size must be positive and --train-iters non-negative")
    registry.check_name(args.pipeline_schedule)
    check = registry.schedule_hook(args.pipeline_schedule, "check_args")
    if check is not None:
        check(args)
    cp = args.context_parallel_size
    if cp > 1 and args.pipeline_schedule in MEGATRON_SCHEDULES:
        raise ValueError("--context-parallel-size > 1 is not supported with Megatron's own "
                         "schedules here (ring attention needs Transformer Engine); use 1, or "
                         "an IR schedule (elastic, seq1f1b, 1f1b-ir), where it is Ulysses")
    if cp > 1:
        heads = args.num_attention_heads // tp
        groups = args.num_query_groups // tp
        if heads % cp or groups % cp:
            raise ValueError(f"Ulysses sequence parallelism splits the attention heads: "
                             f"{heads} heads and {groups} query groups per tensor-parallel "
                             f"rank are not divisible by --context-parallel-size {cp}; "
                             f"choose a degree that divides them")
        if args.seq_length % (cp * tp):
            raise ValueError(f"--seq-length {args.seq_length} must be divisible by "
                             f"--context-parallel-size x --tensor-model-parallel-size "
                             f"({cp} x {tp})")
    if world_size is not None:
        model_parallel = tp * pp * args.context_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context "
                f"parallel sizes ({tp} x {pp} x {args.context_parallel_size}): change the "
                "parallel sizes or the number of processes")
