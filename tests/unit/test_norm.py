"""The layer spec's norms: Megatron's ``--normalization`` choices, sequence-parallel flags and
``--apply-layernorm-1p`` (zero-centred gamma)."""
from types import SimpleNamespace

import pytest
import torch

from megatron.plugin.layers.norm import SequenceParallelNorm


def config(normalization, centred=False, sequence_parallel=False):
    return SimpleNamespace(normalization=normalization, layernorm_zero_centered_gamma=centred,
                           sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("normalization,plain", [
    ("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
def test_zero_centred_gamma_scales_by_one_plus_the_stored_weight(normalization, plain):
    torch.manual_seed(0)
    centred = SequenceParallelNorm(config(normalization, centred=True), 8, eps=1e-5)
    reference = plain(8, eps=1e-5)
    # Same parameter names as the plain norm (checkpoints keep their keys); weight starts at 0.
    assert [n for n, _ in centred.named_parameters()] == \
        [n for n, _ in reference.named_parameters()]
    assert torch.equal(centred.weight, torch.zeros(8))
    with torch.no_grad():
        centred.weight.copy_(torch.randn(8))
        reference.weight.copy_(centred.weight + 1)
        if normalization == "LayerNorm":
            centred.bias.copy_(torch.randn(8))
            reference.bias.copy_(centred.bias)
    x = torch.randn(3, 2, 8, requires_grad=True)
    y = centred(x)
    torch.testing.assert_close(y, reference(x))
    (y * torch.arange(8.0)).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    (reference(x2) * torch.arange(8.0)).sum().backward()
    torch.testing.assert_close(centred.weight.grad, reference.weight.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_norms_flag_their_parameters_for_the_sequence_parallel_reduction():
    norm = SequenceParallelNorm(config("LayerNorm", sequence_parallel=True), 4)
    assert all(p.sequence_parallel for p in norm.parameters())
    with pytest.raises(ValueError, match="--normalization L2Norm is not supported"):
        SequenceParallelNorm(config("L2Norm"), 4)
