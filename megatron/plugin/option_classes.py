"""Every option of ``pretrain_gpt_elastic.py``'s parser, in exactly one class.

The parser is Megatron-LM's (``megatron.training.arguments``, every supported megatron-core
release) plus the project's group and each registered schedule's group. Each option's
destination is named once, explicitly (no prefix patterns: an option a new megatron-core
release adds is in no class, and :func:`megatron.plugin.arguments.check_command_line` refuses it
at start-up when given until it is classified here):

* :data:`INERT`: neither the project's schedules and model nor megatron-core's model,
  attention or schedule code reads it (paths, data sources, logging, timers, checkpoint
  formats, optimizer and learning-rate hyper-parameters, tokenizers, initial weights and
  seeds): Megatron-LM's loop (or the project's data loader) honours it the same way under
  every schedule. Also Megatron's kernel fusions (:data:`FUSIONS`), which Megatron's layers
  read the same way under every schedule and which compute what the unfused operations do.
* honoured (:func:`proof`): read by the model or a schedule; accepted under a schedule only
  where a test proves it there with a value other than the default. Under any other schedule it
  is refused, naming what to use instead. :data:`HONOURED` holds the proofs under Megatron's
  own schedules (``default``, ``1f1b``, ``interleaved``) and under every schedule (``*``), and
  what to do instead elsewhere; every other schedule declares what it honours itself, in its
  :class:`~megatron.plugin.schedule_spec.ScheduleSpec` (``proofs``: option -> the test proving
  it there; ``refusals``: option -> its own refusal of it), read here once it is registered. An
  option that only schedules' tables name is their own flag: refused under the others as doing
  nothing there.
* :data:`REFUSED`: refused under every schedule when given with a value other than Megatron's
  default, with what to do instead.

A proof is ``golden:TAG`` (a layout of ``tests/distributed/test_golden_megatron.py``: loss and
every gradient against the single-process reference), or ``PATH::TEST`` (a test function), or
``PATH`` (a script the GPU check runs). ``tests/unit/test_option_classes.py`` builds the real
parser and checks the classes cover it, and that each proof exists and passes its option with a
value other than the default under the schedule it is named for (``default`` is proved by
Megatron's ``1f1b`` or, with virtual stages, ``interleaved``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping

from megatron.plugin import registry


def _names(text: str) -> frozenset:
    return frozenset(text.split())


def _each(text: str, message: str) -> dict:
    return {name: message for name in text.split()}


def each(dests: Iterable[str], proof: str) -> dict:
    """``dest -> proof`` for each of ``dests`` (a group below proved by one layout)."""
    return dict.fromkeys(dests, proof)


@dataclass(frozen=True)
class Honoured:
    """``proofs``: Megatron's schedule (``*``: every schedule) -> the test proving the option
    there; other schedules name theirs in their ``ScheduleSpec``. ``values``: the values
    honoured (an enumeration's by name), ``None`` for any (others are refused with
    ``refusal``). Under a schedule without a proof the option is refused: with that schedule's
    own message when it has one (``ScheduleSpec.refusals``, a whole sentence), else with
    ``refusal``, what to do instead."""

    proofs: Mapping[str, str]
    refusal: str
    values: tuple | None = None


# Groups of options that one golden layout proves together under a schedule (a schedule's table
# gives each group its layout with :func:`each`).

#: The model's shape and the batch: the tiny model's layout (tests/harness.py TINY_MODEL).
MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
         "max_position_embeddings", "global_batch_size", "calculate_per_token_loss",
         "vocab_size", "pipeline_model_parallel_size")
#: Hidden and attention dropout at 0.1 (Megatron-LM's default), proved by the golden ``dropout``
#: layouts: run and reference draw each mask from its token's identity, so the run drops what
#: the reference drops however a schedule packs, cuts and places the documents.
DROPOUT = ("hidden_dropout", "attention_dropout")
#: Tensor and sequence parallelism. ``--expert-tensor-parallel-size``: without
#: ``--num-experts`` no layer reads it, and it only sizes Megatron's expert groups (Megatron-LM's
#: configs give it without experts); with MoE layers, other than the tensor-parallel size, it
#: splits each expert (:data:`SPLIT_EXPERTS`). ``--no-persist-layer-norm``: Megatron's
#: persistent fused LayerNorm kernel (apex), which the document layer spec's norms never use
#: (Megatron-LM's configs without Transformer Engine give it).
TENSOR_PARALLEL = ("tensor_model_parallel_size", "sequence_parallel",
                   "expert_tensor_parallel_size", "no_persist_layer_norm")
#: The rope / SwiGLU / RMSNorm model (Llama's), whose layouts take the model-shape flags of
#: Megatron-LM's GPT configurations too: kv_channels other than hidden / heads, partial RoPE at
#: another base and the MLP's width. Not
#: Megatron's fused cross entropy: it returns the logits' gradient in bf16, and which of them
#: round to another bf16 value differs with fp32's summation order, more than the golden
#: comparison allows.
ROPE_MODEL = ("position_embedding_type", "swiglu", "layernorm_zero_centered_gamma",
              "add_bias_linear", "untie_embeddings_and_output_weights", "normalization",
              "ffn_hidden_size", "kv_channels", "rotary_base", "rotary_percent")
#: The Q and K norms (``--qk-layernorm``), ``--eod-mask-loss``, interleaved RoPE
#: (``--rotary-interleaved``: rotating channel pairs 2i, 2i + 1 rather than i, i + dim / 2,
#: applied by the document attention at each token's true position with Megatron's own
#: rotation), Megatron's MLP with its squared ReLU (``--squared-relu``) and MuP (Megatron's
#: config turns its flags into the attention's scale, which the document attention is built
#: with, the embedding's and the logits' multipliers, the initialisation and the optimizer's
#: per-group learning rates): one model variant proves them; under the schedules that run
#: Megatron's layer map its layouts split the layers unevenly too (:data:`UNEVEN_SPLIT`).
MODEL_VARIANT = ("qk_layernorm", "eod_mask_loss", "rotary_interleaved", "squared_relu",
                 "use_mup", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult",
                 "mup_base_head_dim", "mup_attn_scale_power")
#: Grouped-query attention.
GROUPED_QUERIES = ("group_query_attention", "num_query_groups")
#: Megatron's uneven pipeline splits (its layer map, ``get_num_layers_to_build``), where the
#: schedule runs that map: a first stage of 1 and a last of 3 layers (:data:`MODEL_VARIANT`'s
#: layouts).
UNEVEN_SPLIT = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers")
#: The embedding and the loss each counted as a layer of the split (:data:`MOE`'s layouts).
ACCOUNTED_SPLIT = ("account_for_embedding_in_pipeline_split",
                   "account_for_loss_in_pipeline_split")
#: Dropless mixture of experts: Megatron's MoE layer, with a gated shared expert beside the
#: routed ones and the router in FP64; under the schedules that run Megatron's layer map its
#: layouts count the embedding and the loss as layers of the split (:data:`ACCOUNTED_SPLIT`).
MOE = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size",
       "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_dtype")
#: Megatron's recomputation (tests/unit/test_schedule_options.py names each cell's layout).
RECOMPUTATION = ("recompute_granularity", "recompute_method", "recompute_num_layers")
#: Megatron's data-parallel gradient reduction overlapped with the backward, with buckets small
#: enough that the first stage has several (under the IR schedules too:
#: megatron/plugin/pipeline/grad_sync.py).
OVERLAPPED_REDUCTION = ("overlap_grad_reduce", "ddp_bucket_size")
#: Megatron's distributed optimizer with overlapped gradient reduce-scatter and parameter
#: all-gather (two data-parallel replicas of PP=2; the golden test also compares the updated
#: parameters with those of the reference's step, and checks that a later bucket's all-gather
#: is in flight when the first layer's forward starts). They run Megatron's rank order with the
#: data-parallel dimension last (``--use-tp-pp-dp-mapping``; at PP=2 x DP=2 the order moves
#: every rank's pipeline and data-parallel peers; the golden test checks the groups), the
#: other pp2_dp2 layouts Megatron's default order. The project asks megatron-core's
#: ``parallel_state`` for every group and peer, so no code of it depends on the order.
DISTRIBUTED_OPTIMIZER = ("use_distributed_optimizer", "use_tp_pp_dp_mapping",
                         "overlap_param_gather")
#: Half precision: each schedule's short training run in fp32, bf16 and fp16 on the GPU
#: machine (:data:`GPU_CHECK`).
HALF_PRECISION = ("bf16", "fp16")

#: Not one option but a setting of two: experts split over ``--expert-tensor-parallel-size``
#: ranks other than the tensor-parallel size of the other layers, the tokens gathered over them
#: (``--num-experts`` with that size; ``arguments.RULES`` asks :func:`proof` for it). A
#: schedule's table names its proof under this key; :data:`EXPERT_TP` holds Megatron's.
SPLIT_EXPERTS = "num_experts+expert_tensor_parallel_size"

#: Megatron-LM's example launch scripts trained under 1f1b and the schedules that name it
#: (finite losses and gradient norms; every iteration's loss agrees with 1f1b's to 1e-4, its
#: gradient norm to the 3 decimals Megatron logs).
EXAMPLES = ("tests/e2e/test_megatron_examples.py::"
            "test_megatron_example_trains_alike_under_the_schedules")
#: Each schedule's short training run on the GPU machine (fp32, bf16 and fp16; Megatron's
#: Transformer Engine layers); start-up warns until a committed report shows the verdict passed
#: (:mod:`megatron.plugin.gpu_proofs`).
GPU_CHECK = "scripts/gpu_check.py"
ATTENTION_FLAGS = "tests/unit/test_attention_flags.py::"
#: The proof of the planner's flags that the planner reads them.
PLANNER_KNOBS = "tests/unit/test_option_classes.py::test_planner_flags_reach_the_planner"


def experts_apart(schedule: str, why: str) -> str:
    """The refusal of experts spread over ranks (``{flag}``: the flag refused) under a schedule
    that runs each data-parallel replica's documents its own way (``why``: how)."""
    return (f"{{flag}} is not supported by --pipeline-schedule {schedule}: with experts spread "
            f"over ranks, Megatron's token dispatcher exchanges tokens between the data-parallel "
            f"replicas in a collective (all-to-all or all-gather) at every call of an MoE "
            f"layer, so every replica has to call each MoE layer equally often and in the same "
            f"order, and {schedule} {why}. Drop {{flag}}, or use 1f1b or 1f1b-ir (as many "
            f"--seq-length micro-batches on every replica)")


