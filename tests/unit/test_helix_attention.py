"""``megatron.plugin.layers.packed_attention`` and ``helix.attention``: the same values and
gradients as SDPA per document (RoPE and grouped-query heads included), and only the claimed
tensors saved for backward."""
import pytest
import torch
from megatron.core.transformer import TransformerConfig

from helix.attention import recomputed_attention
from megatron.plugin.layers.attention import DocumentAttention, RopeSettings
from megatron.plugin.layers.layout import PackedDocuments, document_segments
from megatron.plugin.layers.packed_attention import packed_attention, row_segments
from megatron.plugin.layers.memory import SavedTensorMeter

HEADS, DIM = 4, 8
HIDDEN = HEADS * DIM
SEQ, BATCH = 24, 2


def make_core(rope, groups):
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=0.0,
                               hidden_dropout=0.0)
    return DocumentAttention(config, layer_number=1, rope=rope).eval()


def make_layout():
    """Two rows of packed documents, positions restarting per document."""
    rows = [[5, 12, 7], [24]]
    segments = tuple(document_segments(lengths) for lengths in rows)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    return PackedDocuments(segments=segments, position_ids=positions)


def make_project(core, layout, groups, rotate=True):
    """A QKV projection like Megatron's: one matmul, split into heads, then RoPE on q and k
    (``DocumentAttention`` applies RoPE itself, so its inputs are not rotated)."""
    def project(x, weight, bias):
        qkv = torch.nn.functional.linear(x, weight, bias)
        q, k, v = qkv.split([HIDDEN, groups * DIM, groups * DIM], dim=-1)
        q = q.reshape(SEQ, BATCH, HEADS, DIM)
        k = k.reshape(SEQ, BATCH, groups, DIM)
        v = v.reshape(SEQ, BATCH, groups, DIM)
        if rotate:
            q, k = core.rotate(q, k, layout)
        return q, k, v
    return project


def inputs(groups):
    torch.manual_seed(0)
    width = HIDDEN + 2 * groups * DIM
    x = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, requires_grad=True)
    weight = (0.3 * torch.randn(width, HIDDEN, dtype=torch.float64)).requires_grad_()
    bias = torch.randn(width, dtype=torch.float64, requires_grad=True)
    return x, weight, bias, torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)


def per_document_sdpa(q, k, v, layout):
    """The reference: torch SDPA on each document of each row, causal, heads expanded for
    grouped-query K/V; ``[s, b, heads * dim]``."""
    rows = []
    for b in range(q.shape[1]):
        segments = layout.segments[b] if layout is not None else document_segments([SEQ])
        outs = []
        for seg in segments:
            qs, ks, vs = (t[seg.start:seg.stop, b].transpose(0, 1) for t in (q, k, v))
            ks, vs = (t.repeat_interleave(HEADS // t.shape[0], dim=0) for t in (ks, vs))
            out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            outs.append(out.transpose(0, 1).reshape(seg.length, HIDDEN))
        rows.append(torch.cat(outs))
    return torch.stack(rows, dim=1)


def grads_of(tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("rope", [None, RopeSettings()])
@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_matches_sdpa_per_document(rope, groups, recompute):
    core, layout = make_core(rope, groups), make_layout()
    project = make_project(core, layout, groups)
    x, weight, bias, grad = inputs(groups)
    leaves = [x, weight, bias]

    expected = per_document_sdpa(*project(x, weight, bias), layout)
    expected.backward(grad)
    expected_grads = grads_of(leaves)
    if not recompute:  # DocumentAttention (unrotated inputs: it applies RoPE) runs this kernel
        unrotated = make_project(core, layout, groups, rotate=False)
        document = core(*unrotated(x, weight, bias), packed_seq_params=layout)
        torch.testing.assert_close(document, expected, rtol=1e-12, atol=1e-12)

    segments = row_segments(layout, BATCH)
    if recompute:
        out = recomputed_attention(project, x, (weight, bias), segments, None)
    else:
        out = packed_attention(*project(x, weight, bias), segments, None)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.backward(grad)
    for got, want in zip(grads_of(leaves), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_whole_rows_without_layout():
    core = make_core(None, HEADS)
    x, weight, bias, grad = inputs(HEADS)
    project = make_project(core, None, HEADS)
    expected = per_document_sdpa(*project(x, weight, bias), None)
    torch.testing.assert_close(core(*project(x, weight, bias)), expected, rtol=1e-12,
                               atol=1e-12)
    out = packed_attention(*project(x, weight, bias), row_segments(None, BATCH), None)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_segments_must_cover_the_row():
    q = torch.randn(SEQ, 1, HEADS, DIM)
    with pytest.raises(ValueError, match="cover 10 tokens of a 24-token row"):
        packed_attention(q, q, q, (document_segments([4, 6]),), None)


def _saved_bytes(run):
    meter = SavedTensorMeter()
    with meter.active():
        out = run()
        saved = meter.current
    return out, saved


def test_saves_only_what_the_backward_needs():
    """Packed: q, k, v (views of one projection output), the output and the log-sum-exp.
    Recomputed: the input, the weight, the bias, the output and the log-sum-exp, nothing of
    the projection: about 2 x [s, b, h] instead of 5."""
    core, layout = make_core(None, HEADS), make_layout()
    project = make_project(core, layout, HEADS)
    x, weight, bias, _ = inputs(HEADS)
    x = x.detach().float().requires_grad_()
    weight = weight.detach().float().requires_grad_()
    bias = bias.detach().float().requires_grad_()
    segments = row_segments(layout, BATCH)
    item = 4
    activation = SEQ * BATCH * HIDDEN * item
    lse = SEQ * BATCH * HEADS * 4

    def packed():
        qkv = torch.nn.functional.linear(x, weight, bias).detach().requires_grad_()
        q, k, v = qkv.split(HIDDEN, dim=-1)
        return packed_attention(*(t.reshape(SEQ, BATCH, HEADS, DIM) for t in (q, k, v)),
                                segments, None)

    _, saved = _saved_bytes(packed)
    assert saved == 3 * activation + activation + lse
    _, saved = _saved_bytes(lambda: recomputed_attention(project, x, (weight, bias), segments,
                                                         None))
    assert saved == activation + weight.numel() * item + bias.numel() * item + activation + lse


def test_dropout_masks_are_drawn_again_after_the_projection_is_recomputed():
    """With attention dropout, recomputation without attention gives the packed attention's
    values and gradients from the same seed (its backward draws each document's mask again
    from the state its forward kept), saves the same bytes as without dropout, and drops."""
    core, layout = make_core(None, 2), make_layout()
    project = make_project(core, layout, 2)
    segments = row_segments(layout, BATCH)
    results = []
    for recompute, dropout in ((False, 0.2), (True, 0.2), (True, 0.0)):
        x, weight, bias, grad = inputs(2)
        torch.manual_seed(7)
        if recompute:
            out, saved = _saved_bytes(lambda: recomputed_attention(
                project, x, (weight, bias), segments, None, dropout))
        else:
            out = packed_attention(*project(x, weight, bias), segments, None, dropout)
            saved = None
        grads = torch.autograd.grad(out, (x, weight, bias), grad)
        results.append((out, grads, saved))
    (plain, plain_grads, _), (again, again_grads, saved), (undropped, _, undropped_saved) = \
        results
    torch.testing.assert_close(again, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(again_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert saved == undropped_saved
    assert not torch.allclose(again, undropped)
