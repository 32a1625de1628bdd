"""``megatron.plugin.layers.kv_store``: context gradients summed in fp32 and rounded once."""
import torch

from megatron.plugin.layers.kv_store import KVStore, accumulator_dtype


def _recorded(dtype):
    """A store holding one slice's K/V (graph-attached to leaves ``source``) at layer 1."""
    source = torch.ones(4, 2, 8, dtype=dtype, requires_grad=True)
    store = KVStore()
    store.record("doc", 0, 1, source * 1, source * 2)
    return store, source


def test_bf16_context_gradients_are_summed_in_fp32_and_rounded_once():
    store, _ = _recorded(torch.bfloat16)
    (key, value), = store.context("doc", 1, 1)
    # 1 + 2^-9 rounds back to 1 in bf16 (7 mantissa bits): summed in bf16, sixteen later
    # slices' 2^-9 would vanish; in fp32 they add up to 2^-5, which bf16 holds exactly.
    torch.autograd.backward([key, value], [torch.ones_like(key), torch.ones_like(value)])
    for _ in range(16):
        small = torch.full_like(key, 2.0 ** -9)
        torch.autograd.backward([key, value], [small, small])
    assert key.grad is None and value.grad is None
    tensors, grads = store.backward_targets("doc", 0)
    assert len(tensors) == 2
    for grad in grads:
        assert grad.dtype == torch.bfloat16
        assert torch.equal(grad, torch.full_like(grad, 1.0 + 2.0 ** -5))
    # K and V in bf16, their two accumulators in fp32.
    elements = 4 * 2 * 8
    assert store.nbytes() == 2 * elements * 2 + 2 * elements * 4


def test_the_slice_backward_receives_the_summed_gradient():
    store, source = _recorded(torch.float32)
    (key, value), = store.context("doc", 1, 1)
    torch.autograd.backward([key, value], [torch.full_like(key, 3.0), torch.ones_like(value)])
    torch.autograd.backward([key], [torch.ones_like(key)])
    tensors, grads = store.backward_targets("doc", 0)
    torch.autograd.backward(tensors, grads)
    # K = source, V = 2 source: 3 + 1 from K, 2 x 1 from V.
    assert torch.equal(source.grad, torch.full_like(source, 6.0))
    store.release("doc", 0)
    assert len(store) == 0 and store.nbytes() == 0


def test_accumulators_are_at_least_fp32():
    assert accumulator_dtype(torch.bfloat16) == torch.float32
    assert accumulator_dtype(torch.float16) == torch.float32
    assert accumulator_dtype(torch.float64) == torch.float64
