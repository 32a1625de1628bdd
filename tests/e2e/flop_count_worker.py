"""One evaluation step and one training step on given documents, then Megatron-LM's FLOP count
of the step as its loop forms it (``consume_seqlen_stats_in_iteration`` and
``num_floating_point_operations``, megatron-core 0.19); rank 0 writes it, with the step's
lengths, to ``--out``. Several command lines run in one launch (``launch.reset`` between them).

    torchrun --nproc-per-node 2 tests/e2e/flop_count_worker.py COMMAND_LINES.json
"""
import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron.plugin import launch
from megatron.plugin.document_data import GlobalBatch, no_upcoming


def extra(parser):
    group = parser.add_argument_group("FLOP count test")
    group.add_argument("--out", required=True)
    group.add_argument("--document-lengths", type=int, nargs="+", required=True,
                       help="inputs per document of the training step")
    return parser


def batches(documents, model):
    batch = GlobalBatch(documents, no_upcoming)
    return [iter([batch]) for _ in model] if len(model) > 1 else iter([batch])


def run(args) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.training.training import (consume_seqlen_stats_in_iteration,
                                            num_floating_point_operations)

    from megatron.plugin.batches import forward_step

    rng = np.random.default_rng(args.seed)
    documents = [rng.integers(0, 255, size=n + 1).astype(np.int64)
                 for n in args.document_lengths]
    model, optimizer, scheduler, config = launch.setup_model_and_optimizer()
    # An evaluation step first (Megatron's evaluate): it must count nothing.
    for chunk in model:
        chunk.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches(documents[::-1], model),
            model=model, num_microbatches=1, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=True)
    for chunk in model:
        chunk.train()
    launch.train_step(model, optimizer, scheduler, config, batches(documents, model))
    # What Megatron-LM's loop does after each training step.
    tokens, squares = consume_seqlen_stats_in_iteration()
    flops = num_floating_point_operations(args, args.global_batch_size,
                                          seqlen_squared_sum_in_batch=squares,
                                          total_real_tokens_in_batch=tokens)
    return {"flops": flops, "seq_length_flops": num_floating_point_operations(
        args, args.global_batch_size), "padded_vocab_size": args.padded_vocab_size,
        "ffn_hidden_size": args.ffn_hidden_size, "kv_channels": args.kv_channels}


def main() -> int:
    with open(sys.argv[1]) as f:
        command_lines = json.load(f)
    for argv in command_lines:
        args = launch.initialize(argv, extra)
        result = run(args)
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        launch.reset()
    launch.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
