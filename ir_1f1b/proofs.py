"""What ``1f1b-ir`` honours, with the test proving each option under it
(``ScheduleSpec.proofs``; :mod:`megatron.plugin.option_classes` says what a proof is). It runs
Megatron's micro-batches and layer map, so Megatron's auxiliary load-balancing loss (per
micro-batch) and experts spread over the data-parallel replicas (each replica calls each MoE
layer equally often and in the same order) hold as under Megatron's schedules: its MoE layouts
spread the experts with the all-gather dispatcher, and split each expert over its own
tensor-parallel size with the all-to-all one. Its overlapped gradient reduction averages the
gradients in the collective too (``--ddp-average-in-collective``).
"""
from megatron.plugin.option_classes import (
    ACCOUNTED_SPLIT, DISTRIBUTED_OPTIMIZER, DROPOUT, GPU_CHECK, GROUPED_QUERIES, HALF_PRECISION,
    MODEL, MODEL_VARIANT, MOE, OVERLAPPED_REDUCTION, RECOMPUTATION, ROPE_MODEL,
    SELECTIVE_INSTEAD, SPLIT_EXPERTS, TENSOR_PARALLEL, UNEVEN_SPLIT, each)

PROOFS = {
    **each(MODEL, "golden:pp2_ir"),
    **each(DROPOUT, "golden:pp2_dropout_ir"),
    "micro_batch_size": "golden:pp2_ir_uniform_recompute_mbs2",
    **each(TENSOR_PARALLEL, "golden:pp2_tp2_sp_ir"),
    **each(("cp_comm_type", "context_parallel_size"), "golden:pp2_ulysses2_ir"),
    **each(ROPE_MODEL, "golden:pp2_rope_ir"),
    **each((*MODEL_VARIANT, *UNEVEN_SPLIT), "golden:pp2_qk_eod_uneven_ir"),
    **each((*MOE, *ACCOUNTED_SPLIT, "moe_aux_loss_coeff", "expert_model_parallel_size"),
           "golden:pp2_dp2_ep2_moe_accounted_ir"),
    **each((SPLIT_EXPERTS, "moe_token_dispatcher_type"), "golden:pp2_dp2_etp2_a2a_moe_ir"),
    "attention_output_gate": "golden:pp2_gate_ir",
    **each(GROUPED_QUERIES, "golden:pp2_gqa_ir"),
    **each(RECOMPUTATION, "golden:pp2_ir_block_recompute"),
    **each((*OVERLAPPED_REDUCTION, "ddp_average_in_collective"), "golden:pp2_dp2_overlap_ir"),
    **each(DISTRIBUTED_OPTIMIZER, "golden:pp2_dp2_dplast_distopt_ir"),
    **each((*HALF_PRECISION, "transformer_impl"), GPU_CHECK),
}

#: It runs Megatron's selective recomputation: ``--recompute-activations``, its older
#: spelling, is refused pointing to it.
REFUSALS = {"recompute_activations": SELECTIVE_INSTEAD}
