"""``python -m sppo_offload.plan``: plan one ultra-long sequence with SPPO, price the baselines.

Example::

    python -m sppo_offload.plan --seq-length 1048576 --model gpt-7b --hardware a100 \\
        --gpus 32 --memory-gb 80 --json plan.json

For ``sppo`` and the baselines ``megatron_recompute`` and ``seq1f1b`` (all priced by the
project's simulator with the same cost model): the chosen (SP, PP, N) and data-parallel
replicas, the subsequence lengths and offload ratios, the predicted iteration time and
throughput, the peak device memory, and the largest sequence length that fits on the GPUs;
for ``sppo`` also the host memory per GPU its offloading uses and the iteration time with
multiplexed partitioning.

``--host-memory-gb``: host memory per GPU the offloaded activations may use (default: no
limit, see :attr:`~sppo_offload.solver.SolverConfig.host_memory_gb` for why); the ``auto``
ratios are lowered largest first to fit it. The JSON reports it as ``host_memory_gb`` (``null``:
no limit) and each plan's host memory per stage as its ``host_memory_gb``.
"""
from __future__ import annotations

import argparse
import json
import sys

from megatron.plugin.pipeline.gantt import write_gantt
from megatron.plugin.pipeline.simulator import simulate

from longctx.hardware import load_profile, profiles_help
from longctx.models import PRESETS, get_model

from sppo_offload import multiplex
from sppo_offload.offload import parse_offload
from sppo_offload.solver import METHODS, SPPO, MethodPlan, SolverConfig, largest_length, solve


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m sppo_offload.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, required=True, help="tokens of the sequence")
    parser.add_argument("--model", default="gpt-7b", help="|".join(sorted(PRESETS)))
    parser.add_argument("--hardware", default="a100",
                        help=f"{profiles_help()} or a profile .json")
    parser.add_argument("--gpus", type=int, default=32, help="GPUs of the job")
    parser.add_argument("--memory-gb", type=float, help="GB per GPU (default: the profile's)")
    parser.add_argument("--host-memory-gb", type=float,
                        help="host memory per GPU for offloaded activations, GB (default: no "
                             "limit)")
    parser.add_argument("--sppo-subsequences", default="auto", help="N, or auto")
    parser.add_argument("--sppo-offload", default="auto", help="auto, off, or a ratio in [0, 1]")
    parser.add_argument("--granularity", type=int, default=16384,
                        help="tokens the largest-length search resolves")
    parser.add_argument("--json", help="write the plans here")
    parser.add_argument("--gantt", help="write a PNG Gantt chart of the sppo schedule")
    return parser.parse_args(argv)


