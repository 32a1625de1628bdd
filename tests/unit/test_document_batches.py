"""Whole documents of a packed row in one kernel call
(``megatron.plugin.layers.document_batches`` through ``packed_attention``): output and every
gradient equal the per-document loop's, with several documents per row, grouped-query heads,
context segments among them, in fp64, fp32 and bf16; the calls made are one per length class
(one per row of equal documents); the CUDA kernels' paths on a GPU.

Tolerances: fp64 1e-12 (the same sums in another blocking); fp32 1e-5 (the kernel's online
softmax splits a padded document's keys at other places); bf16 1e-2 absolute and relative
(unit-scale inputs, 8 mantissa bits: a kernel's bf16 output rounded once either way).
"""
import pytest
import torch

from megatron.plugin.layers import attention_kernels, packed_attention
from megatron.plugin.layers.attention_kernels import CpuFlash, CudaEfficient, CudaFlash
from megatron.plugin.layers.layout import Segment, document_segments

HEADS, DIM = 4, 16
CUDA = torch.cuda.is_available()
TOLERANCES = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _one_by_one(kernel_type):
    """``kernel_type`` forced to one call per document (the loop)."""
    return _with(kernel_type, None)


def _with(kernel_type, together):
    """``kernel_type`` attending runs of documents as ``together`` says."""
    return type(f"{kernel_type.__name__}{together}", (kernel_type,), {"together": together})


class _Counting:
    """Counts the calls of a kernel's forward (and of its variable-length forward)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []
        self.together = kernel.together

    def forward(self, q, k, v, causal):
        self.calls.append(("block", q.shape[0], q.shape[2]))
        return self.kernel.forward(q, k, v, causal)

    def backward(self, *args):
        return self.kernel.backward(*args)


def _rows(rows, groups, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = sum(rows[0])
    make = lambda h: torch.randn(seq, len(rows), h, DIM, generator=g).to(device, dtype) \
        .requires_grad_()
    return make(HEADS), make(groups), make(groups)


def _run(kernel, segments, q, k, v, contexts=None):
    """Output and the gradients of q, k, v and every context block."""
    flat = [t for row in contexts for blocks in row for pair in blocks for t in pair] \
        if contexts else []
    out = packed_attention._PackedAttention.apply(segments, kernel, contexts, q, k, v, *flat)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    return out, torch.autograd.grad(out, (q, k, v, *flat), grad)


def _assert_same(got, expected, dtype):
    tol = TOLERANCES[dtype]
    (out, grads), (ref_out, ref_grads) = got, expected
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"gradient {i}")


ROWS = [pytest.param([[128] * 6], id="equal"),
        pytest.param([[9, 9, 9, 4, 4, 30]], id="stretches"),
        pytest.param([[5, 1, 9, 3, 17, 2], [7, 7, 4, 9, 3, 7]], id="mixed-two-rows"),
        pytest.param([[40, 3, 64, 1, 12, 33]], id="classes")]


@pytest.mark.parametrize("together", ["equal", "padded"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [HEADS, 2])
@pytest.mark.parametrize("rows", ROWS)
def test_documents_together_equal_the_loop(rows, groups, dtype, together):
    """The CPU flash kernel's own way (stretches of equal documents) and the padded batches
    (the CUDA memory-efficient kernel's way, here through the CPU kernel)."""
    q, k, v = _rows(rows, groups, "cpu", dtype)
    segments = tuple(document_segments(r) for r in rows)
    got = _run(_with(CpuFlash, together)(0.0, None), segments, q, k, v)
    expected = _run(_one_by_one(CpuFlash)(0.0, None), segments, q, k, v)
    _assert_same(got, expected, dtype)


def test_documents_do_not_attend_across_boundaries():
    """A document's output and gradients do not depend on its neighbours'."""
    rows = [[9, 20, 7]]
    q, k, v = _rows(rows, 2, "cpu", torch.float64)
    segments = (document_segments(rows[0]),)
    out, _ = _run(CpuFlash(0.0, None), segments, q, k, v)
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[:9] += 1.0
        t[29:] -= 2.0
    again, _ = _run(CpuFlash(0.0, None), segments, *(t.requires_grad_() for t in changed))
    torch.testing.assert_close(again[9:29], out[9:29], rtol=0, atol=1e-12)
    assert not torch.allclose(again[:9], out[:9])


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_segments_with_context_keep_the_loop(groups):
    """A row ``[doc, doc, slice with context, doc, doc, doc]``: each run of two or more whole
    documents is one call, the slice attends over its context blocks; the context blocks'
    gradients too equal the loop's."""
    lengths = [6, 11, 8, 5, 13, 4]
    q, k, v = _rows([lengths], groups, "cpu", torch.float64)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    row = tuple(Segment(a, a + n, "doc" if i == 2 else None, 1 if i == 2 else 0)
                for i, (a, n) in enumerate(zip(starts, lengths)))
    g = torch.Generator().manual_seed(3)
    block = lambda n: torch.randn(n, groups, DIM, generator=g, dtype=torch.float64) \
        .requires_grad_()
    contexts = [[[], [], [(block(10), block(10)), (block(3), block(3))], [], [], []]]
    kernel = _Counting(_with(CpuFlash, "padded")(0.0, None))
    got = _run(kernel, (row,), q, k, v, contexts)
    expected = _run(_one_by_one(CpuFlash)(0.0, None), (row,), q, k, v, contexts)
    _assert_same(got, expected, torch.float64)
    # [6, 11] (length classes up to 8 and up to 16: two batches), the slice's two context
    # blocks and its own keys, then [5, 13, 4] (up to 4, 8 and 16: three batches).
    assert [(n, t) for _, n, t in kernel.calls] == [(1, 6), (1, 11), (1, 8), (1, 8), (1, 8),
                                                    (1, 4), (1, 5), (1, 13)]


@pytest.mark.parametrize("together,calls", [
    ("equal", [(32, 128), (2, 50), (1, 70), (1, 60)]),
    ("padded", [(3, 60), (33, 128)])])
def test_calls_per_row(together, calls):
    """32 documents of 128 tokens, two of 50, one of 70, one of 60: the CPU flash kernel's
    stretches of equal documents (one call for the 32), or the length classes up to 64 and up
    to 128 tokens padded."""
    lengths = [128] * 32 + [50, 50, 70, 60]
    q, k, v = _rows([lengths], HEADS, "cpu", torch.float32)
    kernel = _Counting(_with(CpuFlash, together)(0.0, None))
    _run(kernel, (document_segments(lengths),), q, k, v)
    assert [(n, t) for _, n, t in kernel.calls] == calls


class _VarlenOnCpu(CudaFlash):
    """:meth:`CudaFlash.forward_varlen`'s contract served on the CPU (no CUDA kernel runs):
    ``[T, heads, dim]`` inputs with fewer key/value heads taken as they are, the output
    ``[T, heads, dim]``, the log-sum-exp ``[heads, T]``, the key/value gradients per group;
    each document by the CPU flash kernel. Records each call's bounds."""

    def __init__(self, dropout, scale):
        super().__init__(dropout, scale)
        self.cpu, self.calls = CpuFlash(dropout, scale), []

    def _each(self, bounds):
        bounds = bounds.tolist()
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def forward_varlen(self, q, k, v, bounds, longest):
        self.calls.append((bounds.tolist(), longest))
        outs, lses = [], []
        for rows in self._each(bounds):
            repeat = q.shape[1] // k.shape[1]
            o, lse, _ = self.cpu.forward(*(attention_kernels.heads_first(
                t[rows].repeat_interleave(r, dim=1)) for t, r in ((q, 1), (k, repeat),
                                                                  (v, repeat))), True)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=1), "state"

    def backward_varlen(self, grad, q, k, v, out, lse, bounds, longest, state):
        assert state == "state" and lse.is_contiguous() and lse.shape == q.shape[1::-1]
        grads = []
        repeat = q.shape[1] // k.shape[1]
        for rows in self._each(bounds):
            first = [attention_kernels.heads_first(t[rows].repeat_interleave(r, dim=1))
                     for t, r in ((grad, 1), (q, 1), (k, repeat), (v, repeat), (out, 1))]
            g = self.cpu.backward(*first, lse[None, :, rows], True, None)
            grads.append([g[0][0].transpose(0, 1)] + [
                x[0].view(k.shape[1], repeat, *x.shape[2:]).sum(1).transpose(0, 1)
                for x in g[1:]])
        return tuple(torch.cat(parts) for parts in zip(*grads))


