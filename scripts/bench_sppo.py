"""Benchmark of the SPPO planner (not a test): simulated throughput and largest trainable length.

GPT-7B, one sequence of 1M, 2M and 4M tokens on 32, 64 and 128 GPUs with 80 GB each, planned
by ``sppo_offload.solver`` for ``sppo`` and the baselines ``megatron_recompute`` and
``seq1f1b``. Every number is the project simulator's replay with the spec-derived A100 profile
(``longctx/profiles/a100.json``: 312 TFLOPS BF16, NVLink, InfiniBand, 32 GB/s host link),
not a measurement. Ratios: sppo / megatron_recompute throughput where both fit, and largest
trainable length per GPU count.

``--host-memory-gb`` caps the host memory per GPU the offloaded activations may use (default:
no limit); the table then shows each sppo plan's host memory per GPU.

    python scripts/bench_sppo.py [--host-memory-gb GB] [--json OUT]
"""
from __future__ import annotations

import argparse

from _launch import write_json
from longctx.hardware import load_profile
from longctx.models import get_model

from sppo_offload.solver import MEGATRON, SEQ1F1B, SPPO, SolverConfig, largest_length, solve

LENGTHS = (1 << 20, 1 << 21, 1 << 22)
GPUS = (32, 64, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-7b")
    parser.add_argument("--hardware", default="a100")
    parser.add_argument("--memory-gb", type=float, default=80.0)
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory per GPU for offloaded activations (default: no limit)")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    model, hardware = get_model(args.model), load_profile(args.hardware)
    print(f"SIMULATED with the {hardware.source} {hardware.name} profile "
          f"(host link {hardware.host_gbps_per_gpu:g} GB/s per GPU), {model.name}, "
          f"{args.memory_gb:g} GB per GPU, host memory "
          + ("unlimited" if args.host_memory_gb is None else f"{args.host_memory_gb:g} GB per GPU")
          + "; not measured")
    print(f"{'gpus':>4s} {'tokens':>8s} {'sppo fits':>9s} {'sppo layout':>16s} "
          f"{'sppo tok/s':>10s} {'megatron tok/s':>14s} {'seq1f1b tok/s':>13s} "
          f"{'x megatron':>10s} {'host GB':>7s}")
    rows, largest = [], {}
    for gpus in GPUS:
        config = SolverConfig(gpus=gpus, memory_gb=args.memory_gb,
                              host_memory_gb=args.host_memory_gb)
        for tokens in LENGTHS:
            row = {"gpus": gpus, "seq_length": tokens}
            for method in (SPPO, MEGATRON, SEQ1F1B):
                try:
                    row[method] = solve(method, tokens, model, hardware, config).to_dict()
                except ValueError as error:
                    row[method] = {"error": str(error)}
            rows.append(row)
            print(_line(row))
        largest[gpus] = {m: largest_length(m, model, hardware, config, 65536)
                         for m in (SPPO, MEGATRON, SEQ1F1B)}
    print("largest trainable length (tokens, 64K resolution):")
    print(f"{'gpus':>4s} {'sppo':>9s} {'megatron':>9s} {'seq1f1b':>9s} {'sppo/megatron':>13s}")
    for gpus, found in largest.items():
        ratio = found[SPPO] / found[MEGATRON] if found[MEGATRON] else float("inf")
        print(f"{gpus:4d} {found[SPPO]:9d} {found[MEGATRON]:9d} {found[SEQ1F1B]:9d} "
              f"{ratio:12.2f}x")
    if args.json:
        write_json(args.json, {"simulated": True, "hardware": hardware.name, "model": model.name,
                               "memory_gb": args.memory_gb, "host_memory_gb": args.host_memory_gb,
                               "cells": rows, "largest_seq_length": largest})


def _line(row: dict) -> str:
    sppo, megatron, seq = row[SPPO], row[MEGATRON], row[SEQ1F1B]

    def speed(entry):
        return f"{entry['tokens_per_s']:.0f}" if "error" not in entry else "OOM"

    fits = "error" not in sppo
    layout = (f"sp{sppo['sp']} pp{sppo['pp']} dp{sppo['dp']} N{sppo['num_subsequences']}"
              if fits else "-")
    ratio = (f"{sppo['tokens_per_s'] / megatron['tokens_per_s']:.2f}x"
             if fits and "error" not in megatron else "-")
    host = f"{max(sppo['host_memory_gb']):.1f}" if fits else "-"
    return (f"{row['gpus']:4d} {row['seq_length'] >> 20:7d}M {'yes' if fits else 'no':>9s} "
            f"{layout:>16s} {speed(sppo):>10s} {speed(megatron):>14s} {speed(seq):>13s} "
            f"{ratio:>10s} {host:>7s}")


if __name__ == "__main__":
    main()
