"""The runtime of a fixed checkpointing table under Megatron's default dropout (0.1 on the
attention and the hidden states): a stage forward that checkpoints its first layer (block 1)
or both (uniform), other draws of the random generators, ``RECOMPUTE``, then the chunk's
two-part backward give exactly the gradients of the stage run with autograd throughout: the
recomputation replays the forward's dropout masks (host generator and Megatron's tracker)."""
import types

import pytest
import torch
import torch.distributed as dist

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline.chunks import DocumentChunks, chunk_backward
from megatron.plugin.pipeline.layer_checkpoint import LeadingLayers

H, HEADS, TOKENS, SEED = 32, 4, 24, 1234


@pytest.fixture
def one_rank(tmp_path):
    """Megatron's process groups on one CPU rank, with the CPU compatibility layer."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as tp_random

    from megatron.plugin import cpu_compat

    installed = cpu_compat.install(force=True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    parallel_state.initialize_model_parallel()
    yield tp_random
    tp_random.get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if installed:
        cpu_compat.uninstall()


class Stage(torch.nn.Module):
    """A pipeline stage of two of the project's layers (what ``LeadingLayers`` hooks)."""

    def __init__(self):
        super().__init__()
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import TransformerConfig

        from megatron.plugin.layers.attention import document_layer_spec

        config = TransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS,
                                   hidden_dropout=0.1, attention_dropout=0.1)
        self.decoder = TransformerBlock(config, document_layer_spec(2),
                                        post_layer_norm=False).train()


def _seeded(tp_random, seed):
    torch.manual_seed(seed)
    tp_random.model_parallel_cuda_manual_seed(seed)


def _gradients(stage, x):
    grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
    grads["input"] = x.grad.clone()
    stage.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("count", [1, 2], ids=["block-1", "uniform"])
def test_recomputed_layers_draw_the_forwards_dropout_masks(one_rank, count):
    _seeded(one_rank, SEED)
    stage = Stage()
    hidden = torch.randn(TOKENS, 1, H)
    upstream = torch.randn(TOKENS, 1, H)

    _seeded(one_rank, SEED + 1)
    x = hidden.clone().requires_grad_()
    stage.decoder(hidden_states=x, attention_mask=None).backward(upstream)
    expected = _gradients(stage, x)

    x = hidden.clone().requires_grad_()
    other = stage.decoder(hidden_states=x, attention_mask=None)
    assert not torch.equal(other, stage.decoder(hidden_states=x, attention_mask=None)), \
        "dropout draws other masks on another forward"

    layers = LeadingLayers(stage)
    chunks = DocumentChunks(kv_store=KVStore(), layers=layers, checkpointed=lambda unit: count,
                            slices=lambda unit: ())
    _seeded(one_rank, SEED + 1)
    x = hidden.clone().requires_grad_()
    with layers.armed(count):
        output = stage.decoder(hidden_states=x, attention_mask=None)
    stash = layers.take()
    assert stash.count == count
    stage.decoder(hidden_states=torch.randn(TOKENS, 1, H), attention_mask=None)  # another chunk
    layers.recompute(stash)
    chunk_backward(chunks, 0, x, output, upstream, stash,
                   types.SimpleNamespace(grad_scale_func=None))
    got = _gradients(stage, x)
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=0, atol=0, msg=name)
