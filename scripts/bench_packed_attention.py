"""Benchmark: one layer's document attention, forward and backward, over a packed row of whole
documents, each run of documents in one kernel call against one call per document.

    python scripts/bench_packed_attention.py [--documents 32] [--tokens 128] [--heads 4]
        [--groups 4] [--dim 32] [--dtype float32] [--repeats 20] [--device cpu]

Per mode, the ATen operator calls of one forward+backward (counted as ``bench_host.py``
counts them) and its time, the median of ``--repeats``: on the CPU the process's CPU time (what
the host spent, whatever else the machine runs), on CUDA the wall time with the kernels
synchronised. ``per document`` runs the same kernel with
:attr:`~megatron.plugin.layers.attention_kernels.CpuFlash.together` off, i.e. the loop.
"""
import argparse
import statistics
import time

import torch

from bench_host import count_operators
from megatron.plugin.layers import attention_kernels, packed_attention
from megatron.plugin.layers.layout import document_segments


def measure(args, q, k, v, segments) -> tuple[int, float]:
    """``(operator calls, seconds)`` of one forward+backward."""
    grad = torch.randn(q.shape[0], 1, q.shape[2] * q.shape[3], device=q.device, dtype=q.dtype)

    def step():
        out = packed_attention.packed_attention(q, k, v, segments, None)
        torch.autograd.grad(out, (q, k, v), grad)
        if q.is_cuda:
            torch.cuda.synchronize()

    step()
    _, calls = count_operators(step)
    clock = time.perf_counter if q.is_cuda else time.process_time
    seconds = []
    for _ in range(args.repeats):
        start = clock()
        step()
        seconds.append(clock() - start)
    return sum(calls.values()), statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per document")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    seq = args.documents * args.tokens
    q = torch.randn(seq, 1, args.heads, args.dim, device=args.device, dtype=dtype,
                    requires_grad=True)
    k, v = (torch.randn(seq, 1, args.groups, args.dim, device=args.device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    segments = (document_segments([args.tokens] * args.documents),)
    kernel = type(attention_kernels.block_kernel(q, 0.0, None))
    together = kernel.together
    print(f"{args.documents} documents x {args.tokens} tokens, {args.heads} heads "
          f"({args.groups} groups) x {args.dim}, {args.dtype} on {args.device}, "
          f"{kernel.__name__}")
    print(f"{'mode':14} {'ATen calls':>10} {'ms':>8}")
    for mode, value in (("per document", None), ("together", together)):
        kernel.together = value
        calls, seconds = measure(args, q, k, v, segments)
        print(f"{mode:14} {calls:10d} {1000 * seconds:8.2f}")
    kernel.together = together


if __name__ == "__main__":
    main()