def dispatcher_not_run(schedule: str) -> str:
    """The refusal of ``--moe-token-dispatcher-type`` under a schedule that refuses experts
    spread over ranks (:func:`experts_apart`)."""
    return (f"--moe-token-dispatcher-type is not supported by --pipeline-schedule {schedule}: "
            f"it chooses how the ranks of spread experts exchange tokens, which {schedule} does "
            f"not run (--expert-model-parallel-size and --expert-tensor-parallel-size are "
            f"refused there with MoE layers); with every expert whole on every rank the "
            f"dispatchers route alike: drop the flag")


# The proofs under Megatron's own schedules (``default`` is Megatron's choice: 1f1b, or
# interleaved with virtual stages).
_MODEL = {"default": "golden:pp2", "1f1b": "golden:pp2",
          "interleaved": "golden:pp2_vp2_interleaved"}
_DROPOUT = {"default": "golden:pp2_dropout_1f1b", "1f1b": "golden:pp2_dropout_1f1b",
            "interleaved": "golden:pp2_vp2_dropout_interleaved"}
_TENSOR_PARALLEL = {"default": "golden:pp2_tp2_sp", "1f1b": "golden:pp2_tp2_sp",
                    "interleaved": "golden:pp2_vp2_tp2_sp_interleaved"}
_CONTEXT_PARALLEL = {"default": "golden:pp2_ulysses2_1f1b", "1f1b": "golden:pp2_ulysses2_1f1b",
                     "interleaved": "golden:pp2_vp2_ulysses2_interleaved_default_loss"}
_ROPE_MODEL = {"default": "golden:pp2_dp2", "1f1b": "golden:pp2_dp2",
               "interleaved": "golden:pp2_vp2_rope_interleaved"}
#: ``--cp-comm-type a2a`` (Ulysses, what runs here for every value) beside Ulysses layouts.
_CP_COMM = {"default": "golden:pp2_ulysses2_default_loss_mbs2",
            "1f1b": "golden:pp2_ulysses2_default_loss_mbs2",
            "interleaved": "golden:pp2_vp2_ulysses2_interleaved_default_loss"}
_MODEL_VARIANT = {"default": "golden:pp2_qk_eod_uneven_1f1b",
                  "1f1b": "golden:pp2_qk_eod_uneven_1f1b",
                  "interleaved": "golden:pp2_vp2_qk_eod_interleaved"}
#: Megatron's attention output gate (its ``SelfAttention`` applies it around the document
#: attention, per token), with grouped queries.
_OUTPUT_GATE = {"default": "golden:pp2_gate_1f1b", "1f1b": "golden:pp2_gate_1f1b",
                "interleaved": "golden:pp2_vp2_gate_interleaved"}
#: Under interleaved over 3 virtual stages given by their count (the first holds only the
#: embedding, the last only the loss); the experts spread over ranks with the all-to-all
#: dispatcher.
_MOE = {"default": "golden:pp2_dp2_ep2_a2a_moe_accounted_1f1b",
        "1f1b": "golden:pp2_dp2_ep2_a2a_moe_accounted_1f1b",
        "interleaved": "golden:pp2_vp3_dp2_ep2_a2a_moe_accounted_interleaved"}
#: Each expert's weights split over ``--expert-tensor-parallel-size`` ranks
#: (:data:`SPLIT_EXPERTS`): two replicas of PP=2.
EXPERT_TP = {"default": "golden:pp2_dp2_etp2_moe_1f1b", "1f1b": "golden:pp2_dp2_etp2_moe_1f1b"}
#: Micro-batches of two rows: Megatron's recomputation layouts, and Megatron's default loss
#: (each micro-batch's token mean).
_MICRO_BATCHES = {"default": "golden:pp2_block_recompute_mbs2",
                  "1f1b": "golden:pp2_default_loss_mbs2",
                  "interleaved": "golden:pp2_vp2_interleaved_uniform_recompute_mbs2"}
_EXAMPLES = {"default": EXAMPLES, "1f1b": EXAMPLES}
_RECOMPUTATION = {"default": "golden:pp2_full_recompute", "1f1b": "golden:pp2_full_recompute",
                  "interleaved": "golden:pp2_vp2_interleaved_block_recompute"}
_DISTRIBUTED_OPTIMIZER = {"default": "golden:pp2_dp2_dplast_distopt_1f1b",
                          "1f1b": "golden:pp2_dp2_dplast_distopt_1f1b",
                          "interleaved": "golden:pp2_vp2_dp2_dplast_distopt_interleaved"}
#: The distributed optimizer's all-gathers dispatched in its step (two replicas of PP=2 with
#: two virtual stages: the losses of the run that gathers in the forwards, every iteration).
PARAM_GATHER_IN_STEP = ("tests/e2e/test_pretrain.py::"
                        "test_parameter_gather_in_the_optimizer_step_trains_alike")
#: Megatron's DDP summing a step's micro-batches and reducing them in bf16 buffers with
#: ``--bf16 --grad-reduce-in-bf16`` (against the same gradients summed in bf16 and in fp32).
GRAD_REDUCE_IN_BF16 = ("tests/unit/test_grad_reduce_in_bf16.py::"
                       "test_grad_reduce_in_bf16_sums_the_micro_batches_in_bf16")
#: Megatron's DDP averaging the gradients in its collectives (``--ddp-average-in-collective``:
#: unscaled gradients, ``ReduceOp.AVG``; on gloo as NCCL computes it,
#: :mod:`megatron.plugin.cpu_compat`), with Megatron's default loss (Megatron refuses it beside
#: ``--calculate-per-token-loss``): in the all-reduce under Megatron's schedules (under
#: interleaved with experts spread over the data-parallel replicas, whose gradients Megatron
#: scales before the average).
_AVERAGE_IN_COLLECTIVE = {
    "default": "golden:pp2_dp2", "1f1b": "golden:pp2_dp2",
    "interleaved": "golden:pp2_vp3_dp2_ep2_a2a_moe_accounted_interleaved"}
