"""What ``helix`` honours, with the test proving each option under it
(``ScheduleSpec.proofs``; :mod:`megatron.plugin.option_classes` says what a proof is), and its
own refusals (``ScheduleSpec.refusals``): helix places its layer parts by its own mapping and
recomputes them itself, so Megatron's layer maps, recomputation and virtual stages are refused
with what helix does instead. Its overlapped gradient reduction is proved with the distributed
optimizer (the golden test checks that the first stage's buckets start their reductions inside
the last backward of the layer parts whose parameters they hold).
"""
from megatron.plugin.option_classes import (
    ACCOUNTED_SPLIT, DISTRIBUTED_OPTIMIZER, DROPOUT, EXAMPLES, GPU_CHECK, GROUPED_QUERIES,
    HALF_PRECISION, MODEL, MODEL_VARIANT, MOE, OLDER_SELECTIVE, OVERLAPPED_REDUCTION,
    RECOMPUTATION, ROPE_MODEL, TENSOR_PARALLEL, UNEVEN_SPLIT, dispatcher_not_run, each,
    experts_apart)

PROOFS = {
    **each(MODEL, "golden:pp2_helix"),
    # At 0.1 with the masks keyed in helix's own layer parts, under recomputation without
    # attention and the chunked MLP, whose recomputed parts draw their masks again
    # (pp2_dropout_helix runs the parts without recomputation).
    **each(DROPOUT, "golden:pp2_dropout_helix_recompute_mlp_chunk"),
    "micro_batch_size": "golden:pp2_helix_mbs2",
    **each(TENSOR_PARALLEL, "golden:pp2_tp2_sp_helix"),
    **each(("cp_comm_type", "context_parallel_size"), "golden:pp2_ulysses2_helix_default_loss"),
    **each((*ROPE_MODEL, *GROUPED_QUERIES, "num_distributed_optimizer_instances"),
           "golden:pp2_dp2_helix"),
    **each(MODEL_VARIANT, "golden:pp2_qk_eod_helix"),
    **each(MOE, "golden:pp2_moe_helix"),
    "cross_entropy_loss_fusion": EXAMPLES,
    **each((*OVERLAPPED_REDUCTION, *DISTRIBUTED_OPTIMIZER, "ddp_average_in_collective"),
           "golden:pp2_dp2_dplast_distopt_helix"),
    **each(HALF_PRECISION, GPU_CHECK),
    "helix_folds": "golden:pp2_helix_one_fold",
    "helix_recompute_without_attention": "golden:pp2_helix_recompute",
    "helix_mlp_chunk_size": "golden:pp2_helix_mlp_chunk",
}

_OWN_MAPPING = ("helix places its layer parts by its own mapping (boundary b on stage b mod PP, "
                "equal stages): drop {flag}")
_OWN_RECOMPUTATION = (
    "helix recomputes its own layer parts: drop --recompute-granularity, --recompute-method and "
    "--recompute-num-layers and pass --helix-recompute-without-attention (pre/post-attention "
    "parts recomputed, attention never)")

REFUSALS = {
    "recompute_activations": (f"{OLDER_SELECTIVE}; helix recomputes its own layer parts: pass "
                              "--helix-recompute-without-attention (pre/post-attention parts "
                              "recomputed, attention never)"),
    **each((*UNEVEN_SPLIT, *ACCOUNTED_SPLIT), _OWN_MAPPING),
    **each(RECOMPUTATION, _OWN_RECOMPUTATION),
    **{name: f"helix interleaves layer parts itself: drop {flag}" for name, flag in (
        ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
        ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"))},
    "attention_output_gate": (
        "--attention-output-gate is not supported by --pipeline-schedule helix: its memory "
        "model of the layer parts does not count the gate's tensors yet; drop the flag, or "
        "use elastic or sppo"),
    "expert_model_parallel_size": experts_apart(
        "helix", "runs each replica's own packed micro-batches, completed with empty slots, "
                 "through layer parts split across stages, and no test proves that its MoE "
                 "calls pair up across replicas"),
    "moe_token_dispatcher_type": dispatcher_not_run("helix"),
    "transformer_impl": (
        "--transformer-impl transformer_engine is not supported by --pipeline-schedule helix: "
        "Transformer Engine fuses the input norm into the QKV projection, and helix's weight "
        "shipping runs the norm on the layer's stage and the QKV matmul on the attention's "
        "stage; it has not run on a GPU under helix yet. Pass --transformer-impl local (the "
        "same model; its distributed checkpoints use the names of Megatron's TE layers)"),
}
