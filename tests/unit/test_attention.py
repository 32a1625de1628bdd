"""DocumentAttention: packing and slicing with K/V context are exact."""
import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin.layers.attention import DocumentAttention, RopeSettings
from megatron.plugin.layers.layout import PackedDocuments, Segment, document_segments
from megatron.plugin.layers.kv_store import KVStore

HEADS, DIM = 4, 8


def make_attention(rope=None, groups=HEADS):
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=0.0, hidden_dropout=0.0)
    return DocumentAttention(config, layer_number=1, rope=rope).eval()


def qkv(tokens, groups=HEADS, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 1, HEADS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tokens, 1, groups, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tokens, 1, groups, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("rope", [None, RopeSettings()])
@pytest.mark.parametrize("groups", [HEADS, 2])
def test_packed_documents_equal_separate_documents(rope, groups):
    attn = make_attention(rope, groups)
    lengths = [5, 1, 9, 3]
    q, k, v = qkv(sum(lengths), groups)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    layout = PackedDocuments(segments=(document_segments(lengths),), position_ids=positions)
    packed = attn(q, k, v, packed_seq_params=layout)
    start = 0
    for n in lengths:
        alone = attn(q[start:start + n], k[start:start + n], v[start:start + n])
        torch.testing.assert_close(packed[start:start + n], alone, rtol=0, atol=1e-12)
        start += n


def test_packed_documents_do_not_attend_across_boundaries():
    attn = make_attention()
    q, k, v = qkv(8)
    layout = PackedDocuments(segments=(document_segments([4, 4]),))
    out = attn(q, k, v, packed_seq_params=layout)
    out[4:].sum().backward()
    assert torch.count_nonzero(k.grad[:4]) == 0 and torch.count_nonzero(v.grad[:4]) == 0


@pytest.mark.parametrize("rope", [None, RopeSettings()])
@pytest.mark.parametrize("cuts", [[0, 7, 12, 20], [0, 10, 20], [0, 1, 2, 20]])
def test_slices_with_kv_context_equal_whole_document(rope, cuts):
    """Forward in slice order, backward in reverse order with the stored dK/dV."""
    attn = make_attention(rope)
    total = cuts[-1]
    q, k, v = qkv(total, seed=1)
    grad_out = torch.randn(total, 1, HEADS * DIM, dtype=torch.float64)
    whole = attn(q, k, v, packed_seq_params=PackedDocuments(
        segments=((Segment(0, total),),), position_ids=torch.arange(total).unsqueeze(0)))
    whole_grads = torch.autograd.grad(whole, (q, k, v), grad_out)

    store = KVStore()
    outs, leaves = [], []
    for index, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sq, sk, sv = (t[a:b].detach().requires_grad_() for t in (q, k, v))
        layout = PackedDocuments(segments=((Segment(0, b - a, "doc", index),),),
                                 position_ids=torch.arange(a, b).unsqueeze(0),
                                 kv_store=store, record_kv=True)
        outs.append(attn(sq, sk, sv, packed_seq_params=layout))
        leaves.append((sq, sk, sv))
    torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-12, atol=1e-12)
    for index in reversed(range(len(outs))):
        a, b = cuts[index], cuts[index + 1]
        extra, extra_grads = store.backward_targets("doc", index)
        torch.autograd.backward([outs[index], *extra], [grad_out[a:b], *extra_grads])
        store.release("doc", index)
    assert len(store) == 0
    for i, name in enumerate("qkv"):
        sliced = torch.cat([leaf[i].grad for leaf in leaves])
        torch.testing.assert_close(sliced, whole_grads[i], rtol=1e-10, atol=1e-12, msg=name)


