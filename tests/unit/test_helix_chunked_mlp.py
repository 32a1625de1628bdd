"""``helix.chunked_mlp``: the same values and gradients as the unchunked block, one chunk's
intermediate activations at a time."""
import pytest
import torch

from helix.chunked_mlp import chunked_mlp


class Block(torch.nn.Module):
    """A token-wise MLP block (norm, 4h MLP with dropout, residual) that records the rows it
    was called with."""

    def __init__(self, hidden=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)
        self.calls = []

    def forward(self, x):
        self.calls.append(x.shape[0])
        y = self.fc2(torch.nn.functional.dropout(torch.nn.functional.gelu(self.fc1(self.norm(x))),
                                                 p=0.3))
        return x + y


def _grads(block, x):
    return [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("rows", [1, 4, 7, 10, 64])
def test_matches_unchunked_block_with_dropout(rows):
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(10, 2, 8, requires_grad=True)
    grad_out = torch.randn(10, 2, 8)

    # Dropout masks are drawn per chunk, so the reference draws them per chunk too.
    torch.manual_seed(1)
    reference = torch.cat([block(x[i:i + rows]) for i in range(0, 10, rows)])
    reference.backward(grad_out)
    expected = _grads(block, x)
    block.zero_grad()
    x.grad = None

    torch.manual_seed(1)
    block.calls.clear()
    out = chunked_mlp(block, x, rows)
    assert block.calls == [min(rows, 10 - i) for i in range(0, 10, rows)]
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    after_forward = torch.get_rng_state()
    out.backward(grad_out)
    for got, want in zip(_grads(block, x), expected):
        torch.testing.assert_close(got, want)
    # The backward recomputed chunk by chunk, and left the random stream where it was.
    assert block.calls == 2 * [min(rows, 10 - i) for i in range(0, 10, rows)]
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_keeps_only_the_input_for_backward():
    block = Block()
    x = torch.randn(12, 1, 8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_mlp(block, x, 4)
    assert saved == [x.numel()]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x)
    assert sum(saved) > 4 * x.numel()  # the unchunked block keeps its 4h-wide activations


def test_rejects_empty_chunks():
    with pytest.raises(ValueError, match="positive"):
        chunked_mlp(Block(), torch.zeros(4, 1, 8), 0)
