"""Megatron-LM's attention flags in the document attention: ``--attention-softmax-in-fp32``
and ``--apply-query-key-layer-scaling`` (a fact of every kernel), ``--attention-backend`` (the
kernel chosen) and ``--deterministic-mode`` (repeatable losses and gradients)."""
import argparse
import contextlib
import math

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.plugin import arguments, model
from megatron.plugin.layers import attention, context_attention, packed_attention
from megatron.plugin.layers.attention import DocumentAttention
from megatron.plugin.layers.attention_kernels import (CpuFlash, CpuMath, CudaEfficient,
                                                      CudaFlash, block_kernel)
from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.layers.layout import PackedDocuments, Segment, document_segments

HEADS, DIM = 4, 8
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "255", "--mock-data",
        "--calculate-per-token-loss", "--pipeline-model-parallel-size", "2"]


def _block(tokens, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, HEADS, tokens, DIM, generator=g) * scale).to(torch.bfloat16)
            for _ in range(3)]


def _reference(q, blocks, softmax_dtype, layer=1):
    """Attention of ``q`` over ``blocks`` (``(k, v, causal)``, earlier first) with the scores
    and softmax in ``softmax_dtype``; Megatron's query-key layer scaling with ``layer > 1``
    (scores divided by the layer number, multiplied back inside the softmax)."""
    keys = torch.cat([k for k, _, _ in blocks], dim=2).to(softmax_dtype)
    values = torch.cat([v for _, v, _ in blocks], dim=2).to(softmax_dtype)
    s, c = q.shape[2], keys.shape[2] - q.shape[2]
    scores = torch.matmul(q.to(softmax_dtype), keys.transpose(-1, -2)) \
        / (math.sqrt(DIM) * layer)
    mask = torch.ones(s, c + s, dtype=torch.bool).triu(c + 1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")) * layer, dim=-1)
    return torch.matmul(probs, values).to(torch.bfloat16)


@pytest.mark.parametrize("backend,dropout", [("auto", 0.0), ("unfused", 0.0)])
def test_softmax_is_fp32_for_half_precision_inputs(backend, dropout):
    """``--attention-softmax-in-fp32`` (and ``--apply-query-key-layer-scaling``, which sets it
    in Megatron-LM): with bf16 inputs whose scores are large, a segment after two context
    blocks (the log-sum-exp merge) matches the fp32-softmax reference to bf16 rounding, its
    log-sum-exp is fp32, and a bf16 softmax would be far off; Megatron's layer scaling gives
    the same fp32 reference."""
    q, k, v = _block(16, 0, scale=4.0)
    context = [_block(8, seed, scale=4.0)[1:] for seed in (1, 2)]
    blocks = [(ck, cv, False) for ck, cv in context] + [(k, v, True)]
    kernel = block_kernel(q, dropout, None, backend)
    assert isinstance(kernel, CpuFlash if backend == "auto" else CpuMath)
    out, lse, _ = context_attention.merged_forward(kernel, q, blocks)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    fp32 = _reference(q, blocks, torch.float32).float()
    bf16 = _reference(q, blocks, torch.bfloat16).float()
    scaled = _reference(q, blocks, torch.float32, layer=7).float()
    # Two bf16 steps (2**-7 relative each), and a floor near zero: each block's output is
    # rounded to bf16 as the kernels return it before the fp32 merge, and the merged output.
    tolerance = 2.0 ** -6 * fp32.abs() + 2.0 ** -9
    assert ((out.float() - fp32).abs() <= tolerance).all()
    assert ((scaled - fp32).abs() <= tolerance).all()
    assert ((bf16 - fp32).abs() / tolerance).max() > 10


class _CudaLike:
    """A query as :func:`block_kernel` sees it on a GPU (no kernel runs)."""

    is_cuda = True

    def __init__(self, dtype):
        self.dtype = dtype
        self.device = torch.device("cuda")


CUDA_KERNELS = {
    ("auto", torch.bfloat16): CudaFlash, ("auto", torch.float32): CudaEfficient,
    ("flash", torch.bfloat16): CudaFlash, ("flash", torch.float16): CudaFlash,
    ("fused", torch.bfloat16): CudaEfficient, ("fused", torch.float32): CudaEfficient,
    ("unfused", torch.bfloat16): CpuMath, ("unfused", torch.float32): CpuMath,
}


def _config(backend=AttnBackend.auto):
    return TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                             attention_dropout=0.0, hidden_dropout=0.0, attention_backend=backend)


