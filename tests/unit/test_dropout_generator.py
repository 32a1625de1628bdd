"""Attention dropout draws from the generator Megatron's RNG tracker forks on the tensors' device.

On CUDA, ``CudaRNGStatesTracker.fork`` swaps the state of the GPU's generator and leaves the
CPU generator alone. On the CPU a generator apart from the CPU one stands for the GPU's (the
tensors' device generator, :func:`~megatron.plugin.layers.rng.device_generator`) and a tracker
whose fork moves only it stands for Megatron's, so the CPU shows what a kernel reading the CPU
generator gets wrong on CUDA: the masks do not follow the fork, and every tensor-parallel rank
draws the same ones. With a GPU the same tests run on it with Megatron's own tracker.
"""
import contextlib

import pytest
import torch
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin.layers import attention, rng
from megatron.plugin.layers.attention import DocumentAttention
from megatron.plugin.layers.layout import PackedDocuments, document_segments

SEED, HEADS, DIM, TOKENS = 1234, 2, 8, 16


class DeviceOnlyTracker:
    """Megatron's ``model-parallel-rng`` fork as it runs on CUDA: the block draws from the
    rank's state of the device generator, which then advances; afterwards the device
    generator continues where it was. The CPU generator is not touched."""

    def __init__(self, generator: torch.Generator, state: torch.Tensor):
        self.generator = generator
        self.state = state

    @contextlib.contextmanager
    def fork(self):
        outer = self.generator.get_state()
        self.generator.set_state(self.state)
        try:
            yield
        finally:
            self.state = self.generator.get_state()
            self.generator.set_state(outer)


class StandIn:
    """The CPU with a generator apart from the CPU one as the tensors' device generator and
    :class:`DeviceOnlyTracker` as Megatron's tracker."""

    device = "cpu"

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        generator = torch.Generator()
        monkeypatch.setattr(rng, "device_generator", lambda device: generator)

    def seed(self, tp_rank: int) -> torch.Tensor:
        """Megatron's model-parallel seeding for ``tp_rank``; returns the rank's state."""
        state = torch.Generator().manual_seed(SEED + 2718 + tp_rank).get_state()
        tracker = DeviceOnlyTracker(rng.device_generator(torch.device(self.device)), state)
        self.monkeypatch.setattr(attention, "get_cuda_rng_tracker", lambda: tracker)
        return state


class Cuda:
    """A GPU with Megatron's own tracker."""

    device = "cuda"

    def seed(self, tp_rank: int) -> torch.Tensor:
        """Megatron's model-parallel seeding for ``tp_rank``; returns the rank's state."""
        tp_random.model_parallel_cuda_manual_seed(SEED, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        return tp_random.get_cuda_rng_tracker().get_states()["model-parallel-rng"].clone()


@pytest.fixture(params=["cpu-stand-in", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Megatron's CUDA RNG tracker needs a CUDA device"))])
def world(request, monkeypatch):
    if request.param == "cuda":
        yield Cuda()
        tp_random.get_cuda_rng_tracker().reset()
    else:
        yield StandIn(monkeypatch)


def _attend(monkeypatch, world, tp_rank: int, host_seed: int, fork: bool = True):
    """``(output, q/k/v gradients, whether the CPU generator moved in the forward)`` of the
    unfused document attention with dropout 0.5 over two packed documents, on tensor-parallel
    rank ``tp_rank``, the CPU generator seeded ``host_seed``. Without ``fork`` the attention
    forks nothing and the device generator starts at the rank's model-parallel state. Between
    forward and backward both generators move: the backward must draw the forward's masks."""
    state = world.seed(tp_rank)
    generator = rng.device_generator(torch.device(world.device))
    if not fork:
        monkeypatch.setattr(DocumentAttention, "dropout_rng", lambda self: contextlib.nullcontext())
        generator.set_state(state)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               attention_dropout=0.5, hidden_dropout=0.0,
                               attention_backend=AttnBackend.unfused)
    attn = DocumentAttention(config, layer_number=1).train()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(TOKENS, 1, HEADS, DIM, generator=g).to(world.device).requires_grad_()
               for _ in range(3))
    grad = torch.randn(TOKENS, 1, HEADS * DIM, generator=g).to(world.device)
    layout = PackedDocuments(segments=(document_segments([10, 6]),))
    torch.manual_seed(host_seed)
    before = torch.get_rng_state()
    out = attn(q, k, v, packed_seq_params=layout)
    host_moved = not torch.equal(before, torch.get_rng_state())
    torch.manual_seed(host_seed + 1)
    generator.manual_seed(host_seed + 2)
    out.backward(grad)
    return out.detach(), [t.grad for t in (q, k, v)], host_moved


def test_masks_follow_the_forked_device_generator_not_the_cpu_one(monkeypatch, world):
    out, grads, host_moved = _attend(monkeypatch, world, tp_rank=0, host_seed=5)
    again, grads_again, _ = _attend(monkeypatch, world, tp_rank=0, host_seed=6)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    for grad, grad_again in zip(grads, grads_again):
        torch.testing.assert_close(grad_again, grad, rtol=0, atol=0)
    # Megatron's CUDA fork warns when the CPU generator moves inside it.
    assert not host_moved


def test_the_fork_gives_the_masks_of_the_ranks_model_parallel_state(monkeypatch, world):
    """The forked run equals a run without a fork from the device generator at the rank's
    model-parallel seed: the same masks, forward and backward."""
    out, grads, _ = _attend(monkeypatch, world, tp_rank=1, host_seed=5)
    expected, expected_grads, _ = _attend(monkeypatch, world, tp_rank=1, host_seed=5,
                                          fork=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_tensor_parallel_ranks_draw_their_own_masks(monkeypatch, world):
    """Same CPU generator, other model-parallel state: other masks (Megatron's dropout inside
    the model-parallel region)."""
    first, _, _ = _attend(monkeypatch, world, tp_rank=0, host_seed=5)
    second, _, _ = _attend(monkeypatch, world, tp_rank=1, host_seed=5)
    assert not torch.equal(first, second)
