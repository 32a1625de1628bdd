"""What ``sppo`` honours, with the test proving each option under it (``ScheduleSpec.proofs``;
:mod:`megatron.plugin.option_classes` says what a proof is), and its own refusals
(``ScheduleSpec.refusals``). Its layouts mostly offload (``_offload``: a fraction of each
subsequence's activations to host memory); Megatron's full recomputation fixes the plan's
checkpointing table (:mod:`longctx.fixed_checkpointing`); Megatron's default loss is trained
with each token weighed as Megatron's packing weighs it (:mod:`megatron.plugin.default_loss`),
so the layouts of context parallelism train it against Megatron's value at that degree.
"""
from megatron.plugin.option_classes import (
    ACCOUNTED_SPLIT, DISTRIBUTED_OPTIMIZER, DROPOUT, EXAMPLES, FULL_RECOMPUTE, GPU_CHECK,
    GROUPED_QUERIES, HALF_PRECISION, MODEL, MODEL_VARIANT, MOE, OLDER_SELECTIVE,
    OVERLAPPED_REDUCTION, RECOMPUTATION, ROPE_MODEL, TENSOR_PARALLEL, UNEVEN_SPLIT,
    dispatcher_not_run, each, experts_apart)

PROOFS = {
    **each((*MODEL, "sppo_subsequences"), "golden:pp2_sppo_n4"),
    **each(DROPOUT, "golden:pp2_dropout_sppo_n4"),
    **each(("micro_batch_size", "context_parallel_size"),
           "golden:pp2_ulysses2_sppo_default_loss_mbs2"),
    **each(TENSOR_PARALLEL, "golden:pp2_tp2_sp_sppo_n4_offload"),
    "cp_comm_type": "golden:pp2_ulysses2_sppo_n6_offload",
    **each((*ROPE_MODEL, *GROUPED_QUERIES, "num_distributed_optimizer_instances"),
           "golden:pp2_dp2_sppo_n5_offload"),
    **each((*MODEL_VARIANT, *UNEVEN_SPLIT), "golden:pp2_qk_eod_uneven_sppo_n4_offload"),
    **each((*MOE, *ACCOUNTED_SPLIT), "golden:pp2_moe_accounted_sppo_n4_offload"),
    "attention_output_gate": "golden:pp2_gate_sppo_n4_offload",
    "cross_entropy_loss_fusion": EXAMPLES,
    **each(RECOMPUTATION, "golden:pp4_sppo_n5_uniform_recompute"),
    **each(OVERLAPPED_REDUCTION, "golden:pp2_dp2_overlap_sppo"),
    **each((*DISTRIBUTED_OPTIMIZER, "ddp_average_in_collective"),
           "golden:pp2_dp2_dplast_distopt_sppo"),
    **each((*HALF_PRECISION, "transformer_impl"), GPU_CHECK),
    "hardware_profile": "tests/unit/test_schedule_options.py::"
                        "test_the_hardware_profile_prices_the_plan",
    "sppo_offload": "golden:pp2_sppo_n6_offload",
    "sppo_multiplex": "golden:pp2_sppo_mux_n4",
    "sppo_memory_gb": "tests/unit/test_sppo_budgets.py::"
                      "test_the_device_budget_chooses_a_plan_that_fits_it",
    "sppo_host_memory_gb": "tests/unit/test_sppo_budgets.py::"
                           "test_the_host_budget_caps_what_is_offloaded",
}

REFUSALS = {
    "recompute_activations": (
        f"{OLDER_SELECTIVE}, which --pipeline-schedule sppo does not run (a subsequence keeps "
        f"its K and V with the graph): pass {FULL_RECOMPUTE}, or offload activations to host "
        f"memory instead (--sppo-offload)"),
    "expert_model_parallel_size": experts_apart(
        "sppo", "cuts each replica's documents into its own subsequences, so the calls would "
                "not pair up"),
    "moe_token_dispatcher_type": dispatcher_not_run("sppo"),
    **{name: f"sppo runs one model chunk per rank: drop {flag}" for name, flag in (
        ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
        ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"))},
}