def test_rope_uses_true_positions():
    attn = make_attention(RopeSettings())
    q, k, v = qkv(6)
    shifted = attn(q, k, v, packed_seq_params=PackedDocuments(
        segments=((Segment(0, 6),),), position_ids=torch.arange(10, 16).unsqueeze(0)))
    plain = attn(q, k, v)
    # RoPE is relative: shifting every position of a document leaves attention unchanged
    # (up to the float32 rotary table) ...
    torch.testing.assert_close(shifted, plain, rtol=1e-5, atol=1e-6)
    # ... but positions inside the document matter.
    moved = attn(q, k, v, packed_seq_params=PackedDocuments(
        segments=((Segment(0, 6),),), position_ids=torch.tensor([[0, 1, 2, 30, 31, 32]])))
    assert not torch.allclose(moved, plain)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_rope_is_megatrons_rotation(interleaved, percent, monkeypatch):
    """The document attention rotates Q and K as Megatron's GPT does (its ``RotaryEmbedding``
    table and ``apply_rotary_pos_emb``), interleaved channel pairs (``--rotary-interleaved``)
    and partial rotation included, then attends causally."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               rotary_interleaved=interleaved, apply_rope_fusion=False)
    attn = DocumentAttention(config, layer_number=1,
                             rope=RopeSettings(rotary_percent=percent)).eval()
    tokens = 9
    q, k, v = qkv(tokens, seed=2)
    ours = attn(q, k, v)

    # Megatron's table moves itself to the current CUDA device; here that is the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    table = RotaryEmbedding(kv_channels=DIM, rotary_percent=percent,
                            rotary_interleaved=interleaved, use_cpu_initialization=True)
    freqs = table.get_emb(tokens)
    # Megatron's unfused rotation of [s, b, heads, dim] tensors reads no process group.
    rq, rk = (apply_rotary_pos_emb(t, freqs, config, cp_group=object()) for t in (q, k))
    heads_first = [t.permute(1, 2, 0, 3) for t in (rq, rk, v)]
    reference = torch.nn.functional.scaled_dot_product_attention(*heads_first, is_causal=True)
    reference = reference.permute(2, 0, 1, 3).reshape(tokens, 1, HEADS * DIM)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=1e-12)


def test_missing_context_is_an_error():
    attn = make_attention()
    q, k, v = qkv(4)
    layout = PackedDocuments(segments=((Segment(0, 4, "doc", 1),),), kv_store=KVStore())
    with pytest.raises(KeyError, match="slices must run their forward in order"):
        attn(q, k, v, packed_seq_params=layout)


def test_packed_documents_keep_one_output_buffer():
    """Documents without context save q, k, v, one ``[s, b, h]`` output and the log-sum-exp;
    the output projection saving that output as its input adds nothing."""
    from megatron.plugin.layers.memory import SavedTensorMeter

    attn = make_attention()
    lengths = [5, 12, 7]
    layout = PackedDocuments(segments=(document_segments(lengths),),
                             position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    q, k, v = qkv(sum(lengths))
    weight = torch.nn.Parameter(torch.randn(HEADS * DIM, HEADS * DIM, dtype=torch.float64))
    meter = SavedTensorMeter()
    with meter.active():
        projected = attn(q, k, v, packed_seq_params=layout) @ weight
        saved = meter.current
    assert projected.requires_grad
    tokens, item = sum(lengths), 8
    assert saved == 3 * tokens * HEADS * DIM * item + tokens * HEADS * DIM * item \
        + tokens * HEADS * item


def _varlen_reference(calls):
    """Stands in for flash-attn's ``flash_attn_varlen_func`` on the CPU: causal attention of
    each ``cu_seqlens`` sequence (bottom-right aligned), recording every call's bounds."""

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
               causal=True, deterministic=False):
        assert causal and dropout_p == 0.0
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        outs = []
        for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0)
                          for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
            rows = torch.arange(q1 - q0).unsqueeze(1) + (k1 - k0) - (q1 - q0)
            mask = torch.arange(k1 - k0).unsqueeze(0) <= rows
            out = torch.nn.functional.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=softmax_scale,
                enable_gqa=qh.shape[1] != kh.shape[1])
            outs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outs)

    return varlen


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_flash_attn_runs_once_per_packed_row_with_the_documents_as_cu_seqlens(
        monkeypatch, groups):
    """The CUDA path: one varlen call per row, bounded by its documents and padding, equal to
    the per-document SDPA path (flash-attn replaced by a CPU reference of its semantics)."""
    from megatron.plugin.layers import attention

    attn = make_attention(groups=groups)
    rows = [[5, 1, 9, 3], [7, 7, 4]]
    q, k, v = (torch.cat([t, t2], dim=1) for t, t2 in zip(qkv(18, groups), qkv(18, groups, 3)))
    layout = PackedDocuments(segments=tuple(document_segments(r) for r in rows),
                             position_ids=torch.stack([torch.cat([torch.arange(n) for n in r])
                                                       for r in rows]))
    expected = attn(q, k, v, packed_seq_params=layout)
    calls = []
    monkeypatch.setattr(attention, "flash_attn_varlen_func", _varlen_reference(calls))
    monkeypatch.setattr(attention, "flash_usable", lambda x: True)
    got = attn(q, k, v, packed_seq_params=layout)
    assert calls == [([0, 5, 6, 15, 18], [0, 5, 6, 15, 18], 9, 9),
                     ([0, 7, 14, 18], [0, 7, 14, 18], 7, 7)]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_flash_attn_takes_half_precision_only(monkeypatch, caplog):
    """fp32 on CUDA falls back to SDPA with one warning; CPU tensors never go to flash-attn."""
    from megatron.plugin.layers import attention

    class CudaLike:
        is_cuda = True

        def __init__(self, dtype):
            self.dtype = dtype

    monkeypatch.setattr(attention, "flash_attn_varlen_func", object())
    monkeypatch.setattr(attention, "_warned_fp32", [])
    assert attention.flash_usable(CudaLike(torch.bfloat16))
    assert attention.flash_usable(CudaLike(torch.float16))
    with caplog.at_level("WARNING", logger="megatron.plugin.layers.attention"):
        assert not attention.flash_usable(CudaLike(torch.float32))
        assert not attention.flash_usable(CudaLike(torch.float32))
    assert len([r for r in caplog.records if "fp16 or bf16" in r.message]) == 1
    assert not attention.flash_usable(torch.zeros(2, dtype=torch.bfloat16))
