"""Benchmark: ``helix`` against Megatron's native ``1f1b`` on the same batches.

    python scripts/bench_helix.py [--iters 3] [--repeats 1] [--seq-length 8192]
        [--global-batch-size 8] [--hidden-size 64] [--num-layers 4] [--mlp-chunk-size 1024]
        [--json OUT] [--simulate-only]

Measured (this machine's CPU): the script launches itself on 2 ranks (PP=2, one thread each)
with the embedded corpus and builds three models with identical shapes: ``1f1b`` (Megatron's
``GPTModel`` stages), ``helix`` (two-fold FILO, weight shipping) and ``helix`` with
recomputation without attention and chunked MLP. Every iteration draws one global batch of
documents (packed into ``--seq-length`` micro-batches) and runs one training step of each, in
turn, after a warm-up round; with ``--repeats N`` it does so N times per batch and keeps each
variant's fastest step (on a shared machine the minimum filters out the time other processes
took; the ranks time a step between barriers, so it is the slower rank's time). Reported per
variant: tokens/s over the iterations, and the peak
saved-activation bytes of each stage (the training loop's meter, which also counts helix's own
stash), with the ratios to ``1f1b``.

Simulated (:mod:`helix.pricing` from a spec-derived hardware profile; no measurement): GPT-7B,
128K-token sequences, 8 pipeline stages of one node each (TP=8 with sequence parallelism inside
the node, stages linked by InfiniBand), per-part FLOPs of the QKV projection (in helix's
attention part, where its runtime runs it), the causal attention and the post-attention
(projection and MLP) with TP collectives, helix with
recomputation without attention, against 1F1B with the same layers per stage. Prints the
iteration time of each and the ratio.
"""
import argparse
import copy
import json
import os
import sys

from _launch import CORPUS_FLAGS, Job, run_workers, stage_peaks, timed_step, write_json

VARIANTS = {
    "1f1b": {"pipeline_schedule": "1f1b"},
    "helix": {"pipeline_schedule": "helix"},
    "helix_recompute": {"pipeline_schedule": "helix", "helix_recompute_without_attention": True},
}