#: Megatron's partial distributed optimizer (``--num-distributed-optimizer-instances 2`` at two
#: data-parallel replicas: each instance one replica holding its whole optimizer state, the
#: instances' gradients all-reduced after each instance's reduce-scatter; on a CPU the
#: communication stream megatron-core creates for it is the compatibility layer's stand-in).
_OPTIMIZER_INSTANCES = {"default": "golden:pp2_dp2", "1f1b": "golden:pp2_dp2"}
_MEGATRON = ("default", "1f1b", "interleaved")


#: ``Honoured.refusal`` of a schedule's own flag: under a schedule without it, it does nothing.
FOREIGN = "foreign"
_NO_TEST = ("no test proves it under this schedule yet: drop it, or use a schedule that has "
            "one")
#: Megatron's auxiliary load-balancing loss (``aux_loss``): the Switch formula over the tokens
#: of each router call, padding included, which Megatron's schedules make once per micro-batch.
#: Honoured where the router's calls are Megatron's micro-batches (the moe layouts, under
#: interleaved with Megatron's default loss, against a reference that computes it over the same
#: micro-batches; the router gradients it adds are checked far above the comparison's bound by
#: ``test_the_aux_loss_moves_the_router_gradients``).
_AUX_PER_UNIT = (
    "Megatron's auxiliary load-balancing loss is a formula over the tokens of each call of "
    "the router (padding included), which Megatron's schedules make once per micro-batch of "
    "--micro-batch-size packed rows; this schedule calls the router on units of its own "
    "(sppo: subsequences whose multiplexed shares cut a slice over several ranks; helix: MLP "
    "chunks of micro-batches), whose statistics are not Megatron's: use --pipeline-schedule "
    "1f1b, interleaved or 1f1b-ir with --moe-aux-loss-coeff, or leave it at 0 (dropless "
    "routing without it is exact under every schedule)")
#: The project's per-document load-balancing loss (``--moe-per-document-aux-loss-coeff``,
#: :mod:`megatron.plugin.layers.document_router`), honoured by the schedules whose router calls
#: are document chunks (packed documents, or slices of one), never Megatron's micro-batches.
_AUX_PER_DOCUMENT_ELSEWHERE = (
    "the per-document load-balancing loss is built only for the schedules whose router calls "
    "are document chunks (elastic, seq1f1b): drop --moe-per-document-aux-loss-coeff, and pass "
    "--moe-aux-loss-coeff for Megatron's per micro-batch (1f1b, interleaved, 1f1b-ir)")


def _megatron(proofs: Mapping[str, str], *names: str) -> dict:
    """``proofs`` under Megatron's schedules ``names`` (all three when none are named)."""
    return {name: proofs[name] for name in names or _MEGATRON}


