"""Load a checkpoint of ``pretrain_gpt_elastic.py`` with Megatron-LM's own loader into a plain
megatron-core ``GPTModel`` (Megatron's local layer spec, its own causal attention: what
Megatron-LM's ``pretrain_gpt.py`` builds with ``--transformer-impl local``), and into the
project's model; write both models' loss on each of a few documents and the loaded iteration.

    torchrun --nproc-per-node 1 tests/e2e/plain_gpt_worker.py <flags> --load CKPT --out OUT.json
"""
import json
import sys

import numpy as np
import torch

from megatron.plugin import launch
from megatron.plugin.batches import forward_step, micro_batch, pack_row


def extra(parser):
    parser.add_argument("--out", required=True)
    return parser


def plain_gpt(pre_process=True, post_process=True, vp_stage=None, config=None,
              pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args

    from megatron.plugin.model import model_config

    del vp_stage, pg_collection
    args = get_args()
    return GPTModel(config=config or model_config(args),
                    transformer_layer_spec=get_gpt_layer_local_spec(),
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type,
                    pre_process=pre_process, post_process=post_process)


def plain_loss(module, doc) -> float:
    tokens = torch.from_numpy(doc[:-1]).unsqueeze(0)
    labels = torch.from_numpy(doc[1:]).unsqueeze(0)
    length = tokens.shape[1]
    positions = torch.arange(length).unsqueeze(0)
    # Megatron's causal mask (True: masked), given: its default one is built on CUDA.
    mask = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]
    losses = module(tokens, positions, mask, labels=labels)
    return float(losses.float().mean())


def project_loss(module, doc) -> float:
    output, loss_fn = forward_step(iter([micro_batch([pack_row([doc])])]), module)
    loss_sum, tokens, _ = loss_fn(output)
    return float(loss_sum) / int(tokens)


def main() -> int:
    from megatron.training import get_args
    from megatron.training import training as megatron_training

    args = launch.initialize(sys.argv[1:], extra)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n + 1).astype(np.int64) for n in (17, 64, 100)]
    plain, _, _ = megatron_training.setup_model_and_optimizer(
        model_provider_func=plain_gpt, model_type=launch.MODEL_TYPE)
    loaded_iteration = get_args().iteration
    ours, _, _, _ = launch.setup_model_and_optimizer()
    with torch.no_grad():
        result = {"iteration": loaded_iteration,
                  "plain": [plain_loss(plain[0].module.eval(), d) for d in docs],
                  "project": [project_loss(ours[0].module.eval(), d) for d in docs]}
    with open(args.out, "w") as f:
        json.dump(result, f)
    launch.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