def _subsequences(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--sppo-subsequences takes a count or auto, got {text!r}") from None


def summary(result: dict) -> str:
    host = result["host_memory_gb"]
    lines = [f"SPPO plan: {result['seq_length']} tokens, {result['model']} on {result['gpus']} "
             f"x {result['hardware']} ({result['memory_gb']:g} GB each, host memory "
             + ("unlimited" if host is None else f"{host:g} GB each") + "), simulated"]
    for name in METHODS:
        entry = result["methods"][name]
        lines.append(f"{name}:")
        if "error" in entry:
            lines.append(f"  OOM: {entry['error']}")
        else:
            lines.append(f"  SP={entry['sp']} PP={entry['pp']} N={entry['num_subsequences']} "
                         f"(DP={entry['dp']}), iteration {entry['iteration_time_s']:.2f} s, "
                         f"{entry['tokens_per_s']:.0f} tokens/s, bubble "
                         f"{entry['bubble_ratio']:.3f}")
            lines.append("  peak memory per stage (GB): " + ", ".join(
                f"{m:.1f}" for m in entry["peak_memory_gb"]))
            if any(entry["checkpointed_layers"]):
                lines.append(f"  recomputed layers per stage: {entry['checkpointed_layers']}")
            if name == SPPO:
                lines.append("  subsequence lengths: " + _short(entry["lengths"]))
                for stage in sorted({0, entry["pp"] - 1}):
                    lines.append(f"  alpha (stage {stage}): " + _short(
                        [f"{a:.2f}" for a in entry["alphas"][stage]]))
                lines.append("  host memory per GPU (GB): " + ", ".join(
                    f"{m:.1f}" for m in entry["host_memory_gb"]))
                if "multiplexed_iteration_time_s" in entry:
                    peak = max(entry["multiplexed_peak_memory_gb"])
                    lines.append(f"  multiplexed partitioning: iteration "
                                 f"{entry['multiplexed_iteration_time_s']:.2f} s, peak "
                                 f"{peak:.1f} GB" + ("" if entry["multiplexed_fits"] else
                                                     " -- over the budget: not used (the "
                                                     "training refuses --sppo-multiplex "
                                                     "there), the plain plan stands"))
        lines.append(f"  largest sequence on {result['gpus']} GPUs: "
                     f"{entry['largest_seq_length']} tokens")
    base = result["methods"]["megatron_recompute"]
    sppo = result["methods"][SPPO]
    if "error" not in base and "error" not in sppo:
        lines.append(f"sppo / megatron_recompute throughput: "
                     f"{sppo['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    if base["largest_seq_length"]:
        lines.append(f"sppo / megatron_recompute largest length: "
                     f"{sppo['largest_seq_length'] / base['largest_seq_length']:.2f}x")
    return "\n".join(lines)


def _short(values: list, edge: int = 4) -> str:
    """``a, b, c, d, ... (N), w, x, y, z`` for long lists."""
    values = [str(v) for v in values]
    if len(values) <= 2 * edge + 1:
        return ", ".join(values)
    return ", ".join(values[:edge]) + f", ... ({len(values)} in all), " + \
        ", ".join(values[-edge:])


def _multiplexed(plan: MethodPlan, memory_gb: float) -> dict:
    """The multiplexed alternative of an ``sppo`` plan, and whether it fits ``memory_gb``."""
    if plan.layout.pp < 2:
        return {}
    _, multiplexed = multiplex.compare(plan)
    return {"multiplexed_iteration_time_s": multiplexed.iteration_time,
            "multiplexed_peak_memory_gb": [m / 1e9 for m in multiplexed.peak_memory],
            "multiplexed_fits": max(multiplexed.peak_memory) <= memory_gb * 1e9}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        model = get_model(args.model)
        hardware = load_profile(args.hardware)
        memory_gb = args.memory_gb or hardware.hbm_gb
        config = SolverConfig(gpus=args.gpus, memory_gb=memory_gb,
                              offload=parse_offload(args.sppo_offload),
                              subsequences=_subsequences(args.sppo_subsequences),
                              host_memory_gb=args.host_memory_gb)
        if args.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {args.seq_length}")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = {"seq_length": args.seq_length, "model": model.name, "hardware": hardware.name,
              "hardware_source": hardware.source, "gpus": args.gpus, "memory_gb": memory_gb,
              "host_memory_gb": args.host_memory_gb, "methods": {}}
    plans = {}
    for name in METHODS:
        try:
            plan = solve(name, args.seq_length, model, hardware, config)
        except ValueError as error:
            entry = {"error": str(error)}
        else:
            plans[name] = plan
            entry = plan.to_dict()
            if name == SPPO:
                entry.update(_multiplexed(plan, memory_gb))
        entry["largest_seq_length"] = largest_length(name, model, hardware, config,
                                                     args.granularity)
        result["methods"][name] = entry
    print(summary(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    if args.gantt and SPPO in plans:
        sppo = plans[SPPO]
        write_gantt(simulate(sppo.schedule, sppo.costs).events, args.gantt,
                    title=f"sppo ({model.name}, {args.seq_length} tokens, simulated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
