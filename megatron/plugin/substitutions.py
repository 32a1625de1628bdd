"""What runs in place of what an accepted option names, said once at start-up.

An accepted option is honoured (:mod:`megatron.plugin.option_classes`): the loss and gradients
are Megatron-LM's. Some of its values still run something other than what they name in
Megatron-LM: another algorithm with the same result (``--cp-comm-type p2p``, Megatron's ring,
runs Ulysses all-to-all here), or nothing at all on this machine (``--empty-unused-memory-level``
without CUDA's caching allocator). Each such case is one :class:`Substitution` record: the flag,
when it applies (the validated arguments, the device), and what runs instead.
:data:`CORE` holds the records of what every schedule shares (the model, its document
attention, Megatron-LM's loop); a schedule's own are its ``ScheduleSpec.substitutions``
(:mod:`megatron.plugin.schedule_spec`). :func:`lines` evaluates both;
``megatron.plugin.launch`` logs each line once, from rank 0, after Megatron-LM's validation and
the refusals (:func:`megatron.plugin.arguments.substitution_lines`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

#: Where a line starts, as the other start-up lines of the training script.
PREFIX = "pretrain_gpt_elastic.py: "
DEVICES = (None, "cpu", "cuda")


@dataclass(frozen=True)
class Substitution:
    """One option value that runs something other than it names."""

    flag: str
    """The option as typed (``--cp-comm-type``)."""
    applies: Callable[[argparse.Namespace], bool]
    """Whether the validated arguments ask for the substituted value."""
    instead: Callable[[argparse.Namespace], str]
    """What runs instead: a sentence that starts with the flag and its value."""
    device: str | None = None
    """``"cpu"``: only on a machine without CUDA; ``"cuda"``: only with it; ``None``: both."""

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"substitution of {self.flag}: device {self.device!r} is not one of "
                             f"{DEVICES}")


def lines(args: argparse.Namespace, schedule_records=(), cuda: bool | None = None) -> list[str]:
    """The start-up line of every record of :data:`CORE` and ``schedule_records`` that applies
    to ``args`` on this device (``cuda``: whether CUDA is present, asked of torch when
    ``None``), in that order, each distinct line once."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    here = "cuda" if cuda else "cpu"
    said: list[str] = []
    for record in (*CORE, *schedule_records):
        if record.device in (None, here) and record.applies(args):
            line = PREFIX + record.instead(args)
            if line not in said:
                said.append(line)
    return said


def _items(value) -> list:
    """A per-layer option's values (Megatron's ``--cp-comm-type`` takes one or one a layer)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _shown(value) -> str:
    return " ".join(str(item) for item in _items(value))


def _ring_named(args) -> bool:
    return args.context_parallel_size > 1 and any(
        item != "a2a" for item in _items(args.cp_comm_type))


def _ulysses(args) -> str:
    cp = args.context_parallel_size
    return (f"--cp-comm-type {_shown(args.cp_comm_type)} with --context-parallel-size {cp}: "
            f"the document attention exchanges Q, K and V by Ulysses all-to-all (each rank "
            f"attends over whole rows for 1/{cp} of the heads; four all-to-alls per layer), "
            f"not by a ring of K/V exchanges between the ranks' shares of each row: the same "
            f"loss and gradients, other communication and memory; pass --cp-comm-type a2a to "
            f"name what runs")


def _backend(args) -> str:
    backend = getattr(args, "attention_backend", None)
    return backend.name if isinstance(backend, Enum) else str(backend)


def _cpu_kernel(args) -> str:
    backend = _backend(args)
    megatron = "flash-attn's" if backend == "flash" else "a fused"
    kernel = ("torch's fused CPU flash kernel" if not args.attention_dropout else
              f"the matrix-product kernel while training (--attention-dropout "
              f"{args.attention_dropout:g}: the CPU flash kernel draws no dropout), torch's "
              f"fused CPU flash kernel in evaluation")
    return (f"--attention-backend {backend} on a machine without CUDA: the attention runs "
            f"{kernel}, not {megatron} CUDA kernel: the same attention, another kernel")


def _memory_efficient(args) -> str:
    del args
    return ("--attention-backend fused: the document attention runs torch's memory-efficient "
            "CUDA kernel, not Transformer Engine's cuDNN fused attention (Megatron-LM's fused "
            "backend): the same attention, another kernel")


def _no_allocator(args) -> str:
    return (f"--empty-unused-memory-level {args.empty_unused_memory_level} on a machine without "
            f"CUDA: there is no caching allocator to empty, nothing runs")


def _memory_report(args) -> str:
    return (f"--log-memory-interval {args.log_memory_interval} on a machine without CUDA: "
            f"Megatron-LM's memory report reads CUDA's caching allocator, which holds nothing "
            f"here: it reports 0 MB")


def _grad_reduce_in_bf16(args) -> str:
    del args
    return ("--grad-reduce-in-bf16 without --bf16: Megatron-LM reads it only under --bf16, "
            "nothing runs (the gradients are reduced in the dtype they have without it)")


def _layer_scaling(args) -> str:
    del args
    return ("--apply-query-key-layer-scaling: the document attention's kernels compute the "
            "scores and their softmax in fp32 (fp64 for fp64 inputs), so Megatron's scaling "
            "by the layer number around a half-precision product is the identity: nothing runs")


def _half_softmax_named(args) -> bool:
    return (_backend(args) == "unfused" and bool(args.bf16 or args.fp16)
            and not args.attention_softmax_in_fp32)


def _fp32_softmax(args) -> str:
    return (f"--attention-backend unfused under --{'bf16' if args.bf16 else 'fp16'} without "
            f"--attention-softmax-in-fp32: the document attention computes the softmax in fp32 "
            f"(Megatron-LM's unfused attention would compute it in half precision)")


#: The records of what every schedule shares.
CORE = (
    Substitution("--cp-comm-type", _ring_named, _ulysses),
    Substitution("--attention-backend", lambda args: _backend(args) in ("flash", "fused"),
                 _cpu_kernel, device="cpu"),
    Substitution("--attention-backend", lambda args: _backend(args) == "fused",
                 _memory_efficient, device="cuda"),
    Substitution("--empty-unused-memory-level",
                 lambda args: bool(args.empty_unused_memory_level), _no_allocator, device="cpu"),
    Substitution("--log-memory-interval", lambda args: args.log_memory_interval is not None,
                 _memory_report, device="cpu"),
    Substitution("--grad-reduce-in-bf16",
                 lambda args: bool(args.grad_reduce_in_bf16) and not args.bf16,
                 _grad_reduce_in_bf16),
    Substitution("--apply-query-key-layer-scaling",
                 lambda args: bool(args.apply_query_key_layer_scaling), _layer_scaling),
    Substitution("--attention-backend", _half_softmax_named, _fp32_softmax),
)
