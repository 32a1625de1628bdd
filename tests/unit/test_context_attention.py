"""Blockwise attention over K/V context (``megatron.plugin.layers.context_attention`` through
``packed_attention``): every block kernel against full attention over the concatenated keys,
dropout drawn again in backward, and saved bytes that do not grow with the context.

Tolerances: fp64 on CPU 1e-10 (the merge is exact up to rounding); fp32 on CUDA 2e-5 (the
memory-efficient kernel accumulates in fp32); bf16 on CUDA 2e-2 absolute and relative on unit-
scale inputs (8 mantissa bits; the reference runs in fp32 on the same bf16 inputs).
"""
import contextlib

import pytest
import torch

from megatron.plugin.layers import attention_kernels, packed_attention
from megatron.plugin.layers.attention import DocumentAttention
from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.layers.layout import PackedDocuments, Segment
from megatron.plugin.layers.memory import SavedTensorMeter

HEADS, DIM = 4, 16
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="the CUDA kernels need a CUDA device")

KERNELS = [
    pytest.param(attention_kernels.CpuFlash, "cpu", torch.float64, 1e-10, id="cpu-flash-fp64"),
    pytest.param(attention_kernels.CpuMath, "cpu", torch.float64, 1e-10, id="cpu-math-fp64"),
    pytest.param(attention_kernels.CudaEfficient, "cuda", torch.float32, 2e-5,
                 id="cuda-efficient-fp32", marks=needs_cuda),
    pytest.param(attention_kernels.CudaFlash, "cuda", torch.bfloat16, 2e-2,
                 id="cuda-flash-bf16", marks=needs_cuda),
]


def tensors(lengths, groups, device, dtype, seed=0):
    """Query ``[s, HEADS, DIM]`` and ``(k, v)`` pairs ``[n, groups, DIM]`` for each length (the
    last pair is the slice's own, as long as the query), all leaves."""
    g = torch.Generator().manual_seed(seed)
    make = lambda n, h: torch.randn(n, h, DIM, generator=g).to(device, dtype).requires_grad_()
    query = make(lengths[-1], HEADS)
    return query, [(make(n, groups), make(n, groups)) for n in lengths]


def reference(query, pairs, scale=None):
    """Full attention in fp32 (fp64 for fp64 inputs) over the concatenated keys, causal on the
    slice's own keys (aligned to the end), grouped heads expanded."""
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    k = torch.cat([k for k, _ in pairs]).to(work)
    v = torch.cat([v for _, v in pairs]).to(work)
    s, total = query.shape[0], k.shape[0]
    repeat = HEADS // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    mask = torch.arange(total, device=k.device)[None] <= \
        torch.arange(s, device=k.device)[:, None] + total - s
    out = torch.nn.functional.scaled_dot_product_attention(
        query.to(work).transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        scale=scale)
    return out.transpose(0, 1)


def blockwise(kernel, query, pairs):
    """The merged attention through ``kernel`` (``[s, HEADS, DIM]``): one row holding one
    segment whose context is every pair but the last."""
    (key, value), context = pairs[-1], pairs[:-1]
    tokens = query.shape[0]
    flat = [t for pair in context for t in pair]
    out = packed_attention._PackedAttention.apply(
        ((Segment(0, tokens),),), kernel, [[list(context)]], query[:, None], key[:, None],
        value[:, None], *flat)
    return out.view(tokens, HEADS, DIM)


@pytest.mark.parametrize("kernel_type,device,dtype,tol", KERNELS)
@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("lengths", [[24], [40, 24], [8, 40, 16, 24], [64, 32]])
def test_blocks_merged_equal_full_attention(kernel_type, device, dtype, tol, groups, lengths):
    """Output and every gradient (query, own K/V, each context block's K/V)."""
    query, pairs = tensors(lengths, groups, device, dtype)
    leaves = [query] + [t for pair in pairs for t in pair]
    grad = torch.randn(lengths[-1], HEADS, DIM, generator=torch.Generator().manual_seed(9))
    grad = grad.to(device, dtype)
    got = blockwise(kernel_type(0.0, None), query, pairs)
    got_grads = torch.autograd.grad(got, leaves, grad)
    expected = reference(query, pairs)
    expected_grads = torch.autograd.grad(expected, leaves, grad.to(expected.dtype))
    torch.testing.assert_close(got.to(expected.dtype), expected, rtol=tol, atol=tol)
    for name, a, b in zip(range(len(leaves)), got_grads, expected_grads):
        torch.testing.assert_close(a.to(b.dtype), b, rtol=tol, atol=tol, msg=f"leaf {name}")


@pytest.mark.parametrize("kernel_type,device,dtype,tol", [
    pytest.param(attention_kernels.CpuMath, "cpu", torch.float64, 1e-10, id="cpu-math-fp64"),
    pytest.param(attention_kernels.CudaEfficient, "cuda", torch.float32, 2e-5,
                 id="cuda-efficient-fp32", marks=needs_cuda),
    pytest.param(attention_kernels.CudaFlash, "cuda", torch.bfloat16, 3e-2,
                 id="cuda-flash-bf16", marks=needs_cuda)])