@pytest.mark.parametrize("groups", [HEADS, 2])
def test_the_varlen_path_takes_each_row_in_one_call(groups):
    """The CUDA flash kernel's path (its variable-length operator stood in for on the CPU):
    one call per row with the documents' bounds and the longest, output and gradients the
    loop's."""
    rows = [[5, 1, 9, 3, 17, 2], [7, 7, 4, 9, 3, 7]]
    q, k, v = _rows(rows, groups, "cpu", torch.float64)
    segments = tuple(document_segments(r) for r in rows)
    kernel = _VarlenOnCpu(0.0, None)
    got = _run(kernel, segments, q, k, v)
    assert kernel.calls == [([0, 5, 6, 15, 18, 35, 37], 17), ([0, 7, 14, 18, 27, 30, 37], 9)]
    expected = _run(_one_by_one(CpuFlash)(0.0, None), segments, q, k, v)
    _assert_same(got, expected, torch.float64)


@pytest.mark.skipif(not CUDA, reason="torch's CUDA flash and memory-efficient operators need a "
                                     "CUDA device")
@pytest.mark.parametrize("kernel_type,dtype", [(CudaFlash, torch.bfloat16),
                                               (CudaEfficient, torch.float32)])
@pytest.mark.parametrize("groups", [HEADS, 2])
def test_cuda_documents_together_equal_the_loop(kernel_type, dtype, groups):
    """On a GPU: the flash operator's variable-length call (bf16) and the memory-efficient
    operator's padded batches (fp32) against the same kernel one document at a time."""
    rows = [[40, 3, 64, 1, 12, 8], [64, 32, 16, 8, 4, 4]]
    q, k, v = _rows(rows, groups, "cuda", dtype)
    segments = tuple(document_segments(r) for r in rows)
    got = _run(kernel_type(0.0, None), segments, q, k, v)
    expected = _run(_one_by_one(kernel_type)(0.0, None), segments, q, k, v)
    _assert_same(got, expected, dtype)
