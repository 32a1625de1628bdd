"""What ``elastic`` and ``seq1f1b`` honour, with the test proving each option under them
(``ScheduleSpec.proofs``; :mod:`megatron.plugin.option_classes` says what a proof is), and
their own refusals (``ScheduleSpec.refusals``).

Both plan each data-parallel replica's documents apart, as chunks of their own (packed
documents, or slices of one): Megatron's default loss is trained with each token weighed as
Megatron's packing weighs it (:mod:`megatron.plugin.default_loss`), so the layouts of context
parallelism train it against Megatron's value at that degree; the router's calls are those
chunks, so Megatron's auxiliary load-balancing loss (a formula per micro-batch) is refused and
the project's per-document one (``--moe-per-document-aux-loss-coeff``) is honoured, passed by
the elastic layout with the per-token loss and the seq1f1b layout with Megatron's default loss
against a reference that computes it over whole documents (so do the layouts at tensor
(sequence) and context parallelism, ``pp2_tp2_sp_moe_elastic``, ``pp2_tp2_sp_moe_seq1f1b`` and
``pp2_ulysses2_moe_elastic``, whose router calls hold parts of the rows). Megatron's full
recomputation fixes the plan's checkpointing table (:mod:`longctx.fixed_checkpointing`;
``--recompute-granularity selective`` is refused by their own check).
"""
from megatron.plugin.option_classes import (
    ACCOUNTED_SPLIT, DISTRIBUTED_OPTIMIZER, DROPOUT, EXAMPLES, FULL_RECOMPUTE, GPU_CHECK,
    GROUPED_QUERIES, HALF_PRECISION, MODEL, MODEL_VARIANT, MOE, OLDER_SELECTIVE,
    OVERLAPPED_REDUCTION, PLANNER_KNOBS, RECOMPUTATION, ROPE_MODEL, TENSOR_PARALLEL,
    UNEVEN_SPLIT, dispatcher_not_run, each, experts_apart)

#: The planner's flags of both schedules (``--elastic-slices`` and ``--elastic-memory-gb``
#: are proved by each one's base layout).
_PLANNER = {
    **each(("elastic_reserved_gb", "elastic_solver_time_limit"), PLANNER_KNOBS),
    "elastic_min_slice_tokens": "tests/unit/test_schedule_options.py::"
                                "test_the_smallest_slice_lets_the_planner_cut_finer",
    "elastic_refit_interval": "tests/e2e/test_pretrain.py::"
                              "test_elastic_trains_like_1f1b_and_leaks_nothing",
    "hardware_profile": "tests/unit/test_schedule_options.py::"
                        "test_the_hardware_profile_prices_the_plan",
}

ELASTIC_PROOFS = {
    **each(MODEL, "golden:pp2_elastic"),
    **each(DROPOUT, "golden:pp2_dropout_elastic"),
    "micro_batch_size": "golden:pp2_elastic_default_loss_mbs2",
    **each(TENSOR_PARALLEL, "golden:pp2_tp2_sp_elastic"),
    **each(("cp_comm_type", "context_parallel_size"), "golden:pp2_ulysses2_elastic_default_loss"),
    **each(ROPE_MODEL, "golden:pp2_dp2_elastic"),
    **each((*MODEL_VARIANT, *UNEVEN_SPLIT), "golden:pp2_qk_eod_uneven_elastic"),
    **each((*MOE, *ACCOUNTED_SPLIT, "moe_per_document_aux_loss_coeff"),
           "golden:pp2_moe_accounted_elastic"),
    "attention_output_gate": "golden:pp2_gate_elastic",
    **each(GROUPED_QUERIES, "golden:pp2_gqa_elastic"),
    "cross_entropy_loss_fusion": EXAMPLES,
    **each(RECOMPUTATION, "golden:pp2_full_recompute_elastic"),
    **each(OVERLAPPED_REDUCTION, "golden:pp2_dp2_overlap_elastic"),
    **each((*DISTRIBUTED_OPTIMIZER, "ddp_average_in_collective"),
           "golden:pp2_dp2_dplast_distopt_elastic"),
    "num_distributed_optimizer_instances": "golden:pp2_dp2_elastic",
    **each((*HALF_PRECISION, "transformer_impl"), GPU_CHECK),
    "elastic_slices": "golden:pp2_elastic",
    "elastic_memory_gb": "golden:pp2_elastic_adaptive",
    **_PLANNER,
}

