"""Worker: two tensor-parallel ranks run ``DocumentAttention`` with attention dropout on the
same query/key/value, once without and once with sequence parallelism; rank 0 prints what
the ranks drew as JSON."""
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin import cpu_compat
from megatron.plugin.layers.attention import DocumentAttention
from megatron.plugin.layers.layout import PackedDocuments, document_segments

SEED, HEADS, DIM, TOKENS = 1234, 2, 8, 16


def attend(sequence_parallel: bool) -> dict:
    config = TransformerConfig(num_layers=1, hidden_size=2 * HEADS * DIM,
                               num_attention_heads=2 * HEADS, attention_dropout=0.5,
                               hidden_dropout=0.0, tensor_model_parallel_size=2,
                               sequence_parallel=sequence_parallel)
    attention = DocumentAttention(config, layer_number=1).train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(TOKENS, 1, HEADS, DIM, generator=g) for _ in range(3))
    layout = PackedDocuments(segments=(document_segments([10, 6]),))
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    out = attention(q, k, v, packed_seq_params=layout)
    gathered = [torch.empty_like(out) for _ in range(2)]
    dist.all_gather(gathered, out)
    return {"ranks_equal": bool(torch.equal(gathered[0], gathered[1])),
            "default_generator_moved": not torch.equal(before, torch.get_rng_state())}


def main() -> int:
    dist.init_process_group("gloo")
    cpu_compat.install()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tp_random.model_parallel_cuda_manual_seed(SEED)
    result = {"tp": attend(sequence_parallel=False), "tp_sp": attend(sequence_parallel=True)}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