HONOURED: dict[str, Honoured] = {
    **{name: Honoured(_MODEL, _NO_TEST) for name in MODEL},
    **{name: Honoured(_DROPOUT, _NO_TEST) for name in DROPOUT},
    "micro_batch_size": Honoured(_MICRO_BATCHES, _NO_TEST),
    **{name: Honoured(_TENSOR_PARALLEL, _NO_TEST) for name in TENSOR_PARALLEL},
    # Megatron's --cp-comm-type names how its attention exchanges K/V between the
    # context-parallel ranks (p2p: a ring, its default; a2a: Ulysses all-to-all; allgather;
    # a2a+p2p: all-to-all inside --hierarchical-context-parallel-sizes groups, a ring across);
    # the attention's result is the same for each. The document attention runs Ulysses for
    # every value (megatron/plugin/layers/attention.py): a2a is what runs, and p2p gets the
    # same loss and gradients with Ulysses' communication (4 all-to-alls per layer) and
    # memory (each rank attends over whole rows for heads / CP heads) instead of a ring's,
    # which start-up says (megatron/plugin/substitutions.py).
    "cp_comm_type": Honoured(
        _CP_COMM, "the document attention exchanges Q, K and V by Ulysses all-to-all whatever "
                  "--cp-comm-type names (the result of attention is the same); allgather and "
                  "a2a+p2p name communication it does not build: pass --cp-comm-type a2a (or "
                  "leave Megatron's default p2p, which runs the same Ulysses)",
        values=("p2p", "a2a")),
    "context_parallel_size": Honoured(_CONTEXT_PARALLEL, _NO_TEST),
    **{name: Honoured(_ROPE_MODEL, _NO_TEST) for name in ROPE_MODEL},
    "position_embedding_type": Honoured(
        _ROPE_MODEL, _NO_TEST, values=("learned_absolute", "rope")),
    "normalization": Honoured(_ROPE_MODEL, _NO_TEST, values=("LayerNorm", "RMSNorm")),
    **{name: Honoured(_MODEL_VARIANT, _NO_TEST) for name in MODEL_VARIANT},
    **{name: Honoured(_megatron(_MODEL_VARIANT, "default", "1f1b"), _NO_TEST)
       for name in UNEVEN_SPLIT},
    **{name: Honoured(_MOE, _NO_TEST) for name in ACCOUNTED_SPLIT},
    "attention_output_gate": Honoured(_OUTPUT_GATE, _NO_TEST),
    "mup_width_mult": Honoured({}, "Megatron computes the MuP width multiplier as --hidden-size "
                                   "/ --mup-base-hidden-size and replaces any value given: drop "
                                   "--mup-width-mult and set --mup-base-hidden-size",
                               values=(1.0,)),
    **{name: Honoured(_MOE, _NO_TEST) for name in MOE},
    "moe_aux_loss_coeff": Honoured(_MOE, _AUX_PER_UNIT),
    "moe_per_document_aux_loss_coeff": Honoured({}, _AUX_PER_DOCUMENT_ELSEWHERE),
    # Expert parallelism (the experts spread over ranks carved from the data-parallel
    # replicas, each token sent to its experts' ranks by Megatron's token dispatcher) where
    # every replica calls each MoE layer equally often and in the same order.
    "expert_model_parallel_size": Honoured(_MOE, _NO_TEST),
    # Megatron's all-to-all token dispatcher (its default is the all-gather one).
    "moe_token_dispatcher_type": Honoured(
        _MOE, "no test proves the other dispatchers here (flex runs NVIDIA's DeepEP or "
              "HybridEP kernels): drop the flag (Megatron's default, the all-gather "
              "dispatcher, runs then), or pass allgather or alltoall under 1f1b, "
              "interleaved or 1f1b-ir",
        values=("allgather", "alltoall")),
    # 4 heads in 2 K/V groups: the rope variant's model shape under Megatron's 1F1B.
    **{name: Honoured({"interleaved": "golden:pp2_vp2_gqa_interleaved",
                       **each(("default", "1f1b"), "golden:pp2_dp2")}, _NO_TEST)
       for name in GROUPED_QUERIES},
    # Megatron's fused cross entropy (``--cross-entropy-loss-fusion``), proved by Llama-3's
    # example, which passes it: every schedule reaches it through Megatron's ``forward_step``
    # and the model's own loss, on the last stage, once per unit, and its loss and gradient are
    # per token, so the units do not change them. It returns the logits' gradient in bf16
    # (:data:`ROPE_MODEL`), so schedules are compared with each other, not with the golden
    # bound.
    "cross_entropy_loss_fusion": Honoured(_EXAMPLES, _NO_TEST),
    **{name: Honoured(_RECOMPUTATION, _NO_TEST) for name in RECOMPUTATION},
    **{name: Honoured(
        {"default": f"golden:{layout}", "interleaved": f"golden:{layout}"},
        "the document schedules run one model chunk per rank; drop the flag, or use "
        "'interleaved'")
       for name, layout in (
           ("num_layers_per_virtual_pipeline_stage", "pp2_vp2_interleaved"),
           ("num_virtual_stages_per_pipeline_rank",
            "pp2_vp3_dp2_ep2_a2a_moe_accounted_interleaved"))},
    # How Megatron's interleaved schedule orders its micro-batches and transfers.
    **{name: Honoured(
        {"default": "golden:pp2_vp2_qk_eod_interleaved",
         "interleaved": "golden:pp2_vp2_qk_eod_interleaved"},
        "it tunes Megatron's interleaved schedule (virtual pipeline stages), which this "
        "schedule does not run; drop the flag, or use 'interleaved'")
       for name in ("overlap_p2p_comm_warmup_flush", "microbatch_group_size_per_vp_stage")},
    # The distributed optimizer's reduce-scatter and parameter all-gather go through the same
    # DDP hooks as the overlapped reduction.
    "overlap_grad_reduce": Honoured({**_EXAMPLES,
                                     **_megatron(_DISTRIBUTED_OPTIMIZER, "interleaved")},
                                    _NO_TEST),
    "ddp_bucket_size": Honoured(_DISTRIBUTED_OPTIMIZER, _NO_TEST),
    **{name: Honoured(_DISTRIBUTED_OPTIMIZER, _NO_TEST) for name in DISTRIBUTED_OPTIMIZER},
    "ddp_average_in_collective": Honoured(_AVERAGE_IN_COLLECTIVE, _NO_TEST),
    "num_distributed_optimizer_instances": Honoured(_OPTIMIZER_INSTANCES, _NO_TEST),
    # Megatron-LM accepts it under its interleaved schedule only (virtual stages, the legacy
    # --ckpt-format torch), where its train() leaves the dispatch to the optimizer's step.
    "overlap_param_gather_with_optimizer_step": Honoured(
        {name: PARAM_GATHER_IN_STEP for name in ("default", "interleaved")},
        "it dispatches the parameter all-gathers in the optimizer's step for Megatron's "
        "interleaved schedule (virtual pipeline stages), which this schedule does not run: "
        "drop the flag (--overlap-param-gather then gathers the parameters during the next "
        "step's forwards)"),
    # Megatron's DDP builds the gradient buffers (bf16 with --bf16) and the schedules do not
    # read it; without --bf16 it does nothing (start-up says so).
    "grad_reduce_in_bf16": Honoured(
        each(("default", "1f1b"), GRAD_REDUCE_IN_BF16),
        "no test proves it under this schedule yet: drop it"),
    **{name: Honoured(each(("default", "1f1b"), GPU_CHECK), _NO_TEST) for name in HALF_PRECISION},
    # Megatron's local layers (the project's default) or its Transformer Engine layers, with
    # the document attention either way (megatron/plugin/layers/te_layers.py, which says what
    # sppo's offloading and K/V store do with TE's layers); the start-up also refuses TE
    # without CUDA or the transformer_engine package, and with --sppo-multiplex (arguments.py).
    "transformer_impl": Honoured(each(_MEGATRON, GPU_CHECK), _NO_TEST,
                                 values=("local", "transformer_engine")),
    # Always Megatron-LM's default, or the project's: ``--dataloader-type external`` (whole
    # documents per global batch), positions and attention reset at every document.
    "dataloader_type": Honoured({}, "pretrain_gpt_elastic.py reads whole documents per global "
                                    "batch itself; drop the flag", values=("external",)),
    "reset_position_ids": Honoured({}, "positions restart at every document", values=(True,)),
    "reset_attention_mask": Honoured({}, "no token attends across a document boundary",
                                     values=(True,)),
    # Megatron's plain GPT (torch norms, run under ``default``) needs the persistent LayerNorm
    # off to load elastic's checkpoint.
    "no_persist_layer_norm": Honoured(
        {**_TENSOR_PARALLEL, "default": "tests/e2e/test_pretrain.py::"
                                        "test_elastic_checkpoint_is_a_megatron_checkpoint_of_a_"
                                        "plain_gpt"},
        _NO_TEST),
    # The document attention's kernels (megatron/plugin/layers/attention_kernels.py), the
    # same under every schedule: --attention-backend picks the kernel (``local`` is refused:
    # Megatron-LM takes it only with --spec local), and under --deterministic-mode (torch's
    # deterministic algorithms) they run deterministic backwards. Their softmax is fp32
    # whatever the inputs: :data:`SOFTMAX_IN_FP32`.
    "attention_backend": Honoured(
        {"*": ATTENTION_FLAGS + "test_attention_backend_picks_the_kernel"},
        "Megatron-LM takes --attention-backend local only with --spec local (its legacy layer "
        "spec, not built here): use --attention-backend unfused, the same matrix-product "
        "attention", values=("flash", "fused", "unfused", "auto")),
    "deterministic_mode": Honoured(
        {"*": ATTENTION_FLAGS + "test_deterministic_mode_repeats_losses_and_grads_bitwise"}, ""),
    # The project's own options.
    "pipeline_schedule": Honoured({"*": "golden:pp2"}, ""),
    "pipeline_timeout_s": Honoured(
        {"*": "tests/e2e/test_hangs.py::"
              "test_a_stopped_rank_is_named_under_the_executor_and_megatrons_schedule"}, ""),
    "metrics_jsonl": Honoured(
        {"*": "tests/e2e/test_pretrain.py::test_training_logs_megatron_lines_and_metrics"}, ""),
    # Megatron-LM's FLOP count, told each training step's document lengths
    # (megatron/plugin/flop_count.py; refused where the release cannot take them:
    # arguments.RULES).
    "log_throughput": Honoured({"*": "tests/e2e/test_flop_count.py::"
                                     "test_megatron_counts_the_flops_of_the_real_documents"}, ""),
    "trace_dir": Honoured(
        {"*": "tests/e2e/test_pretrain.py::"
              "test_ir_schedule_prints_the_same_losses_and_writes_measured_traces"}, ""),
}
_OTHER_MODELS = ("it configures a model or task other than GPT pretraining, which this script does "
                 "not run; drop it")
_MLA = "multi-latent attention is not built; drop the flag"
_MOE = ("no test proves this mixture-of-experts option yet (dropless routing with Megatron's "
        "MoE layer is: --num-experts, --moe-router-topk, --moe-ffn-hidden-size); drop the flag")
_TE = ("it configures Transformer Engine beyond its layers (FP8 or FP4 recipes, communication "
       "overlap, TE's op fuser, activation or RNG tracker), which no test proves here yet; drop "
       "the flag (--transformer-impl transformer_engine itself is supported)")
_HYBRID = ("only the GPT layer spec with the document attention is built (no Mamba, linear, "
           "sparse or heterogeneous layers); drop the flag")
_ATTENTION = ("the document attention does not implement it "
              "(megatron/plugin/layers/attention.py); drop the flag")
_CP_KIND = ("context parallelism here is Ulysses all-to-all over the document attention's "
            "heads; drop the flag")
_UNPROVEN_MODEL = ("no test proves it under any schedule yet (the model's layers read it); drop it")
_PIPELINE_LAYOUT = ("no test proves an explicit pipeline layout yet: place the layers with "
                    "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                    "or --account-for-embedding-in-pipeline-split / "
                    "--account-for-loss-in-pipeline-split, or num-layers / PP on every stage, "
                    "and drop the flag")
_GRAPHS = ("the document batches change shape every step; drop the flag (CUDA graphs, "
           "deferred weight gradients and activation offloading of Megatron are not run "
           "here: use sppo's --sppo-offload)")
_FSDP = ("no test proves fully sharded data parallelism or custom data-parallel layouts "
         "yet; drop the flag")
_DATA = ("the document batches read --data-path with --split, whole documents, "
         "--global-batch-size of them per step; drop the flag")

#: Megatron's fused kernels: on by default where CUDA (and for the weight-gradient accumulation
#: apex's extension) is, off without it (:data:`megatron.plugin.arguments._CPU_DEFAULTS`); their
#: flags (``--no-bias-dropout-fusion`` and the like) only turn a fusion off, and a fused kernel
#: computes what the unfused operations do. Megatron's layers read them the same way under every
#: schedule: helix's layer parts call Megatron's bias-dropout-add with
#: ``config.bias_dropout_fusion`` as its ``TransformerLayer`` does (helix/program.py), and the
#: model config turns the weight-gradient accumulation's fusion off where it cannot run
#: (:func:`megatron.plugin.model.model_config`: it never turns one on, so it does not depend on
#: the flag).
FUSIONS = _names("""
    bias_dropout_fusion bias_gelu_fusion bias_swiglu_fusion gradient_accumulation_fusion
""")

