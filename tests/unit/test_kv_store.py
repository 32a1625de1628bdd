"""``megatron.plugin.layers.kv_store``: context gradients summed in fp32 and rounded once; the
bytes a slice's K/V hold with and without a graph, and after a recomputation."""
import weakref

import torch

from megatron.plugin.layers.kv_store import KVStore, accumulator_dtype
from megatron.plugin.layers.memory import SavedTensorMeter, storage_key


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


def _qkv(tokens, hidden, requires_grad):
    """K and V as views of one fused ``[tokens, 1, 3 hidden]`` projection output."""
    qkv = torch.randn(tokens, 1, 3 * hidden, requires_grad=requires_grad) * 1
    return qkv, qkv[:, 0, hidden:2 * hidden], qkv[:, 0, 2 * hidden:]


def test_without_a_graph_the_store_holds_k_and_v_only():
    """A checkpointed forward's K/V are views of the QKV output; the store copies them, so it
    holds 2h elements a token (the meter's count) and not the projection's output with Q."""
    tokens, hidden = 6, 8
    meter, store = SavedTensorMeter(), KVStore()
    with meter.active(), torch.no_grad():
        qkv, key, value = _qkv(tokens, hidden, requires_grad=False)
        store.record("doc", 0, 1, key, value)
        stored_key, stored_value = store.context("doc", 1, 1)[0]
        assert meter.current == 2 * tokens * hidden * 4
    for stored, view in ((stored_key, key), (stored_value, value)):
        assert storage_key(stored) != storage_key(qkv) and torch.equal(stored, view)


def test_with_a_graph_the_store_adds_no_bytes():
    """Recorded with their graph, K/V stay views of the QKV output the attention saves."""
    store = KVStore()
    qkv, key, value = _qkv(6, 8, requires_grad=True)
    store.record("doc", 0, 1, key, value)
    stored_key, stored_value = store.context("doc", 1, 1)[0]
    assert storage_key(stored_key) == storage_key(stored_value) == storage_key(qkv)


def test_a_recomputation_frees_the_first_forwards_kv():
    """Re-recording moves the leaves onto the recomputed K/V: the first forward's copies are
    dropped, not kept beside them until the slice's release; gradients still reach the
    recomputed graph through the sums."""
    tokens, hidden = 6, 8
    meter, store = SavedTensorMeter(), KVStore()
    with meter.active():
        with torch.no_grad():
            _, key, value = _qkv(tokens, hidden, requires_grad=False)
            store.record("doc", 0, 1, key, value)
        leaf_key, leaf_value = store.context("doc", 1, 1)[0]
        first = weakref.ref(leaf_key.untyped_storage())
        torch.autograd.backward([leaf_key, leaf_value], [torch.ones_like(leaf_key)] * 2)
        del key, value
        qkv, key2, value2 = _qkv(tokens, hidden, requires_grad=True)
        store.record("doc", 0, 1, key2, value2)
    assert first() is None
    assert storage_key(leaf_key) == storage_key(leaf_value) == storage_key(qkv)
    assert meter.current == qkv.numel() * 4 + 2 * tokens * hidden * 4
    tensors, grads = store.backward_targets("doc", 0)
    assert [t is k for t, k in zip(tensors, (key2, value2))] == [True, True]