SEQ1F1B_PROOFS = {
    **each((*MODEL, "elastic_slices", "elastic_memory_gb"), "golden:pp2_seq1f1b_uniform"),
    **each(DROPOUT, "golden:pp2_dropout_seq1f1b"),
    "micro_batch_size": "golden:pp2_seq1f1b_default_loss_mbs2",
    **each(TENSOR_PARALLEL, "golden:pp2_tp2_sp_seq1f1b"),
    **each(("cp_comm_type", "context_parallel_size"),
           "golden:pp2_ulysses2_seq1f1b_default_loss_mbs2"),
    **each(ROPE_MODEL, "golden:pp2_rope_seq1f1b"),
    **each((*MODEL_VARIANT, *UNEVEN_SPLIT), "golden:pp2_qk_eod_uneven_seq1f1b"),
    **each((*MOE, *ACCOUNTED_SPLIT, "moe_per_document_aux_loss_coeff"),
           "golden:pp2_moe_accounted_seq1f1b"),
    "attention_output_gate": "golden:pp2_gate_seq1f1b",
    **each(GROUPED_QUERIES, "golden:pp2_gqa_seq1f1b"),
    "cross_entropy_loss_fusion": EXAMPLES,
    **each(RECOMPUTATION, "golden:pp2_block_recompute_seq1f1b"),
    **each(OVERLAPPED_REDUCTION, "golden:pp2_dp2_overlap_seq1f1b"),
    **each((*DISTRIBUTED_OPTIMIZER, "ddp_average_in_collective"),
           "golden:pp2_dp2_dplast_distopt_seq1f1b"),
    "num_distributed_optimizer_instances": "golden:pp2_dp2_seq1f1b",
    **each((*HALF_PRECISION, "transformer_impl"), GPU_CHECK),
    **_PLANNER,
}


def _aux_loss_refusal(schedule: str) -> str:
    return (f"--moe-aux-loss-coeff is not supported by --pipeline-schedule {schedule}: Megatron's "
            f"auxiliary load-balancing loss (aux_loss) is a formula over the tokens of each "
            f"micro-batch of --micro-batch-size packed rows, padding included, and {schedule} "
            f"calls the router on document chunks of its own (packed documents, or slices of "
            f"one), so it cannot compute Megatron's value (scripts/aux_gap.py measures how far "
            f"the router gradients are). Use --pipeline-schedule 1f1b, interleaved or 1f1b-ir "
            f"for Megatron's loss; or pass --moe-per-document-aux-loss-coeff instead, the same "
            f"formula over each document's own tokens (a loss of this project's, not "
            f"Megatron's); or leave it at 0 (dropless routing without it is exact under every "
            f"schedule)")


def _refusals(schedule: str, planned: str) -> dict:
    return {"moe_aux_loss_coeff": _aux_loss_refusal(schedule),
            "recompute_activations": (
                f"{OLDER_SELECTIVE}, which --pipeline-schedule {schedule} does not run (a split "
                f"document's slices keep their K and V with the graph): pass {FULL_RECOMPUTE}, "
                f"or drop it and the planner recomputes what --elastic-memory-gb needs"),
            "expert_model_parallel_size": experts_apart(
                schedule, f"plans each replica's documents apart ({planned}), so the calls "
                          f"would not pair up"),
            "moe_token_dispatcher_type": dispatcher_not_run(schedule)}


ELASTIC_REFUSALS = _refusals(
    "elastic", "its own slices, packed chunks and per-chunk recomputation")
SEQ1F1B_REFUSALS = _refusals("seq1f1b", "its own slices and per-chunk recomputation")