#: Megatron's switches of where its unfused softmax is computed: the document attention's
#: kernels compute the scores and their softmax in fp32 whatever the inputs, as Megatron's
#: flash and fused kernels do, so ``--attention-softmax-in-fp32`` is what always runs and
#: ``--apply-query-key-layer-scaling`` (a division by the layer number before a half-precision
#: product, undone inside the fp32 softmax) is the identity. No number depends on them; where
#: Megatron-LM would compute a half-precision softmax (``--attention-backend unfused`` under
#: ``--bf16``/``--fp16`` without ``--attention-softmax-in-fp32``), start-up says that fp32 runs
#: instead (:data:`megatron.plugin.substitutions.CORE`).
SOFTMAX_IN_FP32 = _names("""
    apply_query_key_layer_scaling attention_softmax_in_fp32
""")

#: Read by none of the model, attention or schedule code: Megatron-LM's loop honours them the
#: same way under every schedule (``--empty-unused-memory-level``, for instance: its
#: ``train_step`` empties CUDA's allocator cache after the forward-backward, whichever schedule
#: ran it, and after the optimizer step; no number changes, and without CUDA nothing happens,
#: which start-up says).
INERT = _names("""
    adam_beta1 adam_beta2 adam_eps adlr_autoresume adlr_autoresume_interval app_tag_run_name
    app_tag_run_version apply_rope_fusion apply_wd_to_qk_layernorm async_ckpt_cpu_priority
    async_ckpt_io_priority
    async_ckpt_use_cpu_shm async_save async_strategy auto_detect_ckpt_format
    barrier_with_L1_time
    calc_ft_timeouts chat_template check_for_large_grads check_for_nan_in_loss_and_grad
    check_for_spiky_loss check_weight_hash_across_dp_replicas_interval
    ckpt_assume_constant_structure ckpt_convert_format ckpt_convert_save
    ckpt_convert_update_legacy_dist_opt_format ckpt_format ckpt_fully_parallel_load
    ckpt_fully_parallel_load_exchange_algo ckpt_fully_parallel_load_process_group
    ckpt_fully_parallel_save ckpt_fully_parallel_save_deprecated
    ckpt_fully_parallel_save_process_group ckpt_load_validate_sharding_integrity ckpt_step
    clip_grad config_logger_dir create_all_gather_group data_cache_path
    create_attention_mask_in_dataloader data_parallel_random_init mock_data seed train_samples
    data_path dataloader_defer_npy_index_mmap
    dataloader_fast_cache_load decoupled_lr decoupled_min_lr deprecated_use_mcore_models
    disable_jit_fuser disable_msc_deprecated disable_straggler_on_startup
    disable_symmetric_registration dist_ckpt_format_deprecated
    dist_ckpt_optim_fully_reshardable dist_ckpt_save_pre_mcore_014 dist_ckpt_strictness
    dist_ckpt_workers distrib_optim_fully_reshardable_mem_efficient distributed_backend
    distributed_timeout_minutes distributed_timeout_seconds_after_init
    dump_param_to_param_group_map empty_unused_memory_level enable_ft_package enable_msc enable_one_logger
    end_weight_decay error_injection_rate error_injection_type eval_interval eval_iters
    exit_duration_in_mins exit_interval exit_on_missing_checkpoint exit_signal
    exit_signal_handler exit_signal_handler_for_dataloader exit_signal_handler_for_training
    fault_injector_delay_start_iteration fault_injector_fault_delay
    fault_injector_fault_probabilities fault_injector_fault_types
    fault_injector_mtti_seconds fault_injector_num_ranks fault_injector_offset_seconds
    fault_injector_ranks fault_injector_seed finetune flight_recorder_dump_on_timeout
    flight_recorder_dump_path flight_recorder_extra_dump_on_exec
    flight_recorder_include_only_active flight_recorder_include_stack_trace
    flight_recorder_trace_buffer_size freeze_all_layers ft_num_warmup_iters
    gpu_sniff_test_interval help high_priority_stream_groups
    hysteresis inference_disable_triton_nvls_kernels inference_fuse_tp_communication
    inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
    inference_moe_token_dispatcher_type inference_rng_tracker init_method_std
    init_method_xavier_uniform initial_loss_scale inprocess_active_world_size
    inprocess_barrier_timeout inprocess_completion_timeout inprocess_empty_cuda_cache
    inprocess_granularity inprocess_hard_timeout inprocess_heartbeat_interval
    inprocess_heartbeat_timeout inprocess_last_call_wait inprocess_max_iterations
    inprocess_monitor_process_interval inprocess_monitor_thread_interval
    inprocess_progress_watchdog_interval inprocess_restart inprocess_soft_timeout
    inprocess_termination_grace_time iterations_to_skip lazy_mpu_init lion_beta1 lion_beta2
    load load_main_params_from_ckpt local_rank log_device_memory_used log_energy
    log_interval log_loss_scale_to_tensorboard log_max_attention_logit log_memory_interval
    log_memory_to_tensorboard log_num_zeros_in_grad log_params_norm log_progress
    log_straggler log_timers_to_tensorboard log_validation_ppl_to_tensorboard
    log_world_size_to_tensorboard logging_level loss_scale loss_scale_window lr
    lr_decay_iters lr_decay_samples lr_decay_style lr_warmup_fraction lr_warmup_init
    lr_warmup_iters lr_warmup_samples lr_wsd_decay_iters lr_wsd_decay_samples
    lr_wsd_decay_style manual_gc manual_gc_eval manual_gc_interval masked_softmax_fusion
    memory_snapshot_path merge_file metadata_path min_loss_scale min_lr mmap_bin_files
    moe_routing_trace_capture_logits moe_routing_trace_dump_weights
    moe_routing_trace_max_training_iters moe_routing_trace_path muon_coefficient_type
    muon_extra_scale_factor muon_fp32_matmul_prec muon_momentum muon_nesterov
    muon_num_ns_steps muon_scalar_optimizer muon_scale_mode muon_split_qkv muon_tp_mode
    muon_use_nesterov nccl_all_reduce_for_prefill nccl_communicator_config_path
    no_load_optim no_load_rng no_save_optim no_save_rng no_weight_decay_cond_type
    non_persistent_ckpt_type non_persistent_global_ckpt_dir non_persistent_local_ckpt_algo
    non_persistent_local_ckpt_dir non_persistent_save_interval null_tokenizer_eod_id
    null_tokenizer_pad_id num_dataset_builder_threads num_workers nvtx_ranges
    one_logger_async one_logger_project one_logger_run_name optimizer
    override_ckpt_iteration override_opt_param_scheduler pad_vocab_size padded_vocab_size
    perform_initialization pretrained_checkpoint profile profile_ranks profile_step_end
    profile_step_start pytorch_profiler_collect_callstack pytorch_profiler_collect_chakra
    pytorch_profiler_collect_shapes record_memory_history record_shapes replication
    replication_factor replication_jump rerun_mode result_rejected_tracker_filename
    run_workload_inspector_server save save_activations_interval save_dgrads_interval
    save_interval save_params_interval save_retain_interval save_tokens_per_expert_interval
    save_wgrads_interval sgd_momentum sharp_enabled_group skip_train special_tokens split
    start_eval_at_iter start_weight_decay straggler_ctrlr_port straggler_minmax_count
    stream_ckpt_dequant strict_fsdp_dtensor_load suggested_communication_unit_size
    tensorboard_dir tensorboard_log_interval tensorboard_queue_size test_mode
    tiktoken_num_special_tokens tiktoken_pattern tiktoken_special_tokens timing_log_level
    timing_log_option tokenizer_hf_include_special_tokens
    tokenizer_hf_no_include_special_tokens tokenizer_hf_no_use_fast tokenizer_hf_use_fast
    tokenizer_metadata tokenizer_model tokenizer_sentencepiece_ignore_extra_whitespaces
    tokenizer_sentencepiece_legacy tokenizer_special_tokens tokenizer_type train_iters
    train_sync_interval trust_remote_code use_checkpoint_args
    use_checkpoint_opt_param_scheduler use_cpu_initialization use_dist_ckpt_deprecated
    use_gloo_process_groups use_mp_args_from_checkpoint_args use_persistent_ckpt_worker
    use_pytorch_profiler use_sharp use_tokenizer_model_from_checkpoint_args verify_integrity
    vocab_extra_ids vocab_file wandb_entity wandb_exp_name wandb_project wandb_save_dir
    warmup weight_decay weight_decay_incr_style
""") | FUSIONS | SOFTMAX_IN_FP32