def model_flags(options) -> list[str]:
    return ["--num-layers", str(options.num_layers), "--hidden-size", str(options.hidden_size),
            "--num-attention-heads", str(options.num_attention_heads),
            "--seq-length", str(options.seq_length),
            "--max-position-embeddings", str(options.seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(options.global_batch_size), "--train-iters", "1000",
            "--lr", "1e-4", "--hidden-dropout", "0", "--attention-dropout", "0", *CORPUS_FLAGS,
            "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]


def worker(argv) -> int:
    import torch.distributed as dist
    from megatron.training.global_vars import set_args

    from megatron.plugin import launch, registry

    iters = int(os.environ["BENCH_ITERS"])
    repeats = int(os.environ["BENCH_REPEATS"])
    chunk = int(os.environ["BENCH_MLP_CHUNK"])
    job = Job(argv)
    jobs = {}
    for name, settings in VARIANTS.items():
        variant = copy.copy(job.args)
        for key, value in settings.items():
            setattr(variant, key, value)
        if name == "helix_recompute":
            variant.helix_mlp_chunk_size = chunk
        set_args(variant)  # helix builds its own layout of the model
        variant_job = copy.copy(job)
        variant_job.model, variant_job.optimizer, variant_job.scheduler, variant_job.config = \
            launch.setup_model_and_optimizer()
        jobs[name] = (variant, variant_job)
    set_args(job.args)
    results = {name: {"times": [], "tokens": [], "peaks": [], "microbatches": []}
               for name in VARIANTS}
    for i in range(iters + 1):
        documents = job.documents(i)
        runs = {name: [] for name in jobs}
        for _ in range(repeats if i else 1):
            for name, (variant, variant_job) in jobs.items():
                registry.use_schedule(variant.pipeline_schedule)
                runs[name].append(timed_step(variant_job, documents, args=variant))
        if i == 0:
            continue
        for name, steps in runs.items():
            result = steps[0][0]
            entry = results[name]
            entry["times"].append(min(took for _, took, _ in steps))
            entry["tokens"].append(result["num_tokens"])
            entry["peaks"].append([max(p) for p in zip(*(peaks for _, _, peaks in steps))])
            entry["microbatches"].append(result["num_microbatches"])
    if dist.get_rank() == 0:
        report = {}
        for name, entry in results.items():
            stages = stage_peaks(entry["peaks"])
            report[name] = {"tokens_per_s": sum(entry["tokens"]) / sum(entry["times"]),
                            "iteration_s": entry["times"],
                            "microbatches": entry["microbatches"],
                            "peak_activation_bytes_per_stage": stages}
        print(json.dumps(report))
    dist.destroy_process_group()
    return 0


def measured(options) -> dict:
    report = run_workers(__file__, model_flags(options), 29571, BENCH_ITERS=str(options.iters),
                         BENCH_REPEATS=str(options.repeats),
                         BENCH_MLP_CHUNK=str(options.mlp_chunk_size))
    print(f"MEASURED: PP=2 on 2 CPU ranks, one thread each; embedded corpus, --seq-length "
          f"{options.seq_length}, {options.global_batch_size} documents a batch, "
          f"{options.iters} iterations (fastest of {options.repeats} steps each); "
          f"{options.num_layers} layers x hidden "
          f"{options.hidden_size}; helix_recompute: recomputation without attention and "
          f"--helix-mlp-chunk-size {options.mlp_chunk_size}")
    base = report["1f1b"]
    base_stage0 = base["peak_activation_bytes_per_stage"][0]
    for name, entry in report.items():
        stages = entry["peak_activation_bytes_per_stage"]
        entry["tokens_per_s_vs_1f1b"] = entry["tokens_per_s"] / base["tokens_per_s"]
        entry["peak_vs_1f1b_stage0"] = max(stages) / base_stage0
        entry["stage_balance_max_over_min"] = max(stages) / min(stages)
        print(f"  {name:16s} {entry['tokens_per_s']:8.1f} tokens/s (x{entry['tokens_per_s_vs_1f1b']:.3f}"
              f" of 1f1b) | peak saved activations per stage "
              f"{[round(b / 2**20, 1) for b in stages]} MiB, max/min "
              f"{entry['stage_balance_max_over_min']:.2f}, max / 1f1b stage 0 "
              f"{entry['peak_vs_1f1b_stage0']:.2f} | micro-batches {entry['microbatches']}")
    return report


def simulated(profile_name: str = "h20") -> dict:
    """GPT-7B, 128K tokens a sequence, PP=8 x TP=8 (one node a stage), 16 micro-batches;
    helix with recomputation without attention (what the paper needs at 128K)."""
    from longctx.hardware import load_profile
    from longctx.models import get_model
    from helix.pricing import compare

    hw, model = load_profile(profile_name), get_model("gpt-7b")
    pp, tp, seq, microbatches = 8, 8, 128 * 1024, 16
    found = compare(model, hw, seq, pp, tp, microbatches, helix_recompute=True)
    parts = found["parts_s"]
    print(f"SIMULATED (spec-derived {profile_name} profile, not measured): gpt-7b, "
          f"{seq} tokens a sequence, PP={pp} x TP={tp}, {microbatches} micro-batches; part "
          f"forwards t_qkv {parts['qkv'] * 1e3:.1f} ms, t_attn {parts['attention'] * 1e3:.1f} "
          f"ms, t_post {parts['post'] * 1e3:.1f} ms a layer (helix.pricing; helix's memory not priced)")
    print(f"  1f1b  {found['1f1b_s']:8.2f} s/iteration, bubble {found['1f1b_bubble']:.3f}, "
          f"{'with' if found['1f1b_recompute'] else 'without'} recomputation, peak "
          f"{max(found['1f1b_peak_gb']):.1f} GB of {hw.hbm_gb:g}")
    print(f"  zb1p  {found['zb1p_s']:8.2f} s/iteration, bubble {found['zb1p_bubble']:.3f} "
          f"(ZB-H1, simulated only; recomputes when 1f1b does)")
    print(f"  helix {found['helix_s']:8.2f} s/iteration, bubble {found['helix_bubble']:.3f}"
          f" -> helix / 1f1b throughput x{found['speedup_1f1b']:.3f}, helix / "
          f"{found['best_baseline']} (the faster baseline) x{found['speedup']:.3f}")
    return {"profile": profile_name, "model": "gpt-7b", "seq_length": seq, "pp": pp, "tp": tp,
            "microbatches": microbatches, "helix_recompute_without_attention": True, **found}


def main() -> int:
    if os.environ.get("BENCH_WORKER"):
        return worker(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1,
                        help="steps per variant and batch; the fastest is kept")
    parser.add_argument("--seq-length", type=int, default=8192,
                        help="tokens a packed micro-batch; long enough for attention to dominate "
                             "a layer of this width")
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--mlp-chunk-size", type=int, default=1024)
    parser.add_argument("--simulate-only", action="store_true")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    report = {"simulated": simulated()}
    if not options.simulate_only:
        report["measured"] = measured(options)
    if options.json:
        write_json(options.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
