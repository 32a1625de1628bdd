"""Attention dropout under tensor parallelism draws each rank's own masks, as in Megatron.

Megatron's ``DotProductAttention`` forks the model-parallel RNG state (``seed + 2718 +
tp_rank``) around its dropout unless sequence parallelism is on (then ``TransformerBlock`` runs
the whole layer under that state). Before, the document attention drew from the default
generator, equal on every tensor-parallel rank: the ranks' heads shared one mask.
"""
import json

from harness import torchrun


def test_tensor_parallel_ranks_draw_their_own_attention_dropout():
    result = torchrun(2, "tests/distributed/tp_dropout_worker.py", [], timeout=180)
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    drawn = json.loads(line[len("RESULT "):])
    # Without sequence parallelism: forked, so the masks differ and the default stream is kept.
    assert drawn["tp"] == {"ranks_equal": False, "default_generator_moved": False}
    # With it the attention leaves the choice to the block around it, like Megatron's.
    assert drawn["tp_sp"] == {"ranks_equal": True, "default_generator_moved": True}