def test_dropout_is_drawn_again_in_backward(kernel_type, device, dtype, tol):
    """With dropout the output is linear in the values, ``out = A v`` with ``A`` the dropped
    probabilities: feeding the identity as values (same seed) reads ``A`` off, and the value
    gradient must be ``A^T dO`` -- which holds only if backward drew forward's masks. Dropout
    does drop: ``A`` differs from the undropped probabilities."""
    lengths, rate = [DIM // 2, DIM // 2], 0.3
    query, pairs = tensors(lengths, HEADS, device, dtype, seed=3)
    eye = torch.eye(DIM, device=device, dtype=dtype)[:, None, :].expand(DIM, HEADS, DIM)
    identity = [(k, eye[a:a + n].clone().requires_grad_())
                for (k, _), a, n in zip(pairs, (0, lengths[0]), lengths)]
    grad = torch.randn(lengths[-1], HEADS, DIM, generator=torch.Generator().manual_seed(4))
    grad = grad.to(device, dtype)
    torch.manual_seed(11)
    if CUDA:
        torch.cuda.manual_seed(11)
    dropped = blockwise(kernel_type(rate, None), query, identity)  # [s, heads, keys]: A
    torch.manual_seed(11)
    if CUDA:
        torch.cuda.manual_seed(11)
    out = blockwise(kernel_type(rate, None), query, pairs)
    values = [v for _, v in pairs]
    grads = torch.autograd.grad(out, values, grad)
    work = torch.promote_types(dtype, torch.float32)
    a = dropped.detach().to(work).transpose(0, 1)  # [heads, s, keys]
    v_all = torch.cat(values).detach().to(work).transpose(0, 1)  # [heads, keys, dim]
    torch.testing.assert_close(out.detach().to(work).transpose(0, 1), a @ v_all,
                               rtol=tol, atol=tol)
    expected = (a.transpose(1, 2) @ grad.to(work).transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(torch.cat(grads).to(work), expected, rtol=tol, atol=tol)
    undropped = blockwise(kernel_type(0.0, None), query, identity).detach().to(work)
    assert not torch.allclose(undropped.transpose(0, 1), a, atol=0.05)


def _slice_saved_bytes(context_tokens: int, groups: int, dropout: float) -> int:
    """Bytes a slice of 64 tokens saves for backward in one attention layer after
    ``context_tokens`` of context, less the bytes of the context K/V the store holds."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=dropout,
                               hidden_dropout=0.0)
    attn = DocumentAttention(config, layer_number=1).train()
    store = KVStore()
    cut, slice_tokens = context_tokens, 64
    for index, (start, stop) in enumerate(((0, cut), (cut, cut + slice_tokens))):
        n = stop - start
        q = torch.randn(n, 1, HEADS, DIM, requires_grad=True)
        k, v = (torch.randn(n, 1, groups, DIM, requires_grad=True) for _ in range(2))
        layout = PackedDocuments(segments=((Segment(0, n, "doc", index),),),
                                 position_ids=torch.arange(start, stop)[None],
                                 kv_store=store, record_kv=True)
        if index == 0:
            attn(q, k, v, packed_seq_params=layout)
            continue
        meter = SavedTensorMeter()
        with meter.active():
            out = attn(q, k, v, packed_seq_params=layout)
            saved = meter.current
    del out
    context_bytes = 2 * context_tokens * groups * DIM * 4
    return saved - context_bytes


@pytest.mark.parametrize("groups,dropout", [(HEADS, 0.0), (2, 0.0), (HEADS, 0.1), (2, 0.1)],
                         ids=["mha", "gqa", "dropout", "gqa-dropout"])
def test_a_slice_saves_no_more_with_a_longer_context(monkeypatch, groups, dropout):
    """With grouped-query heads and with dropout too, what a slice saves beyond the store's K/V
    is the same after 256 or 4096 tokens of context: no private copy of the context, nor with
    dropout the whole probability matrix. (Where the dropout draws,
    Megatron's RNG tracker, is tests/unit/test_rng_tracker.py's concern.)"""
    monkeypatch.setattr(DocumentAttention, "dropout_rng", lambda self: contextlib.nullcontext())
    short = _slice_saved_bytes(256, groups, dropout)
    long = _slice_saved_bytes(4096, groups, dropout)
    assert long == short
    # q, own k/v, merged output and its log-sum-exp (fp32), at most.
    assert short <= 64 * (HEADS * DIM * 2 + 2 * groups * DIM + HEADS) * 4



def test_a_checkpointed_last_slice_keeps_nothing_until_its_recomputation():
    """A document of 48 tokens in slices of 32 and 16. Run without a graph (a checkpointed
    forward) the first slice is recorded, for the second to read; the second, the document's
    last, is not (no later slice reads it); its recomputation, with a graph, records it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               attention_dropout=0.0, hidden_dropout=0.0)
    attn = DocumentAttention(config, layer_number=1).train()
    store = KVStore()

    def run(index, start, stop):
        n = stop - start
        # a projection's output: with a graph only where autograd records one
        q, k, v = (torch.randn(n, 1, HEADS, DIM, requires_grad=torch.is_grad_enabled())
                   for _ in range(3))
        layout = PackedDocuments(segments=((Segment(0, n, "doc", index, 48),),),
                                 position_ids=torch.arange(start, stop)[None],
                                 kv_store=store, record_kv=True)
        return attn(q, k, v, packed_seq_params=layout)

    with torch.no_grad():
        run(0, 0, 32)
        assert len(store) == 1
        run(1, 32, 48)
        assert len(store) == 1
    run(1, 32, 48)
    assert len(store) == 2
    (key, _), = store.context("doc", 1, 1)
    assert key.shape[0] == 32