#: What Megatron's full recomputation takes, for the refusals that point to it.
FULL_RECOMPUTE = ("--recompute-granularity full --recompute-method uniform "
                  "--recompute-num-layers 1 (every layer of each stage recomputed) or "
                  "--recompute-method block --recompute-num-layers N (the first N layers of "
                  "each stage)")
#: ``--recompute-activations`` is Megatron-LM's older spelling of ``--recompute-granularity
#: selective`` (``validate_args`` sets the granularity from it and drops it). Refused by name with
#: what to pass instead: selective recomputation under Megatron's own schedules, what a
#: registered schedule says under it (``ScheduleSpec.refusals``), else ``*``.
OLDER_SELECTIVE = "it is Megatron-LM's older spelling of --recompute-granularity selective"
SELECTIVE_INSTEAD = (f"{OLDER_SELECTIVE} (recompute the core attention): pass "
                     "--recompute-granularity selective instead")
RECOMPUTE_ACTIVATIONS = {
    **{schedule: SELECTIVE_INSTEAD for schedule in _MEGATRON},
    "*": f"{OLDER_SELECTIVE}: pass --recompute-granularity selective where the schedule runs "
         f"it (default, 1f1b, interleaved, 1f1b-ir), else {FULL_RECOMPUTE}",
}