def _parsed_config(monkeypatch, *flags):
    """The model config training builds from ``flags`` (Megatron-LM's parser and
    ``validate_args``, then :func:`megatron.plugin.model.model_config`)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    return model.model_config(arguments.parse([*BASE, *flags]))


def test_attention_backend_picks_the_kernel(monkeypatch):
    """``--attention-backend``: on CUDA flash -> torch's flash operator, fused -> its
    memory-efficient one, unfused -> the matrix products (flash in fp32 is an error); on CPU
    every value but unfused runs the CPU flash kernel (the matrix products with dropout).
    The layer hands its config's value to the kernel choice, and only ``auto`` and ``flash``
    rows go to flash-attn; ``local`` and flash in fp32 on a GPU are refused at start-up."""
    for (backend, dtype), kind in CUDA_KERNELS.items():
        assert type(block_kernel(_CudaLike(dtype), 0.1, None, backend)) is kind, backend
    with pytest.raises(ValueError, match="--attention-backend flash takes fp16 or bf16"):
        block_kernel(_CudaLike(torch.float32), 0.0, None, "flash")
    cpu = torch.zeros(1, HEADS, 4, DIM)
    for backend in ("auto", "flash", "fused"):
        assert type(block_kernel(cpu, 0.0, None, backend)) is CpuFlash
        assert type(block_kernel(cpu, 0.1, None, backend)) is CpuMath
    assert type(block_kernel(cpu, 0.0, None, "unfused")) is CpuMath

    chosen, varlen = [], []
    real = packed_attention.block_kernel
    monkeypatch.setattr(packed_attention, "block_kernel",
                        lambda q, dropout, scale, backend: chosen.append(backend)
                        or real(q, dropout, scale, backend))
    monkeypatch.setattr(attention, "flash_usable", lambda x: True)
    monkeypatch.setattr(attention, "flash_attn_varlen_func",
                        lambda q, *args, **kwargs: varlen.append(kwargs) or torch.zeros_like(q))
    q = torch.randn(6, 1, HEADS, DIM)
    layout = PackedDocuments(segments=(document_segments([2, 4]),))
    for backend in AttnBackend:
        if backend is not AttnBackend.local:
            DocumentAttention(_config(backend), layer_number=1)(q, q, q, packed_seq_params=layout)
    assert chosen == ["fused", "unfused"] and len(varlen) == 2
    chosen.clear()
    parsed = _parsed_config(monkeypatch, "--attention-backend", "fused", "--attention-dropout", "0")
    DocumentAttention(parsed, layer_number=1)(q, q, q, packed_seq_params=layout)
    assert chosen == ["fused"] and len(varlen) == 2

    with pytest.raises(ValueError, match="--attention-backend local is not supported .* use "
                                         "--attention-backend unfused"):
        arguments.check_command_line([*BASE, "--attention-backend", "local"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "add --bf16 or --fp16" in arguments._flash_precision(_namespace(AttnBackend.flash))
    assert arguments._flash_precision(_namespace(AttnBackend.flash, bf16=True)) is None
    assert arguments._flash_precision(_namespace(AttnBackend.fused)) is None


def _namespace(backend, bf16=False):
    return argparse.Namespace(attention_backend=backend, bf16=bf16, fp16=False)


def _sliced_run(config, seed):
    """``(loss, q/k/v gradients)`` of a 20-token document cut in three slices, each later slice
    attending to the earlier ones' K/V through the store, the backward in reverse slice order
    (as the elastic schedules run it), with ``config``'s attention dropout drawn from
    ``seed``."""
    torch.manual_seed(seed)
    attn = DocumentAttention(config, layer_number=1)
    attn.dropout_rng = contextlib.nullcontext
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, 1, HEADS, DIM, generator=g) for _ in range(3))
    weight = torch.randn(20, 1, HEADS * DIM, generator=g)
    store, outs, leaves, cuts = KVStore(), [], [], (0, 7, 12, 20)
    for index, (a, b) in enumerate(zip(cuts, cuts[1:])):
        sq, sk, sv = (t[a:b].clone().requires_grad_() for t in (q, k, v))
        layout = PackedDocuments(segments=((Segment(0, b - a, "doc", index),),),
                                 position_ids=torch.arange(a, b).unsqueeze(0),
                                 kv_store=store, record_kv=True)
        outs.append(attn(sq, sk, sv, packed_seq_params=layout) * weight[a:b])
        leaves.append((sq, sk, sv))
    loss = sum(out.sum() for out in outs)
    for index in reversed(range(len(outs))):
        extra, extra_grads = store.backward_targets("doc", index)
        torch.autograd.backward([outs[index].sum(), *extra], [None, *extra_grads])
        store.release("doc", index)
    return loss.detach(), [torch.cat([leaf[i].grad for leaf in leaves]) for i in range(3)]


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_deterministic_mode_repeats_losses_and_grads_bitwise(dropout, monkeypatch):
    """``--deterministic-mode`` as training parses it (Megatron-LM's ``validate_args`` applies
    its own switch, ``apply_determinism_to_args``: its environment and
    ``torch.use_deterministic_algorithms``; on megatron-core 0.17 ``validate_args`` calls the
    latter itself): torch's deterministic algorithms are on and the model config asks for
    determinism; a sliced document with K/V context, under Megatron's default attention dropout
    (0.1: the matrix-product kernel) and without (the CPU flash kernel), gives bitwise the same
    loss and gradients on two runs from one seed (and another loss from another seed, with
    dropout); flash-attn rows are asked for flash-attn's deterministic backward."""
    try:
        from megatron.training import determinism
    except ImportError:  # megatron-core 0.17: no environment of its own; its validate_args
        determinism = None  # requires the user's NCCL_ALGO to be a deterministic choice
        monkeypatch.setenv("NCCL_ALGO", "Ring")
    for name in getattr(determinism, "DETERMINISM_ENV_VAR_DEFAULTS", ()):
        monkeypatch.setenv(name, "")  # restored (or removed again) after the test
        monkeypatch.delenv(name)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(False)
        config = _parsed_config(monkeypatch, "--deterministic-mode",
                                "--attention-dropout", str(dropout))
        assert torch.are_deterministic_algorithms_enabled() and config.deterministic_mode
        loss, grads = _sliced_run(config, seed=5)
        again, grads_again = _sliced_run(config, seed=5)
        assert torch.equal(loss, again)
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_again))
        if dropout:
            assert not torch.equal(loss, _sliced_run(config, seed=6)[0])

        varlen = []
        monkeypatch.setattr(attention, "flash_usable", lambda x: True)
        monkeypatch.setattr(attention, "flash_attn_varlen_func",
                            lambda q, *args, **kwargs: varlen.append(kwargs)
                            or torch.zeros_like(q))
        q = torch.randn(6, 1, HEADS, DIM)
        flash = DocumentAttention(config, layer_number=1)
        flash.dropout_rng = contextlib.nullcontext
        flash(q, q, q)
        torch.use_deterministic_algorithms(False)
        DocumentAttention(_config(), layer_number=1)(q, q, q)
        assert [call["deterministic"] for call in varlen] == [True, False]
    finally:
        torch.use_deterministic_algorithms(before)