#: Refused under every schedule when given with a value other than the default: the reason,
#: or a mapping of schedule (``*``: any other) to the reason under it.
REFUSED: dict[str, str | Mapping[str, str]] = {
    **_each("""
        bert_binary_head bert_embedder_type bert_load biencoder_projection_dim
        biencoder_shared_query_context_model block_data_path classes_fraction
        cuda_graph_modules cuda_graph_scope cuda_graph_scope_deprecated
        data_per_class_fraction data_sharding decode_only_cuda_graphs decoder_num_layers
        decoder_seq_length dino_bottleneck_size dino_freeze_last_layer dino_head_hidden_size
        dino_local_crops_number dino_local_img_size dino_norm_last_layer dino_teacher_temp
        dino_warmup_teacher_temp dino_warmup_teacher_temp_epochs embedding_path
        enable_chunked_prefill encoder_num_layers encoder_seq_length evidence_data_path
        grpo_clamp_eps_lower grpo_clamp_eps_upper grpo_entropy_term_weight
        grpo_filter_groups_with_same_reward grpo_group_size grpo_iterations grpo_kl_beta
        grpo_prompts_per_step head_lr_mult ict_head_size ict_load img_h img_w
        indexer_batch_size indexer_log_interval inference_batch_times_seqlen_threshold
        inference_coordinator_port inference_cuda_graph_all_prefills
        inference_cuda_graph_max_tokens inference_disable_ep_consensus
        inference_dynamic_batching inference_dynamic_batching_async_sched_mode
        inference_dynamic_batching_block_size inference_dynamic_batching_buffer_size_gb
        inference_dynamic_batching_cuda_graph_max_tokens
        inference_dynamic_batching_cuda_graph_mixed_prefill_count
        inference_dynamic_batching_cuda_graph_sizing_distribution
        inference_dynamic_batching_enable_prefix_caching
        inference_dynamic_batching_logprobs_mode
        inference_dynamic_batching_mamba_memory_ratio
        inference_dynamic_batching_max_requests inference_dynamic_batching_max_tokens
        inference_dynamic_batching_num_cuda_graphs
        inference_dynamic_batching_paused_buffer_size_gb
        inference_dynamic_batching_prefix_caching_coordinator_policy
        inference_dynamic_batching_prefix_caching_eviction_policy
        inference_dynamic_batching_prefix_caching_mamba_gb
        inference_dynamic_batching_prefix_caching_routing_alpha
        inference_dynamic_batching_sampling_backend
        inference_dynamic_batching_track_generated_token_events
        inference_dynamic_batching_track_paused_request_events
        inference_dynamic_batching_unified_memory_level inference_logging_step_interval
        inference_max_requests inference_max_seq_length inference_shards
        inference_text_gen_server_logging inference_use_synchronous_zmq_collectives
        inference_wandb_logging iter_per_epoch langrl_env_config logits_load_decode_threads
        logits_load_dir logits_load_ignore_errors logits_load_kd_loss_alpha
        logits_load_msc_prefetch_depth logits_load_prefetch_factor logits_save_dir
        logits_save_dtype logits_save_top_k logits_save_top_p logits_save_top_p_min_k
        mamba_inference_conv_states_dtype mamba_inference_ssm_states_dtype mask_factor
        mask_prob mask_type max_tokens_to_oom  num_channels num_classes
        num_speculative_tokens offset_sampling_seed_by_dp_rank output_bert_embeddings
        patch_dim per_dataset_sequences_path perform_rl_step phase_transition_iterations
        query_in_block_prob refit_method relative_attention_max_distance
        relative_attention_num_buckets retriever_report_topk_accuracies
        retriever_score_scaling rl_consumption_granularity rl_default_temperature
        rl_default_top_k rl_default_top_p rl_generation_batch_size rl_generation_lag
        rl_importance_sampling_truncation_coef rl_inference_expert_model_parallel_size
        rl_inference_expert_tensor_model_parallel_size rl_inference_logprobs_is_correction
        rl_inference_model_unified_memory_level rl_inference_parsers
        rl_inference_pipeline_model_parallel_size rl_inference_tensor_model_parallel_size
        rl_kv_cache_management_mode rl_num_parallel_generation_batches
        rl_num_parallel_generations rl_offload_inference_model_weights_when_idle
        rl_offload_optimizer_during_inference rl_parallel_generation_tasks
        rl_partial_rollouts rl_persist_cuda_graphs rl_profile rl_profile_dir
        rl_prompts_per_eval rl_sequence_packing_algo
        rl_sequence_packing_max_sequences_per_bin rl_skip_bos_token
        rl_submission_granularity rl_training_cuda_graphs rl_use_sequence_packing
        rl_verify_model_weights_swap sample_rate sft sft_tokenizer_prompt_format
        short_seq_prob swin_backbone_type titles_data_path use_legacy_static_engine
        use_one_sent_docs vision_backbone_type vision_pretraining vision_pretraining_type
    """, _OTHER_MODELS),
    **_each("""
        cache_mla_latents kv_lora_rank mla_down_proj_fusion mscale mscale_all_dim
        q_lora_rank qk_head_dim qk_pos_emb_head_dim rotary_scaling_factor v_head_dim
    """, _MLA),
    **_each("""
        ep_overlap_early_attn_memory_release
        expert_tensor_parallel_num_weight_shards
        high_priority_a2a_comm_stream moe_apply_probs_on_input
        moe_deepep_num_sms moe_enable_deepep moe_enable_routing_replay
        moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grouped_gemm
        moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute
        moe_hybridep_num_sms moe_hybridep_num_sms_preprocessing
        moe_hybridep_pad_uneven_dispatch_inputs moe_input_jitter_eps moe_latent_size
        moe_layer_freq moe_layer_recompute moe_mlp_glu_interleave_size
        moe_ncclep_static_shape moe_ncclep_zero_copy
        moe_pad_experts_for_cuda_graph_inference moe_paged_stash
        moe_paged_stash_buffer_size_factor_cpu moe_paged_stash_buffer_size_factor_cuda
        moe_paged_stash_page_size moe_per_layer_logging moe_permute_fusion
        moe_permute_fusion_into_hybridep moe_router_bias_update_rate
        moe_router_force_biased
        moe_router_force_load_balancing moe_router_fusion moe_router_group_topk
        moe_router_num_groups moe_router_padding_for_fp8
        moe_router_padding_for_quantization moe_router_pre_softmax
        moe_router_quantile_balancing_ema moe_router_score_function
        moe_router_topk_scaling_factor moe_routing_trace_capture_hidden_states
        moe_shared_expert_glu_interleave_size moe_shared_expert_overlap
        moe_single_grouped_bias moe_single_grouped_weight
        moe_upcycling_granularity moe_use_upcycling moe_z_loss_coeff
        overlap_dispatch_backward_with_experts_wgrad
        overlap_moe_expert_parallel_comm use_grouped_gemm_for_dense_mlp
        use_grouped_gemm_for_shared_expert
    """, _MOE),
    **_each("""
        first_last_layers_bf16 fp4 fp4_param fp4_param_gather fp4_quantizer_factory
        fp4_recipe fp8 fp8_amax_compute_algo fp8_amax_history_len fp8_interval fp8_margin
        fp8_output_proj fp8_param_gather fp8_quantizer_factory fp8_recipe fp8_wgrad
        fused_residual_rmsnorm keep_fp8_transpose_cache kitchen_attention_backend nccl_ub
        num_layers_at_end_in_bf16 num_layers_at_start_in_bf16
        reuse_grad_buf_for_mxfp8_param_ag symmetric_ar_type te_precision_config_file
        te_rng_tracker tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad
        tp_comm_overlap tp_comm_overlap_ag tp_comm_overlap_cfg tp_comm_overlap_rs
        tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs use_kitchen_attention
        use_te_activation_func use_transformer_engine_op_fuser
    """, _TE),
    **_each("""
        dsa_indexer_head_dim dsa_indexer_k_norm_epsilon dsa_indexer_k_norm_fp32
        dsa_indexer_loss_coeff dsa_indexer_n_heads dsa_indexer_rope_interleaved
        dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_skip_topk_offset
        dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss
        dsa_kernel_backend enable_experimental experimental_attention_variant
        heterogeneous_layers_config_encoded_json heterogeneous_layers_config_path
        hybrid_layer_pattern hybrid_override_pattern is_hybrid_model linear_attention_freq
        linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads
        linear_num_value_heads linear_value_head_dim mamba_head_dim mamba_num_groups
        mamba_num_heads mamba_state_dim mamba_training_ssm_states_dtype mtp_detach_heads
        mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_num_layers mtp_standalone
        mtp_use_repeated_layer multi_latent_attention spec use_legacy_models
        use_mamba_mem_eff_path yaml_cfg
    """, _HYBRID),
    **_each("""
        add_qkv_bias
        batch_invariant_mode flash_attention_version flash_decode
        mrope_section no_rope_freq qk_clip qk_clip_alpha qk_clip_threshold qk_l2_norm
        rope_scaling_factor rope_type
        rotary_seq_len_interpolation_factor softmax_type use_flash_attn use_rope_scaling
        use_rotary_position_embeddings window_attn_skip_freq window_size yarn_beta_fast
        yarn_beta_slow yarn_correction_range_round_to_int
        yarn_original_max_position_embeddings
    """, _ATTENTION),
    **_each("""
        hierarchical_context_parallel_sizes hybrid_context_parallel max_seqlen_per_dp_cp_rank
    """, _CP_KIND),
    **_each("""
        accumulate_allreduce_grads_in_fp32 activation_func_clamp_value
        add_position_embedding apply_residual_connection_post_layernorm
        checkpoint_activations clone_scatter_output_in_embedding cross_entropy_fusion_impl
        disable_bf16_reduced_precision_matmul distribute_saved_activations
        embedding_init_method_std fp16_lm_cross_entropy fp32_residual_connection
        glu_linear_offset layernorm_epsilon
        make_vocab_size_divisible_by mlp_chunks_for_prefill mlp_chunks_for_training
        onnx_safe openai_gelu
        quick_geglu recompute_modules
        use_fused_weighted_squared_relu
    """, _UNPROVEN_MODEL),
    **_each("""
        overlap_p2p_comm pipeline_model_parallel_comm_backend
        pipeline_model_parallel_layout scatter_gather_tensors_in_pipeline
        use_ring_exchange_p2p variable_seq_lengths
    """, _PIPELINE_LAYOUT),
    **_each("""
        activation_offload_fraction cpu_offloading_num_layers
        cpu_offloading_retain_pinned_cpu_buffers cuda_graph_impl cuda_graph_warmup_steps
        defer_embedding_wgrad_compute delay_offload_until_cuda_graph delay_wgrad_compute
        delta_offload_bytes_across_pp_ranks enable_cuda_graph external_cuda_graph
        fine_grained_activation_offloading fine_grained_offloading_max_inflight_offloads
        inference_cuda_graph_scope min_offloaded_tensor_size offload_modules
        optimizer_cuda_graph wgrad_deferral_limit
    """, _GRAPHS),
    **_each("""
        align_grad_reduce align_param_gather data_parallel_sharding_strategy
        ddp_num_buckets
        ddp_pad_buckets_for_high_nccl_busbw
        ddp_param_name_patterns_for_fp32_local_accumulation
        ddp_reduce_scatter_with_fp32_accumulation enable_full_sharding_in_hsdp exp_avg_dtype
        exp_avg_sq_dtype fake_process_group fsdp_db_use_persist_buf_on_alloc_fail
        fsdp_double_buffer fsdp_manual_registration gradient_reduce_div_fusion
        init_model_with_meta_device main_grads_dtype main_params_dtype
        megatron_fsdp_enable_fine_grained_param_gather megatron_fsdp_grad_comm_dtype
        megatron_fsdp_main_grads_dtype megatron_fsdp_main_params_dtype
        megatron_fsdp_max_pool_double_buffer model_parallel_size
        optimizer_cpu_offload optimizer_offload_fraction
        outer_dp_sharding_strategy overlap_cpu_optimizer_d2h_h2d
        pin_cpu_grads pin_cpu_params
        tensor_parallel_num_weight_shards torch_fsdp2_reshard_after_forward
        use_layer_wise_param_layout use_megatron_fsdp use_precision_aware_optimizer
        use_torch_fsdp2 use_torch_optimizer_for_cpu_offload
    """, _FSDP),
    **_each("""
        allow_ambiguous_pad_tokens batch_size 
        data_args_path dataloader_inter_document_masking decrease_batch_size_if_needed
        eval_global_batch_size eval_micro_batch_size fim_data fim_eod_token
        fim_fragment_rate fim_middle_token fim_no_prefix fim_pad_token fim_prefix_token
        fim_rate fim_split_sample fim_spm_rate fim_suffix_token full_validation
        mid_level_dataset_surplus multiple_validation_sets object_storage_cache_path
        per_split_data_args_path  step_batch_size_schedule test_data_path
        train_data_path  valid_data_path validation_set_names
    """, _DATA),
    "rampup_batch_size": "the global batch size (documents) is fixed: drop --rampup-batch-size",
    **_each("""
        moe_expert_capacity_factor moe_expert_rank_capacity_factor
        moe_pad_expert_input_to_capacity moe_token_drop_policy
    """, "an expert's capacity counts the tokens of one forward call, and the document "
         "schedules cut the batch into other calls (slices, packed chunks, subsequences), so "
         "which tokens are dropped would depend on the schedule: drop the flag (dropless "
         "routing, exact under every schedule)"),
    "moe_router_load_balancing_type": (
        "only Megatron's default aux_loss is proven (per micro-batch, under 1f1b, interleaved "
        "and 1f1b-ir, which run Megatron's micro-batches); seq_aux_loss (per row of a "
        "micro-batch: rows of packed documents here), global_aux_loss (tokens per expert "
        "averaged over the step's micro-batches so far and the data-parallel ranks), sinkhorn, "
        "quantile_balancing and none are not: drop --moe-router-load-balancing-type (leave "
        "--moe-aux-loss-coeff at 0 for no auxiliary loss)"),
    "recompute_activations": RECOMPUTE_ACTIVATIONS,
    "moe_router_enable_expert_bias": "the expert bias is updated from the tokens routed in the "
                                     "step, padding included, and each schedule pads "
                                     "differently; drop --moe-router-enable-expert-bias",
}


#: The options that count samples. pretrain_gpt_elastic.py's sample is one whole document (or
#: a piece of ``--seq-length + 1`` tokens of a longer one) under every schedule, Megatron-LM's a
#: sequence of ``--seq-length`` tokens: these options keep their role and count documents
#: (start-up says so: :func:`megatron.plugin.document_data.sample_meaning`). Each is also in
#: one class above (``--rampup-batch-size`` is refused: the batch of documents is fixed).
COUNT_DOCUMENTS = _names("""
    global_batch_size train_samples rampup_batch_size lr_decay_samples lr_warmup_samples
    lr_wsd_decay_samples
""")


#: Options Megatron-LM accepts only beside another (``validate_args`` asserts it): ``dest ->``
#: the options given with it that have to go when it goes (a ``(dest, value)`` pair: only with
#: that value). A refusal of ``dest`` names those too, so that following it leads into no
#: further refusal.
NEEDED_BY = {
    "use_distributed_optimizer": ("overlap_param_gather",
                                  "overlap_param_gather_with_optimizer_step",
                                  "num_distributed_optimizer_instances"),
    "overlap_grad_reduce": ("overlap_param_gather", "overlap_param_gather_with_optimizer_step"),
    "overlap_param_gather": ("overlap_param_gather_with_optimizer_step",),
    "cuda_graph_impl": ("rl_training_cuda_graphs", "rl_persist_cuda_graphs"),
    "use_megatron_fsdp": (("ckpt_format", "fsdp_dtensor"),),
}


def companions(given: Mapping[str, tuple], dests) -> list[str]:
    """The flags of ``given`` that Megatron-LM accepts only beside one of ``dests``
    (:data:`NEEDED_BY`, followed through), ``dests`` themselves left out; a flag whose value
    matters is shown with it."""
    found, todo = {}, list(dests)
    while todo:
        for needer in NEEDED_BY.get(todo.pop(), ()):
            dest, value = needer if isinstance(needer, tuple) else (needer, None)
            if dest not in given or dest in found or dest in dests or \
                    (value is not None and given[dest][1] != value):
                continue
            found[dest] = given[dest][0] if value is None else f"{given[dest][0]} {value}"
            todo.append(dest)
    return list(found.values())


def _tables() -> list:
    """The registered schedules other than Megatron's own (whose proofs are here)."""
    return [found for found in registry.specs() if found.megatron_function is None]


def _table(schedule: str):
    """The ``ScheduleSpec`` of ``schedule`` when it declares its own table, else ``None``."""
    found = registry.spec(schedule)
    return None if found is None or found.megatron_function is not None else found


def _honoured(dest: str) -> Honoured | None:
    """``dest``'s entry of :data:`HONOURED`; for a flag that only registered schedules' tables
    name (their own), one refused elsewhere as doing nothing there (:data:`FOREIGN`)."""
    if dest in HONOURED:
        return HONOURED[dest]
    if any(dest in found.proofs for found in _tables()):
        return Honoured({}, FOREIGN)
    return None


def proof(dest: str, schedule: str) -> str | None:
    """The test proving option ``dest`` (or :data:`SPLIT_EXPERTS`) under ``schedule``
    (registered), ``None`` where none does."""
    core = EXPERT_TP if dest == SPLIT_EXPERTS else getattr(HONOURED.get(dest), "proofs", {})
    found = core.get(schedule, core.get("*"))
    if found is None and (table := _table(schedule)) is not None:
        found = table.proofs.get(dest)
    return found


def proving(dest: str) -> dict[str, str]:
    """``schedule -> proof`` of ``dest`` (or :data:`SPLIT_EXPERTS`) under every registered
    schedule that proves it (``*``: every schedule)."""
    found = dict(EXPERT_TP if dest == SPLIT_EXPERTS else getattr(HONOURED.get(dest), "proofs", {}))
    found.update((table.name, table.proofs[dest]) for table in _tables() if dest in table.proofs)
    return found


def cells() -> list[tuple[str, str, str]]:
    """``(dest, schedule, proof)`` of every honoured option under every registered schedule
    that proves it (``*``: every schedule), by option."""
    dests = set(HONOURED).union(*(found.proofs for found in _tables())) - {SPLIT_EXPERTS}
    return [(dest, schedule, found) for dest in sorted(dests)
            for schedule, found in sorted(proving(dest).items())]


def schedule_refusal(dest: str, schedule: str, flag: str) -> str | None:
    """``schedule``'s own refusal of option ``dest`` given as ``flag``
    (``ScheduleSpec.refusals``), ``None`` where it has none."""
    table = _table(schedule)
    if table is None or dest not in table.refusals:
        return None
    return table.refusals[dest].replace("{flag}", flag)


def refusals(given: Mapping[str, tuple], schedule: str) -> list[str]:
    """What to refuse of ``given`` (``dest -> (flag, value)`` of each option on the command line
    with a value other than its default) under ``schedule``: one message per reason, naming
    together the flags refused for the same reason, and the flags that Megatron-LM accepts only
    beside a refused one (:data:`NEEDED_BY`)."""
    reasons: dict[str, list[str]] = {}
    refused = []
    for dest, (flag, value) in given.items():
        if dest in INERT:
            continue
        if dest in REFUSED:
            reasons.setdefault("{} not supported by pretrain_gpt_elastic.py: "
                               + _refusal(dest, schedule), []).append(flag)
            refused.append(dest)
            continue
        honoured = _honoured(dest)
        if honoured is None:
            reasons.setdefault("{} not classified by pretrain_gpt_elastic.py (it is a new "
                               "option of this megatron-core release: "
                               "megatron/plugin/option_classes.py must name it inert, honoured "
                               "or refused before it is accepted): drop it", []).append(flag)
        elif honoured.values is not None and not _among(value, honoured.values):
            shown = " ".join(map(str, value)) if isinstance(value, list) else _named(value)
            reasons.setdefault(f"{flag} {shown} is not supported by pretrain_gpt_elastic.py "
                               f"(it honours {' and '.join(map(str, honoured.values))}): "
                               f"{honoured.refusal}", [])
        elif proof(dest, schedule) is None:
            reasons.setdefault(_schedule_refusal(honoured, dest, flag, schedule),
                               []).append(flag)
        else:
            continue
        refused.append(dest)
    messages = [reason.format(_together(flags)) if "{}" in reason else reason
                for reason, flags in reasons.items()]
    left = companions(given, refused)
    if left:
        messages.append(f"{_together(left)} accepted by Megatron-LM only beside a flag refused "
                        f"above: drop {' and '.join(left)} with it")
    return messages


def _refusal(dest: str, schedule: str) -> str:
    """The reason :data:`REFUSED` gives for ``dest`` under ``schedule``: the schedule's own
    (``ScheduleSpec.refusals``) where it has one."""
    table = _table(schedule)
    if table is not None and dest in table.refusals:
        return table.refusals[dest]
    reason = REFUSED[dest]
    return reason if isinstance(reason, str) else reason.get(schedule, reason["*"])


def _among(value, values) -> bool:
    """Whether ``value`` is one of ``values`` (a list, as Megatron's per-layer
    ``--cp-comm-type``: each of its items)."""
    return all(_named(item) in values for item in (value if isinstance(value, list) else [value]))


def _named(value):
    """``value``, or its name for an enumeration member (``--attention-backend``'s
    ``AttnBackend``)."""
    return value.name if isinstance(value, Enum) else value


def _schedule_refusal(honoured: Honoured, dest: str, flag: str, schedule: str) -> str:
    own = schedule_refusal(dest, schedule, flag)
    if own is not None:
        return own
    if honoured.refusal == FOREIGN:
        return (f"{flag} is a flag of --pipeline-schedule {' / '.join(sorted(proving(dest)))} "
                f"and would do nothing under --pipeline-schedule {schedule}: drop it")
    return f"{flag} is not supported by --pipeline-schedule {schedule}: {honoured.refusal}"


def _together(flags: list[str]) -> str:
    return f"{flags[0]} is" if len(flags) == 1 else f"{', '.join(flags)} are"


def classes() -> dict[str, str]:
    """``dest -> class`` (``inert``, ``honoured``, ``refused``) of every classified option (a
    registered schedule's own flags among them)."""
    found = {dest: "inert" for dest in INERT}
    found.update((dest, "honoured") for dest, _, _ in cells())
    found.update((dest, "honoured") for dest in HONOURED)
    found.update((dest, "refused") for dest in REFUSED)
    return found
