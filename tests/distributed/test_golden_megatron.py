"""Golden: Megatron's native schedules, ``1f1b-ir`` (the executor), ``elastic`` and ``seq1f1b``
(document chunks with K/V context and per-chunk checkpointing), ``helix`` (layer parts on
other stages, weight shipping, recomputation without attention) and ``sppo`` (subsequences with
K/V context, saved activations offloaded to the host tier and reloaded) on CPU (gloo) equal the
single-process reference, and ``1f1b-ir`` equals Megatron's native 1F1B.

Loss and every parameter gradient of one training step over a fixed set of documents
(packed into micro-batches for the pipeline; one document at a time for the reference), under
the per-token loss, and for the layouts of ``DEFAULT_LOSS`` under Megatron's default loss (the
mean over Megatron's micro-batches of their token means; the logged loss is the per-token mean
under both).

The module fixture runs every layout in four torchrun launches: the initial weights of every
model variant in one single-process launch, every layout on two ranks in one launch and every
layout on four in another (one after another, Megatron-LM initialised afresh for each:
``golden_run.py``), and every variant's reference in one single-process launch.
``test_golden_sharing.py`` checks that a layout run after another equals the layout run alone.

Environment: ``LONGCTX_GOLDEN_SMOKE=1`` runs one layout per schedule (:data:`SMOKE`);
``LONGCTX_GOLDEN_GPU=1`` the layouts of :data:`GPU_LAYOUTS` (PP = 2 and PP = 4 under every
schedule, PP = 2 x TP = 2 with sequence parallelism); ``LONGCTX_GOLDEN_TAGS=tag1,tag2`` the named
layouts only (a targeted run; with one of the others, the named layouts of that set). Tests
about layouts left out are skipped.

On CUDA the same layouts run with NCCL (the backend and device are Megatron-LM's defaults there;
gloo and the CPU without CUDA), against the same reference, with the same fp32 tolerances
(:data:`TOLERANCES`). A launch of more ranks than GPUs shares them
(:mod:`megatron.plugin.shared_gpu`). On CUDA the layouts compared bit for bit
(:data:`BITWISE_TAGS`) run with Megatron-LM's ``--deterministic-mode`` in launches of their own
(it switches torch's deterministic algorithms on for the whole process); the planned layouts
price their plans with the CPU's hardware profile and no reserved memory
(:data:`PLAN_AS_ON_CPU`), so that their plans are the CPU's; the checks of the CPU
compatibility layer are skipped.
"""
import glob
import json
import os

import pytest
import torch

from harness import TINY_MODEL, torchrun_each

from megatron.plugin import cpu_compat, option_classes, shared_gpu
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b

WORKER = "tests/distributed/golden_worker.py"
CUDA = torch.cuda.is_available()

#: The golden tests' dtype and bounds (:func:`assert_gradient_close`, the loss's ``rtol`` and
#: ``atol``), the same on CPU and CUDA. Every layout trains in fp32 (TF32 stays off: torch's
#: default for matrix products); bf16 and fp16 are compared with fp32 by ``scripts/gpu_check.sh``
#: (:mod:`scripts.gpu_verdicts`).
TOLERANCES = {"fp32": {"norm_rtol": 1e-5, "entry_rtol": 1e-4, "entry_floor": 1e-6,
                       "loss_rtol": 1e-4, "loss_atol": 1e-5}}
#: The layouts of test_executor_1f1b_equals_megatron_1f1b, compared bit for bit.
BITWISE_TAGS = {"pp2", "pp2_ir", "pp4", "pp4_ir", "pp2_tp2_sp", "pp2_tp2_sp_ir"}
DETERMINISTIC = ["--deterministic-mode"]
#: On CUDA, the flags that make a planned layout's plan the CPU's: the CPU's default hardware
#: profile, and no reserved memory beside the tiny budgets of the layouts that give one.
PLAN_AS_ON_CPU = ["--hardware-profile", "a800"]
NO_RESERVE = ["--elastic-reserved-gb", "0"]
PLANNED_SCHEDULES = ("elastic", "seq1f1b", "sppo")

# The module fixture runs every layout (four torchrun launches, each under a limit of 300 s plus
# 120 s per command line) during the setup of the first test; that setup gets more than the
# default 600 s.
pytestmark = pytest.mark.timeout(2400)

ELASTIC = ["--pipeline-schedule", "elastic", "--elastic-slices", "3"]
SEQ1F1B = ["--pipeline-schedule", "seq1f1b", "--elastic-slices", "2"]
#: tag -> what its plan must contain: chunk kinds, and the checkpointing ("none": no layer,
#: "uniform": the same partial count everywhere, "all": every layer of every stage,
#: "adaptive": counts that differ by chunk). The layouts with Megatron's --recompute-* flags
#: must have planned with the table those fix (status "fixed", no CP-SAT solve).
ELASTIC_EXPECTED = {
    "pp2_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_elastic_adaptive": ({"split", "hybrid", "batched"}, "adaptive"),
    "pp4_elastic_adaptive": ({"split", "hybrid", "batched"}, "adaptive"),
    "pp2_seq1f1b_uniform": ({"split", "hybrid"}, "uniform"),
    "pp2_tp2_sp_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_ulysses2_elastic_default_loss": ({"split", "hybrid", "batched"}, "none"),
    "pp2_dp2_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_dp2_seq1f1b": ({"split", "hybrid"}, "none"),
    "tp2_sp_ulysses2_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp4_seq1f1b": ({"split", "hybrid"}, "none"),
    "pp2_tp2_sp_seq1f1b": ({"split", "hybrid"}, "none"),
    "pp2_ulysses2_seq1f1b_default_loss_mbs2": ({"split", "hybrid"}, "none"),
    "pp2_gqa_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_ulysses2_gqa_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_elastic_default_loss_mbs2": ({"split", "hybrid", "batched"}, "none"),
    "pp2_seq1f1b_default_loss_mbs2": ({"split", "hybrid"}, "none"),
    "pp2_qk_eod_uneven_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_moe_accounted_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_moe_accounted_seq1f1b": ({"split", "hybrid"}, "none"),
    "pp2_full_recompute_elastic": ({"split", "hybrid", "batched"}, "all"),
    "pp2_block_recompute_elastic": ({"split", "hybrid", "batched"}, "uniform"),
    "pp2_full_recompute_seq1f1b": ({"split", "hybrid"}, "all"),
    "pp2_block_recompute_seq1f1b": ({"split", "hybrid"}, "uniform"),
    "pp2_dropout_elastic": ({"split", "hybrid", "batched"}, "none"),
    "pp2_dropout_seq1f1b": ({"split", "hybrid"}, "none"),
}

HELIX = ["--pipeline-schedule", "helix"]

UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform",
           "--recompute-num-layers", "1"]
BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "1"]
SELECTIVE = ["--recompute-granularity", "selective"]
MBS2 = ["--micro-batch-size", "2"]
#: Megatron's name for Ulysses context parallelism, which the document attention runs for every
#: ``--cp-comm-type`` (the layouts without it run Megatron's default, p2p).
A2A = ["--cp-comm-type", "a2a"]
#: Megatron's overlapped gradient reduction with buckets of 10000 parameters (the first stage of
#: the tiny model at PP=2 holds about 38000): several buckets, reduced as the backward goes.
OVERLAP = ["--overlap-grad-reduce", "--ddp-bucket-size", "10000"]

#: Megatron's distributed optimizer with its reduce-scatter overlapped with the backward and
#: its parameter all-gather with the next forward (the buckets of OVERLAP).
DISTOPT = ["--use-distributed-optimizer", *OVERLAP, "--overlap-param-gather"]
#: Megatron's rank order with the data-parallel dimension last (tp-cp-ep-pp-dp): at PP=2 x DP=2
#: the pipelines are ranks 0, 1 and 2, 3 instead of 0, 2 and 1, 3 (RANK_ORDERS); the other
#: pp2_dp2 layouts keep Megatron's default order.
DP_LAST = ["--use-tp-pp-dp-mapping"]
#: Megatron's DDP averaging the gradients in its collectives (``ReduceOp.AVG``, each gradient
#: unscaled before: Megatron refuses it under --calculate-per-token-loss, so the layouts that pass
#: it train Megatron's default loss). With the distributed optimizer the average is in the
#: reduce-scatter; with experts spread over the data-parallel replicas Megatron scales the
#: experts' gradients by their data-parallel size over the dense one before it averages them.
AVERAGE = ["--ddp-average-in-collective"]
#: Megatron's partial distributed optimizer: two instances at two data-parallel replicas, each
#: replica holding its whole optimizer state, the gradients all-reduced between the instances.
INSTANCES = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
#: INSTANCES with the buckets of OVERLAP reduced as the backward goes and gathered as the next
#: step's forwards go.
INSTANCES_OVERLAP = [*INSTANCES, *OVERLAP, "--overlap-param-gather"]

SPPO = ["--pipeline-schedule", "sppo"]
#: tag -> (subsequences of the longest document, offload ratio of the run or None for off).
#: The golden documents' lengths (2 to 64 tokens) rarely divide by N: the cuts are uneven, and
#: documents no longer than the longest subsequence are packed whole into rows of at most its
#: length (``pp2_sppo_n2_packed``: most of them). With TP x CP = 2 every row is padded to an
#: even length; with DP = 2 each replica cuts and packs its own share.
SPPO_EXPECTED = {
    "pp2_sppo_n2_packed": (2, 0.5),
    "pp2_sppo_n4": (4, None),
    "pp2_sppo_n6_offload": (6, 0.5),
    "pp4_sppo_n8_offload": (8, 1.0),
    "pp4_sppo_n5_uniform_recompute": (5, None),
    "pp2_tp2_sp_sppo_n4_offload": (4, 0.5),
    "pp2_ulysses2_sppo_n6_offload": (6, 1.0),
    "pp2_dp2_sppo_n5_offload": (5, 0.5),
}

#: tag -> (stages, subsequences, offload ratio of the steady subsequences or None for off) of
#: the runs with multiplexed partitioning (one document: the SPPO case of one long sequence).
MUX_EXPECTED = {
    "pp2_sppo_mux_n4": (2, 4, None),
    "pp2_sppo_mux_n6_offload": (2, 6, 0.5),
    "pp4_sppo_mux_n5": (4, 5, None),
}

#: Megatron's uneven pipeline splits: a first stage of 1 and a last of 3 of 4 layers; the
#: embedding and the loss each counted as a layer (each stage builds 2 of 4).
UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3"]
ACCOUNTED = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
#: MuP at twice its base width (the tiny model's hidden size is 32), which scales the
#: initialisation and the optimizer's learning rates; the attention's scale
#: sqrt(base head dim) / kv_channels ** power, the embedding's and the logits' multipliers
#: set off their defaults.
MUP = ["--use-mup", "--mup-base-hidden-size", "16", "--mup-embedding-mult", "1.5",
       "--mup-output-mult", "0.25", "--mup-base-head-dim", "4", "--mup-attn-scale-power", "0.75"]
#: Megatron's auxiliary load-balancing loss at the coefficient Megatron-LM recommends to
#: start from; the moe variant's reference adds it over Megatron's micro-batches
#: (``golden_run.aux_loss_gradients``) for the layouts of Megatron's schedules and 1f1b-ir that
#: pass it. DOC_AUX: the project's loss per document at the same coefficient, which elastic and
#: seq1f1b take instead (``golden_run.document_aux_gradients``).
AUX_LOSS_COEFF = "0.01"
AUX = ["--moe-aux-loss-coeff", AUX_LOSS_COEFF]
DOC_AUX = ["--moe-per-document-aux-loss-coeff", AUX_LOSS_COEFF]
#: Flags of Megatron-LM's configurations that no layer of these models reads, given beside
#: tensor parallelism: the experts' tensor-parallel size without experts (it sizes Megatron's
#: expert groups only) and apex's persistent LayerNorm kernel (the norms are torch's).
UNREAD = ["--expert-tensor-parallel-size", "1", "--no-persist-layer-norm"]
#: Megatron's interleaved schedule with its transfers overlapped in the warm-up and flush
#: phases too, and micro-batches taken in groups of 4 per virtual stage (not PP = 2).
TUNED_P2P = ["--overlap-p2p-communication-warmup-flush",
             "--microbatch-group-size-per-virtual-pipeline-stage", "4"]
#: Expert parallelism over two ranks, each expert's weights split over two ranks (both carved
#: from the data-parallel replicas, as Megatron carves them), and Megatron's all-to-all token
#: dispatcher (its default is the all-gather one).
EP2 = ["--expert-model-parallel-size", "2"]
ETP2 = ["--expert-tensor-parallel-size", "2"]
A2A_DISPATCH = ["--moe-token-dispatcher-type", "alltoall"]
#: The schedules that run Megatron's layer map (``name`` of a layout tag, flags).
FOUR_SCHEDULES = (("1f1b", ["--pipeline-schedule", "1f1b"]),
                  ("ir", ["--pipeline-schedule", "1f1b-ir"]), ("elastic", ELASTIC),
                  ("seq1f1b", SEQ1F1B))
#: A schedule's flags for the MoE layouts at tensor or context parallelism.
MOE_SCHEDULES = {**dict(FOUR_SCHEDULES), "helix": HELIX,
                 "sppo": [*SPPO, "--sppo-subsequences", "4"]}


def aux_flags(name: str) -> list:
    """The load-balancing loss of a MoE layout under the schedule ``name`` of
    :data:`MOE_SCHEDULES`: Megatron's where the router's calls are Megatron's micro-batches, the
    project's per document under elastic and seq1f1b, none under helix and sppo (they refuse
    both)."""
    if name in ("1f1b", "ir"):
        return AUX
    if option_classes.proof("moe_per_document_aux_loss_coeff", name) is not None:
        return DOC_AUX
    return []


def more_schedules(name: str) -> dict:
    """A model variant's layouts under ``seq1f1b``, ``1f1b-ir`` and ``interleaved`` (PP=2, two
    ranks): the proofs ``megatron.plugin.option_classes`` names for its options there."""
    pp2 = ["--pipeline-model-parallel-size", "2"]
    return {f"pp2_{name}_seq1f1b": (2, [*pp2, *SEQ1F1B]),
            f"pp2_{name}_ir": (2, [*pp2, "--pipeline-schedule", "1f1b-ir"]),
            f"pp2_vp2_{name}_interleaved": (2, [*pp2, "--num-layers-per-virtual-pipeline-stage",
                                                "1", "--pipeline-schedule", "interleaved"])}


#: The model-shape flags the rope variant takes beside RoPE, SwiGLU and RMSNorm.
MODEL_SHAPE = ["--kv-channels", "12", "--group-query-attention", "--num-query-groups", "2",
               "--rotary-percent", "0.5", "--rotary-base", "5000", "--ffn-hidden-size", "72",
               "--empty-unused-memory-level", "2"]


#: model variant -> (model flags, {layout tag: (ranks, parallel flags)}). Each variant has its
#: own initial weights and its own single-process reference.
VARIANTS = {
    "learned": ([], {
        "pp2": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
        "pp4": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b"]),
        "pp2_tp2_sp": (4, ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size",
                           "2", "--sequence-parallel", "--pipeline-schedule", "1f1b", *UNREAD]),
        "pp2_ir": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b-ir"]),
        "pp4_ir": (4, ["--pipeline-model-parallel-size", "4", "--pipeline-schedule", "1f1b-ir"]),
        "pp2_tp2_sp_ir": (4, ["--pipeline-model-parallel-size", "2",
                              "--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--pipeline-schedule", "1f1b-ir", *UNREAD]),
        "pp2_full_recompute": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                   "1f1b", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform", "--recompute-num-layers", "1"]),
        "pp2_vp2_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1",
                                    "--pipeline-schedule", "interleaved"]),
        "pp2_vp2_tp2_sp_interleaved": (4, ["--pipeline-model-parallel-size", "2",
                                           "--tensor-model-parallel-size", "2",
                                           "--sequence-parallel",
                                           "--num-layers-per-virtual-pipeline-stage", "1",
                                           "--pipeline-schedule", "interleaved", *UNREAD]),
        # Megatron's recompute options and micro-batch sizes, where a schedule accepts them
        # (tests/unit/test_schedule_options.py names the layout of each accepted pair).
        "pp2_block_recompute_mbs2": (2, ["--pipeline-model-parallel-size", "2",
                                         "--pipeline-schedule", "1f1b", *BLOCK, *MBS2]),
        "pp2_selective_recompute": (2, ["--pipeline-model-parallel-size", "2",
                                        "--pipeline-schedule", "1f1b", *SELECTIVE]),
        "pp2_vp2_interleaved_uniform_recompute_mbs2": (2, [
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--pipeline-schedule", "interleaved", *UNIFORM, *MBS2]),
        "pp2_vp2_interleaved_block_recompute": (2, [
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--pipeline-schedule", "interleaved", *BLOCK]),
        "pp2_vp2_interleaved_selective_recompute": (2, [
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
            "1", "--pipeline-schedule", "interleaved", *SELECTIVE]),
        "pp2_ir_uniform_recompute_mbs2": (2, ["--pipeline-model-parallel-size", "2",
                                              "--pipeline-schedule", "1f1b-ir", *UNIFORM,
                                              *MBS2]),
        "pp2_ir_block_recompute": (2, ["--pipeline-model-parallel-size", "2",
                                       "--pipeline-schedule", "1f1b-ir", *BLOCK]),
        "pp2_ir_selective_recompute": (2, ["--pipeline-model-parallel-size", "2",
                                           "--pipeline-schedule", "1f1b-ir", *SELECTIVE]),
        # Megatron's full recomputation as the plan's fixed checkpointing table: uniform
        # recomputes both layers of each stage, block the first of them, in every chunk.
        **{f"pp2_{method}_recompute_{name}": (2, ["--pipeline-model-parallel-size", "2",
                                                  *flags, *recompute])
           for method, recompute in (("full", UNIFORM), ("block", BLOCK))
           for name, flags in (("elastic", ELASTIC), ("seq1f1b", SEQ1F1B))},
        # Document chunks; the memory budgets (GB, tiny model) are chosen so that the plan
        # needs checkpointing: see ELASTIC_EXPECTED for what each run must exercise.
        "pp2_elastic": (2, ["--pipeline-model-parallel-size", "2", *ELASTIC]),
        "pp2_elastic_adaptive": (2, ["--pipeline-model-parallel-size", "2", *ELASTIC,
                                     "--elastic-memory-gb", "0.00076"]),
        "pp4_elastic_adaptive": (4, ["--pipeline-model-parallel-size", "4", *ELASTIC,
                                     "--elastic-memory-gb", "0.0005"]),
        "pp2_seq1f1b_uniform": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule",
                                    "seq1f1b", "--elastic-slices", "2",
                                    "--elastic-memory-gb", "0.00095"]),
        "pp2_tp2_sp_elastic": (4, ["--pipeline-model-parallel-size", "2",
                                   "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   *ELASTIC, *UNREAD]),
        # Ulysses with Megatron's default loss at CP = 2 (DEFAULT_LOSS; seq1f1b's below with
        # two rows per micro-batch): each token weighed by the chunk pair of Megatron's row it
        # falls in. The other Ulysses layouts of elastic keep the per-token loss.
        "pp2_ulysses2_elastic_default_loss": (4, ["--pipeline-model-parallel-size", "2",
                                                  "--context-parallel-size", "2", *A2A,
                                                  *ELASTIC]),
        "tp2_sp_ulysses2_elastic": (4, ["--tensor-model-parallel-size", "2",
                                        "--sequence-parallel", "--context-parallel-size", "2",
                                        *ELASTIC]),
        "pp4_seq1f1b": (4, ["--pipeline-model-parallel-size", "4", *SEQ1F1B]),
        "pp2_tp2_sp_seq1f1b": (4, ["--pipeline-model-parallel-size", "2",
                                   "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                   *SEQ1F1B, *UNREAD]),
        "pp2_ulysses2_seq1f1b_default_loss_mbs2": (4, ["--pipeline-model-parallel-size", "2",
                                                       "--context-parallel-size", "2", *A2A,
                                                       *SEQ1F1B, *MBS2]),
        "pp2_ulysses2_ir": (4, ["--pipeline-model-parallel-size", "2",
                                "--context-parallel-size", "2", *A2A,
                                "--pipeline-schedule", "1f1b-ir"]),
        # Megatron's own schedules with Ulysses context parallelism; its default loss too
        # (DEFAULT_LOSS), which weighs each token as Megatron's 2 x CP chunks of a row do.
        "pp2_ulysses2_1f1b": (4, ["--pipeline-model-parallel-size", "2",
                                  "--context-parallel-size", "2", "--pipeline-schedule", "1f1b"]),
        "pp2_ulysses2_default_loss_mbs2": (4, ["--pipeline-model-parallel-size", "2",
                                               "--context-parallel-size", "2", *A2A,
                                               "--pipeline-schedule", "1f1b", *MBS2]),
        "pp2_vp2_ulysses2_interleaved_default_loss": (4, [
            "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", *A2A,
            "--num-layers-per-virtual-pipeline-stage", "1",
            "--pipeline-schedule", "interleaved"]),
        # A schedule registered from outside the source tree (OUTSIDE_SCHEDULES).
        "pp2_gpipe_outside": (2, ["--pipeline-model-parallel-size", "2",
                                  "--pipeline-schedule", "gpipe"]),
        # Helix: checkpoints written by GPTModel load into the helix layout and back (the
        # comparison goes through them), and the micro-batch count needs padding.
        "pp2_helix": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        "pp2_helix_recompute": (2, ["--pipeline-model-parallel-size", "2", *HELIX,
                                    "--helix-recompute-without-attention"]),
        "pp2_helix_one_fold": (2, ["--pipeline-model-parallel-size", "2", *HELIX,
                                   "--helix-folds", "1"]),
        "pp4_helix_recompute": (4, ["--pipeline-model-parallel-size", "4", *HELIX,
                                    "--helix-recompute-without-attention"]),
        "pp2_tp2_sp_helix": (4, ["--pipeline-model-parallel-size", "2",
                                 "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 *HELIX, *UNREAD]),
        "pp2_helix_mbs2": (2, ["--pipeline-model-parallel-size", "2", *HELIX, *MBS2]),
        "pp2_helix_mlp_chunk": (2, ["--pipeline-model-parallel-size", "2", *HELIX,
                                    "--helix-mlp-chunk-size", "24"]),
        "pp2_tp2_sp_helix_recompute_mlp_chunk": (4, [
            "--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", *HELIX, "--helix-recompute-without-attention",
            "--helix-mlp-chunk-size", "24"]),
        # SPPO: see SPPO_EXPECTED.
        "pp2_sppo_n4": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                            "--sppo-subsequences", "4", "--sppo-offload", "off"]),
        "pp2_sppo_n2_packed": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                   "--sppo-subsequences", "2", "--sppo-offload", "0.5"]),
        "pp2_sppo_n6_offload": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                    "--sppo-subsequences", "6", "--sppo-offload", "0.5"]),
        "pp4_sppo_n8_offload": (4, ["--pipeline-model-parallel-size", "4", *SPPO,
                                    "--sppo-subsequences", "8", "--sppo-offload", "1"]),
        # Megatron's recompute flags (RECOMPUTE_EXPECTED): every layer of each stage here, the
        # first of each stage's two in pp2_ulysses2_sppo_default_loss_mbs2.
        "pp4_sppo_n5_uniform_recompute": (4, ["--pipeline-model-parallel-size", "4", *SPPO,
                                              "--sppo-subsequences", "5", *UNIFORM]),
        "pp2_tp2_sp_sppo_n4_offload": (4, ["--pipeline-model-parallel-size", "2",
                                           "--tensor-model-parallel-size", "2",
                                           "--sequence-parallel", *SPPO,
                                           "--sppo-subsequences", "4", "--sppo-offload", "0.5",
                                           *UNREAD]),
        "pp2_ulysses2_sppo_n6_offload": (4, ["--pipeline-model-parallel-size", "2",
                                             "--context-parallel-size", "2", *A2A, *SPPO,
                                             "--sppo-subsequences", "6", "--sppo-offload", "1"]),
        # Megatron's default loss (DEFAULT_LOSS): Megatron's own 1F1B, then the schedules that
        # weight each token as Megatron's packing does (context parallelism included).
        "pp2_default_loss_mbs2": (2, ["--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", "1f1b", *MBS2]),
        "pp2_elastic_default_loss_mbs2": (2, ["--pipeline-model-parallel-size", "2", *ELASTIC,
                                              *MBS2]),
        "pp2_seq1f1b_default_loss_mbs2": (2, ["--pipeline-model-parallel-size", "2", *SEQ1F1B,
                                              *MBS2]),
        "pp2_ulysses2_sppo_default_loss_mbs2": (4, ["--pipeline-model-parallel-size", "2",
                                                    "--context-parallel-size", "2", *SPPO,
                                                    "--sppo-subsequences", "4",
                                                    *BLOCK, *MBS2]),
        "pp2_helix_default_loss": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        # Helix with Ulysses: each attention part trades its rows for heads of the whole rows.
        "pp2_ulysses2_helix_default_loss": (4, ["--pipeline-model-parallel-size", "2",
                                                "--context-parallel-size", "2", *A2A, *HELIX]),
        # Megatron's interleaved schedule (two virtual stages per rank) with the distributed
        # optimizer and both overlaps: the reduce-scatters and all-gathers aligned over the
        # pipeline stages (--align-param-gather, Megatron-LM's default there: the schedule
        # dispatches each model chunk's all-gather through param_sync_func).
        "pp2_vp2_dp2_dplast_distopt_interleaved": (4, [
            "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
            "--pipeline-schedule", "interleaved", *DISTOPT, *DP_LAST]),
        # Overlapped gradient reduction with two data-parallel replicas (OVERLAP_TAGS); under
        # 1f1b-ir Megatron's default loss averaged in the all-reduce (AVERAGE).
        "pp2_dp2_overlap_ir": (4, ["--pipeline-model-parallel-size", "2",
                                   "--pipeline-schedule", "1f1b-ir", *OVERLAP, *AVERAGE]),
        "pp2_dp2_overlap_elastic": (4, ["--pipeline-model-parallel-size", "2", *ELASTIC,
                                        *OVERLAP]),
        "pp2_dp2_overlap_seq1f1b": (4, ["--pipeline-model-parallel-size", "2", *SEQ1F1B,
                                        *OVERLAP]),
        "pp2_dp2_overlap_sppo": (4, ["--pipeline-model-parallel-size", "2", *SPPO,
                                     "--sppo-subsequences", "4", "--sppo-offload", "0.5",
                                     *OVERLAP]),
        # The distributed optimizer, two data-parallel replicas (DISTOPT_TAGS), the ranks in
        # Megatron's data-parallel-last order; under the document schedules Megatron's default
        # loss averaged in the reduce-scatter (AVERAGE).
        **{f"pp2_dp2_dplast_distopt_{name}": (4, ["--pipeline-model-parallel-size", "2", *flags,
                                                  *DISTOPT, *DP_LAST])
           for name, flags in FOUR_SCHEDULES[:2]},
        **{f"pp2_dp2_dplast_distopt_{name}": (4, ["--pipeline-model-parallel-size", "2", *flags,
                                                  *DISTOPT, *DP_LAST, *AVERAGE])
           for name, flags in FOUR_SCHEDULES[2:]},
        "pp2_dp2_dplast_distopt_sppo": (4, ["--pipeline-model-parallel-size", "2", *SPPO,
                                            "--sppo-subsequences", "4", "--sppo-offload", "0.5",
                                            *DISTOPT, *DP_LAST, *AVERAGE]),
        "pp2_dp2_dplast_distopt_helix": (4, ["--pipeline-model-parallel-size", "2", *HELIX,
                                             *DISTOPT, *DP_LAST, *AVERAGE]),
        # Helix on one stage: every boundary followed by its layer's attention, recomputed
        # without attention, with the distributed optimizer and both overlaps (the buckets
        # of the whole model, each reduced in the last backward of the parts it holds).
        "dp2_distopt_helix_recompute": (2, [*HELIX, "--helix-recompute-without-attention",
                                            *DISTOPT]),
    }),
    # Grouped-query attention: 4 heads share 2 K/V groups, also in the K/V context of a split
    # document's later slices (masked attention over context + slice) and under Ulysses.
    "gqa": (["--group-query-attention", "--num-query-groups", "2"], {
        "pp2_gqa_elastic": (2, ["--pipeline-model-parallel-size", "2", *ELASTIC]),
        **more_schedules("gqa"),
        "pp2_ulysses2_gqa_elastic": (4, ["--pipeline-model-parallel-size", "2",
                                         "--context-parallel-size", "2", *ELASTIC]),
    }),
    # QK-norm and --eod-mask-loss: RMSNorms of every head's query and key (as Qwen3's; a
    # LayerNorm's key bias shifts every score of a query alike and has no gradient to compare),
    # which helix ships with the QKV weight to the attention stage and gets the gradients of
    # back; the end-of-document token at every fifth input of each document, masked out of
    # the loss (under Megatron's default loss too, where it changes each micro-batch's count);
    # interleaved RoPE (channel pairs 2i, 2i + 1), also on the K/V context of later slices;
    # the squared ReLU as the MLP's activation (helix's chunked MLP runs it too); MuP (MUP:
    # the attention scaled by 1 / kv_channels, the embedding and the logits multiplied, which
    # helix's head and SPPO's helpers apply themselves).
    # Under the schedules that run Megatron's layer map (sppo's too, without its multiplexed
    # helpers), the split is uneven too: 1 + 3 layers.
    "qk_norm_eod": (["--qk-layernorm", "--normalization", "RMSNorm", "--eod-mask-loss",
                     "--golden-eod-every", "5", "--position-embedding-type", "rope",
                     "--rotary-interleaved", "--squared-relu", *MUP], {
        **{f"pp2_qk_eod_uneven_{name}": (2, ["--pipeline-model-parallel-size", "2", *UNEVEN,
                                             *flags]) for name, flags in FOUR_SCHEDULES},
        "pp2_vp2_qk_eod_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                           "--num-layers-per-virtual-pipeline-stage", "1",
                                           "--pipeline-schedule", "interleaved", *TUNED_P2P]),
        "pp2_qk_eod_helix": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        "pp2_qk_eod_helix_recompute": (2, ["--pipeline-model-parallel-size", "2", *HELIX,
                                           "--helix-recompute-without-attention"]),
        "pp2_qk_eod_uneven_sppo_n4_offload": (2, ["--pipeline-model-parallel-size", "2",
                                                  *UNEVEN, *SPPO, "--sppo-subsequences", "4",
                                                  "--sppo-offload", "0.5"]),
        "pp2_qk_eod_elastic_default_loss_mbs2": (2, ["--pipeline-model-parallel-size", "2",
                                                     *ELASTIC, *MBS2]),
    }),
    # Dropless mixture of experts: Megatron's MoE layer (4 experts, top-3 routing, no biases,
    # as Megatron-LM's MoE configurations) in every layer. Routing is per token, so cutting and
    # packing documents keeps every token's experts. A load-balancing loss too: under the
    # schedules that run Megatron's micro-batches Megatron's (AUX; under interleaved with
    # Megatron's default loss), under elastic (split and packed documents) and seq1f1b (with
    # Megatron's default loss) the project's per document (DOC_AUX). Under Megatron's schedules and
    # 1f1b-ir the experts spread over the two data-parallel replicas of PP=2 (EP2: 2 experts on
    # each rank; its tokens exchanged by Megatron's all-to-all dispatcher, or by its default
    # all-gather one) or each expert split over them (--expert-tensor-parallel-size 2, the
    # tokens gathered over the pair). Under the schedules that run Megatron's layer map, the
    # embedding and the loss count as layers of the split (4 + 2 over 2 stages: 2 transformer
    # layers each; under interleaved over 2 x 3 virtual stages given by their count, the first
    # holding only the embedding and the last only the loss). The interleaved layout averages
    # the gradients in the all-reduce (AVERAGE), the experts' scaled first. Beside the routed
    # experts a gated shared expert that every token passes through (DeepSeek's and Qwen's MoE
    # layers), and the router's logits and probabilities in FP64 (Megatron's router-dtype
    # path; FP32 is the model's own here).
    "moe": (["--num-experts", "4", "--moe-router-topk", "3", "--moe-ffn-hidden-size", "48",
             "--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate",
             "--moe-router-dtype", "fp64",
             "--disable-bias-linear", "--golden-aux-loss-coeff", AUX_LOSS_COEFF], {
        "pp2_dp2_ep2_a2a_moe_accounted_1f1b": (4, ["--pipeline-model-parallel-size", "2",
                                                   *ACCOUNTED, *EP2, *A2A_DISPATCH,
                                                   "--pipeline-schedule", "1f1b", *AUX]),
        "pp2_dp2_ep2_moe_accounted_ir": (4, ["--pipeline-model-parallel-size", "2", *ACCOUNTED,
                                             *EP2, "--pipeline-schedule", "1f1b-ir", *AUX]),
        **{f"pp2_moe_accounted_{name}": (2, ["--pipeline-model-parallel-size", "2", *ACCOUNTED,
                                             *flags, *DOC_AUX])
           for name, flags in FOUR_SCHEDULES[2:]},
        "pp2_vp3_dp2_ep2_a2a_moe_accounted_interleaved": (4, [
            "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3",
            *ACCOUNTED, *EP2, *A2A_DISPATCH, "--pipeline-schedule", "interleaved", *AUX,
            *AVERAGE]),
        "pp2_dp2_etp2_moe_1f1b": (4, ["--pipeline-model-parallel-size", "2", *ETP2,
                                      "--pipeline-schedule", "1f1b", *AUX]),
        "pp2_dp2_etp2_a2a_moe_ir": (4, ["--pipeline-model-parallel-size", "2", *ETP2,
                                        *A2A_DISPATCH, "--pipeline-schedule", "1f1b-ir", *AUX]),
        "pp2_moe_helix": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        # Tensor (sequence) and context parallelism: the router sees this rank's part of the
        # rows, the experts' tokens are exchanged over those ranks; Megatron's auxiliary loss
        # under 1f1b and 1f1b-ir (per micro-batch), the project's per document under elastic
        # and seq1f1b (each document's routings counted over the ranks that hold parts of its
        # rows): aux_flags; helix and sppo refuse both.
        **{f"pp2_{parallel}_moe_{name}": (4, ["--pipeline-model-parallel-size", "2", *flags,
                                              *layout,
                                              *aux_flags(name)])
           for parallel, flags, names in (
               ("tp2_sp", ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                ("1f1b", "ir", "elastic", "seq1f1b", "helix", "sppo")),
               ("ulysses2", ["--context-parallel-size", "2", *A2A],
                ("1f1b", "elastic", "helix", "sppo")))
           for name, layout in MOE_SCHEDULES.items() if name in names},
        "pp2_moe_accounted_sppo_n4_offload": (2, ["--pipeline-model-parallel-size", "2",
                                                  *ACCOUNTED, *SPPO, "--sppo-subsequences",
                                                  "4", "--sppo-offload", "0.5"]),
    }),
    # Llama's shape, with the model-shape flags of Megatron-LM's GPT configurations off their
    # defaults: 4 heads of 12 channels (48, not the hidden size 32) in 2 query groups, RoPE on
    # half of each head's channels at another base (the K/V of a split document's earlier
    # slices carry their true positions), an MLP of 72 (not Megatron's SwiGLU default 64) and
    # Megatron's emptying of the allocator's cache around the step. Its layouts at DP = 2 run
    # Megatron's partial distributed optimizer (INSTANCES), the 1f1b one with Megatron's default
    # loss averaged in the collectives (AVERAGE), those of the document schedules with the
    # reduction overlapped with the backward and the gather with the forward as Megatron-LM's
    # configurations of it run (INSTANCES_OVERLAP).
    "rope_swiglu_rmsnorm": (["--position-embedding-type", "rope", "--swiglu",
                             "--normalization", "RMSNorm", "--apply-layernorm-1p",
                             "--disable-bias-linear",
                             "--untie-embeddings-and-output-weights", *MODEL_SHAPE], {
        "pp2_dp2": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
                        *AVERAGE, *INSTANCES]),
        # Megatron's 1F1B starts the later stage's reductions at the end of the step and again
        # in finish_grad_sync (grad_sync.one_start_per_step): a sum would double.
        "pp2_dp2_overlap_1f1b": (4, ["--pipeline-model-parallel-size", "2",
                                     "--pipeline-schedule", "1f1b", *INSTANCES_OVERLAP]),
        "pp2_dp2_elastic": (4, ["--pipeline-model-parallel-size", "2", *ELASTIC,
                                *INSTANCES_OVERLAP]),
        "pp2_dp2_seq1f1b": (4, ["--pipeline-model-parallel-size", "2", *SEQ1F1B,
                                *INSTANCES_OVERLAP]),
        **more_schedules("rope"),
        "pp2_dp2_helix": (4, ["--pipeline-model-parallel-size", "2", *HELIX,
                              *INSTANCES_OVERLAP]),
        # Ulysses under recomputation without attention: the backward projects and trades
        # again; RoPE at the whole rows' positions.
        "pp2_ulysses2_helix_recompute": (4, ["--pipeline-model-parallel-size", "2",
                                             "--context-parallel-size", "2", *HELIX,
                                             "--helix-recompute-without-attention"]),
        "pp2_dp2_sppo_n5_offload": (4, ["--pipeline-model-parallel-size", "2", *SPPO,
                                        "--sppo-subsequences", "5", "--sppo-offload", "0.5",
                                        *INSTANCES_OVERLAP]),
    }),
    # Helix with 1, 3 and 2p + 1 = 5 packed micro-batches (1, 5 and 13 documents): counts that
    # are not a multiple of p x folds = 4 train with empty slots. One document is also the
    # case of SPPO's multiplexed partitioning (see MUX_EXPECTED), whose helpers borrow the
    # owner's layer weights, the Q/K norms' too (the model has them: --qk-layernorm, RMSNorm),
    # and gather the K/V of 2 query groups of 12 channels for the owner's share; under MuP the
    # helpers multiply the embedding they compute as Megatron's embedding does.
    "one_microbatch": (["--golden-docs", "1", "--qk-layernorm", "--normalization", "RMSNorm",
                        "--group-query-attention", "--num-query-groups", "2",
                        "--kv-channels", "12", *MUP], {
        "pp2_helix_m1": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        "pp2_sppo_mux_n4": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                "--sppo-subsequences", "4", "--sppo-offload", "off",
                                "--sppo-multiplex"]),
        "pp2_sppo_mux_n6_offload": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                        "--sppo-subsequences", "6", "--sppo-offload", "0.5",
                                        "--sppo-multiplex"]),
        "pp4_sppo_mux_n5": (4, ["--pipeline-model-parallel-size", "4", *SPPO,
                                "--sppo-subsequences", "5", "--sppo-offload", "off",
                                "--sppo-multiplex"]),
        # The owner's last backward also takes its helpers' weight gradients (OVERLAP_TAGS).
        "pp2_sppo_mux_n4_overlap": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                        "--sppo-subsequences", "4", "--sppo-offload", "off",
                                        "--sppo-multiplex", *OVERLAP]),
    }),
    # Megatron's attention output gate (Qwen3-Next's): the QKV projection also computes a
    # gate whose sigmoid scales the attention's output, per token, so slicing and packing keep
    # it; with grouped queries, as those configurations run it.
    "output_gate": (["--attention-output-gate", "--group-query-attention",
                     "--num-query-groups", "2"], {
        **{f"pp2_gate_{name}": (2, ["--pipeline-model-parallel-size", "2", *flags])
           for name, flags in FOUR_SCHEDULES},
        "pp2_vp2_gate_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                         "--num-layers-per-virtual-pipeline-stage", "1",
                                         "--pipeline-schedule", "interleaved"]),
        "pp2_gate_sppo_n4_offload": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                         "--sppo-subsequences", "4", "--sppo-offload", "0.5"]),
    }),
    # Hidden dropout (the embedding's and both bias-dropout-adds of every layer) and attention
    # dropout (the document attention's probabilities, the K/V context's included) at 0.1, the
    # masks keyed by each token's identity on both sides (golden_run.py
    # --golden-keyed-dropout: keyed_dropout.py), so the run drops what the reference drops
    # however the documents are packed, cut and placed; also under Megatron's recomputation,
    # which must draw a recomputed layer's masks again; under helix, whose layer parts run
    # outside Megatron's TransformerLayer.forward, with the keys made current in its parts (its
    # recomputation without attention and chunked MLP draw a recomputed part's masks again).
    "dropout": (["--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                 "--golden-keyed-dropout"], {
        **{f"pp2_dropout_{name}": (2, ["--pipeline-model-parallel-size", "2", *flags])
           for name, flags in FOUR_SCHEDULES},
        "pp2_dropout_full_recompute_1f1b": (2, ["--pipeline-model-parallel-size", "2",
                                                "--pipeline-schedule", "1f1b", *UNIFORM]),
        "pp2_vp2_dropout_interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                            "--num-layers-per-virtual-pipeline-stage", "1",
                                            "--pipeline-schedule", "interleaved"]),
        "pp2_dropout_sppo_n4": (2, ["--pipeline-model-parallel-size", "2", *SPPO,
                                    "--sppo-subsequences", "4", "--sppo-offload", "off"]),
        "pp2_dropout_gpipe_outside": (2, ["--pipeline-model-parallel-size", "2",
                                          "--pipeline-schedule", "gpipe"]),
        "pp2_dropout_helix": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
        "pp2_dropout_helix_recompute_mlp_chunk": (2, [
            "--pipeline-model-parallel-size", "2", *HELIX,
            "--helix-recompute-without-attention", "--helix-mlp-chunk-size", "24"]),
    }),
    "three_microbatches": (["--golden-docs", "5"], {
        "pp2_helix_m3": (2, ["--pipeline-model-parallel-size", "2", *HELIX,
                             "--helix-recompute-without-attention"]),
    }),
    "five_microbatches": (["--golden-docs", "13"], {
        "pp2_helix_m5": (2, ["--pipeline-model-parallel-size", "2", *HELIX]),
    }),
}
OVERLAP_TAGS = ["pp2_dp2_overlap_ir", "pp2_dp2_overlap_elastic", "pp2_dp2_overlap_seq1f1b",
                "pp2_dp2_overlap_sppo", "pp2_sppo_mux_n4_overlap", "pp2_dp2_elastic",
                "pp2_dp2_seq1f1b", "pp2_dp2_sppo_n5_offload", "pp2_dp2_dplast_distopt_helix",
                "pp2_dp2_helix", "dp2_distopt_helix_recompute"]
DISTOPT_TAGS = [*(f"pp2_dp2_dplast_distopt_{name}"
                  for name in ("1f1b", "ir", "elastic", "seq1f1b", "sppo", "helix")),
                "dp2_distopt_helix_recompute"]
INSTANCES_TAGS = ["pp2_dp2", "pp2_dp2_overlap_1f1b", "pp2_dp2_elastic", "pp2_dp2_seq1f1b",
                  "pp2_dp2_helix", "pp2_dp2_sppo_n5_offload"]
PER_TOKEN_LOSS = "--calculate-per-token-loss"
#: Layouts trained with Megatron's default loss: the fixture leaves ``PER_TOKEN_LOSS`` off their
#: command line, and they are compared with the reference of that loss at the micro-batch size
#: and context-parallel degree they name (``reference_default_mbs<N>.pt``, at ``C`` > 1
#: ``reference_default_mbs<N>_cp<C>.pt``: golden_run.py), under every schedule; every layout
#: that passes ``AVERAGE`` (Megatron refuses it beside the per-token loss) is one of them.
DEFAULT_LOSS = {"pp2_default_loss_mbs2", "pp2_elastic_default_loss_mbs2",
                "pp2_seq1f1b_default_loss_mbs2", "pp2_ulysses2_sppo_default_loss_mbs2",
                "pp2_helix_default_loss", "pp2_ulysses2_helix_default_loss",
                "pp2_qk_eod_elastic_default_loss_mbs2",
                "pp2_ulysses2_default_loss_mbs2", "pp2_vp2_ulysses2_interleaved_default_loss",
                "pp2_ulysses2_elastic_default_loss", "pp2_ulysses2_seq1f1b_default_loss_mbs2",
                "pp2_vp3_dp2_ep2_a2a_moe_accounted_interleaved", "pp2_moe_accounted_seq1f1b",
                *(tag for _, layouts in VARIANTS.values() for tag, (_, flags) in layouts.items()
                  if AVERAGE[0] in flags)}


def loss_flags(common: list, tag: str) -> list:
    """``common`` without ``PER_TOKEN_LOSS`` for a layout of ``DEFAULT_LOSS``."""
    return [flag for flag in common if flag != PER_TOKEN_LOSS] if tag in DEFAULT_LOSS else common


def reference_file(tag: str, flags: list) -> str:
    """The reference a layout is compared with (with Megatron's auxiliary loss over its
    micro-batches where the layout passes ``AUX``, or the loss per document where it passes
    ``DOC_AUX``)."""
    size = flags[flags.index("--micro-batch-size") + 1] if "--micro-batch-size" in flags else "1"
    aux = AUX[0] in flags
    if DOC_AUX[0] in flags:
        assert size == "1", f"{tag}: the per-document references are at micro-batch size 1"
        return "reference_default_mbs1_docaux.pt" if tag in DEFAULT_LOSS \
            else "reference_docaux.pt"
    if tag not in DEFAULT_LOSS:
        return f"reference_aux_mbs{size}.pt" if aux else "reference.pt"
    cp = flags[flags.index("--context-parallel-size") + 1] \
        if "--context-parallel-size" in flags else "1"
    if cp != "1":
        return f"reference_default_mbs{size}_cp{cp}.pt"
    return f"reference_default_mbs{size}{'_aux' if aux else ''}.pt"


#: One golden case per schedule. With ``LONGCTX_GOLDEN_SMOKE=1`` only these run: CI's pass
#: against the oldest supported megatron-core (``.ci/run``), beside the whole suite against the
#: newest; that pass selects ``test_loss_and_gradients_match_reference`` alone.
SMOKE = {"pp2", "pp2_vp2_interleaved", "pp2_ir", "pp2_elastic", "pp2_seq1f1b_uniform",
         "pp2_helix", "pp2_sppo_n4", "pp2_gpipe_outside"}
GPU_SET = os.environ.get("LONGCTX_GOLDEN_GPU") == "1"
#: Megatron's interleaved schedule at PP = 4 needs more layers than the tiny model's 4: a model
#: of 8 layers, two virtual stages per rank. Run in the GPU set only (CI's CPU suite keeps its
#: layouts).
if GPU_SET:
    VARIANTS["eight_layers"] = (["--num-layers", "8"], {
        "pp4_vp2_interleaved": (4, ["--pipeline-model-parallel-size", "4",
                                    "--num-layers-per-virtual-pipeline-stage", "1",
                                    "--pipeline-schedule", "interleaved"]),
    })
#: ``LONGCTX_GOLDEN_GPU=1``: PP = 2 and PP = 4 under every schedule (sppo with offload and with
#: multiplexing), and PP = 2 x TP = 2 with sequence parallelism under every schedule: what
#: ``scripts/gpu_check.sh`` runs on CUDA with NCCL.
GPU_LAYOUTS = {
    "pp2", "pp2_vp2_interleaved", "pp2_ir", "pp2_elastic", "pp2_seq1f1b_uniform", "pp2_helix",
    "pp2_sppo_n6_offload", "pp2_sppo_mux_n4", "pp2_sppo_mux_n6_offload",
    "pp4", "pp4_vp2_interleaved", "pp4_ir", "pp4_elastic_adaptive", "pp4_seq1f1b",
    "pp4_helix_recompute", "pp4_sppo_n8_offload", "pp4_sppo_mux_n5",
    "pp2_tp2_sp", "pp2_vp2_tp2_sp_interleaved", "pp2_tp2_sp_ir", "pp2_tp2_sp_elastic",
    "pp2_tp2_sp_seq1f1b", "pp2_tp2_sp_helix", "pp2_tp2_sp_sppo_n4_offload",
}
ALL_TAGS = {tag for _, layouts in VARIANTS.values() for tag in layouts}


def selected_tags() -> set[str]:
    """The layouts this run covers: all, :data:`SMOKE`'s, or ``LONGCTX_GOLDEN_TAGS``'s."""
    tags = ALL_TAGS
    if os.environ.get("LONGCTX_GOLDEN_SMOKE") == "1":
        tags = SMOKE
    if GPU_SET:
        tags = GPU_LAYOUTS
    named = os.environ.get("LONGCTX_GOLDEN_TAGS")
    if named:
        chosen = {tag.strip() for tag in named.split(",") if tag.strip()}
        unknown = sorted(chosen - ALL_TAGS)
        if unknown:
            raise pytest.UsageError(f"LONGCTX_GOLDEN_TAGS names no layout {unknown}; "
                                    f"layouts: {', '.join(sorted(ALL_TAGS))}")
        tags = tags & chosen
        if not tags:
            raise pytest.UsageError("LONGCTX_GOLDEN_TAGS names none of the layouts "
                                    f"({', '.join(sorted(tags))}) that LONGCTX_GOLDEN_SMOKE=1 "
                                    "or LONGCTX_GOLDEN_GPU=1 runs: name one of those, or unset "
                                    "that variable")
    return tags


SELECTED = selected_tags()
RUN = {variant: (model_flags, {tag: layout for tag, layout in layouts.items() if tag in SELECTED})
       for variant, (model_flags, layouts) in VARIANTS.items()}
RUN = {variant: entry for variant, entry in RUN.items() if entry[1]}
CASES = [(variant, tag) for variant, (_, layouts) in RUN.items() for tag in layouts]


def load(path):
    """A tensor file of the runs, onto the CPU (the ranks write CUDA tensors on a GPU)."""
    return torch.load(path, map_location="cpu")


def need(*tags: str) -> None:
    """Skip the calling test when this run leaves out one of ``tags`` (smoke or targeted)."""
    missing = sorted(set(tags) - {tag for _, tag in CASES})
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        pytest.skip(f"{len(missing)} layout(s) left out of this run: {shown}")


#: Every launch registers ``gpipe`` from ``tests/schedules/gpipe.py`` through the schedule
#: contract alone (``ScheduleSpec`` and the registry's environment variable).
OUTSIDE_SCHEDULES = {"LONGCTX_SCHEDULES": "tests.schedules.gpipe:SPEC"}


def golden_launches(root, run: dict, cuda: bool = CUDA) -> list[tuple[int, str, list[list[str]]]]:
    """``(ranks, name, command lines)`` of each launch, in order: every variant's initial
    weights (one process), then per number of ranks every layout of that size (all variants),
    then every variant's reference (one process)."""
    inits, runs, references = [], {}, []
    for variant, (model_flags, layouts) in run.items():
        common = [*TINY_MODEL, *model_flags, "--golden-dir", str(root / variant)]
        init = str(root / variant / "init")
        inits.append([*common, "--golden-mode", "init", "--save", init, "--save-interval", "1"])
        # Megatron-LM's loader reads the initial weights into each layout.
        common += ["--load", init, "--no-load-optim", "--no-load-rng"]
        for tag, (nprocs, flags) in layouts.items():
            deterministic = cuda and tag in BITWISE_TAGS
            runs.setdefault((nprocs, deterministic), []).append(
                [*loss_flags(common, tag), *flags, *(cuda_flags(tag, flags) if cuda else []),
                 "--golden-mode", "run", "--golden-tag", tag])
        references.append([*common, "--golden-mode", "reference", "--golden-tags", *layouts])
    return [(1, "init", inits),
            *((n, f"run_{n}{'_deterministic' if det else ''}", runs[n, det])
              for n, det in sorted(runs)),
            (1, "reference", references)]


def cuda_flags(tag: str, flags: list) -> list:
    """What a layout adds on CUDA (module doc): Megatron-LM's deterministic mode for the
    layouts compared bit for bit, the CPU's plan inputs for the planned ones."""
    added = DETERMINISTIC if tag in BITWISE_TAGS else []
    schedule = (flags[flags.index("--pipeline-schedule") + 1] if "--pipeline-schedule" in flags
                else "default")
    if schedule in PLANNED_SCHEDULES:
        added = [*added, *PLAN_AS_ON_CPU]
        if "--elastic-memory-gb" in flags:
            added = [*added, *NO_RESERVE]
    return added


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden")
    for nprocs, name, lines in golden_launches(root, RUN):
        torchrun_each(nprocs, WORKER, lines, str(root / f"launch_{name}.json"),
                      env={**OUTSIDE_SCHEDULES, **launch_environment(nprocs)})
    return root


def launch_environment(nprocs: int, gpus: int | None = None) -> dict:
    """A launch's environment beside :data:`OUTSIDE_SCHEDULES`: on CUDA with fewer GPUs than
    ranks, the ranks share them (``LONGCTX_SHARE_GPU=1``); else nothing."""
    gpus = torch.cuda.device_count() if gpus is None else gpus
    return {shared_gpu.SWITCH: "1"} if 0 < gpus < nprocs else {}


@pytest.mark.parametrize("variant,tag", CASES)
def test_loss_and_gradients_match_reference(golden, variant, tag):
    golden = str(golden / variant)
    reference = load(os.path.join(golden, reference_file(tag, RUN[variant][1][tag][1])))
    with open(os.path.join(golden, f"loss_{tag}.json")) as f:
        loss = json.load(f)
    assert loss["tokens"] == reference["tokens"]
    torch.testing.assert_close(loss["loss_sum"] / loss["tokens"],
                               reference["loss_sum"] / reference["tokens"],
                               rtol=TOLERANCES["fp32"]["loss_rtol"],
                               atol=TOLERANCES["fp32"]["loss_atol"])
    grads = load(os.path.join(golden, f"grads_{tag}.pt"))
    assert set(grads) == set(reference["grads"])
    for name, expected in reference["grads"].items():
        assert expected.abs().sum() > 0, f"reference gradient of {name} is zero"
        assert_gradient_close(grads[name], expected, name)


#: Per gradient tensor: the error's norm relative to the reference's (fp32 summation orders
#: differ by about 5e-7), and per entry a bound relative to the entry plus a floor relative to
#: the tensor's largest entry, so that a small entry zeroed by a bug fails too (an absolute
#: floor of 1e-5 let 15% of the reference entries be anything near zero).
NORM_RTOL, ENTRY_RTOL, ENTRY_FLOOR = (TOLERANCES["fp32"][name]
                                      for name in ("norm_rtol", "entry_rtol", "entry_floor"))


def assert_gradient_close(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    got, expected = got.double(), expected.double()
    error = (got - expected).norm() / expected.norm()
    assert error <= NORM_RTOL, f"{name}: relative norm error {error:.2e} > {NORM_RTOL:.0e}"
    bound = ENTRY_RTOL * expected.abs() + ENTRY_FLOOR * expected.abs().max()
    excess = (got - expected).abs() / bound
    worst = int(excess.argmax())
    assert excess.max() <= 1, (
        f"{name}: {int((excess > 1).sum())} of {expected.numel()} entries off, worst at flat "
        f"index {worst}: {got.flatten()[worst]:.6e} vs {expected.flatten()[worst]:.6e}")


def test_the_aux_loss_moves_the_router_gradients(golden):
    """The auxiliary loss's share of the references the MoE layouts with ``AUX`` are compared
    with (per-token and default loss; Megatron's and per document) is far above the
    comparison's bound in every router's gradient: a run that dropped or mis-scaled it would
    fail there."""
    need(*(tag for tag, (_, flags) in VARIANTS["moe"][1].items()
           if AUX[0] in flags or DOC_AUX[0] in flags))
    root = golden / "moe"
    for plain, aux in [("reference.pt", "reference_aux_mbs1.pt"),
                       ("reference_default_mbs1.pt", "reference_default_mbs1_aux.pt"),
                       ("reference.pt", "reference_docaux.pt"),
                       ("reference_default_mbs1.pt", "reference_default_mbs1_docaux.pt")]:
        without = load(root / plain)["grads"]
        with_aux = load(root / aux)["grads"]
        routers = [name for name in without if name.endswith("router.weight")]
        assert len(routers) == 4, routers
        for name in routers:
            share = (with_aux[name] - without[name]).norm() / without[name].norm()
            assert share > 100 * NORM_RTOL, \
                f"{aux}, {name}: the auxiliary loss moves it {share:.1e}"


@pytest.mark.parametrize("native,ir", [("pp2", "pp2_ir"), ("pp4", "pp4_ir"),
                                       ("pp2_tp2_sp", "pp2_tp2_sp_ir")])
def test_executor_1f1b_equals_megatron_1f1b(golden, native, ir):
    """Same per-rank order and the same megatron-core step functions: the same numbers."""
    need(native, ir)
    root = golden / "learned"
    with open(root / f"loss_{native}.json") as f, open(root / f"loss_{ir}.json") as g:
        assert json.load(f) == json.load(g)
    native_grads = load(root / f"grads_{native}.pt")
    ir_grads = load(root / f"grads_{ir}.pt")
    for name, expected in native_grads.items():
        torch.testing.assert_close(ir_grads[name], expected, rtol=0, atol=0, msg=name)


def test_1f1b_generator_orders_like_megatron(golden):
    """The IR generator's per-rank compute order is the order in which Megatron's own 1F1B
    loop called forward_step / backward_step (recorded in the native runs)."""
    need(*(tag for _, layouts in VARIANTS.values() for tag, (_, flags) in layouts.items()
           if "--pipeline-schedule" in flags
           and flags[flags.index("--pipeline-schedule") + 1] == "1f1b"))
    paths = glob.glob(str(golden / "*" / "order_*.json"))
    assert len(paths) >= 2 + 4 + 4 + 2 + 4, paths
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        assert record["microbatches"] >= 2
        expected = one_f_one_b(record["pp"], record["microbatches"])[record["pp_rank"]]
        assert record["order"] == [f"{a.kind.value}{a.unit}" for a in expected], path


@pytest.mark.skipif(CUDA, reason="the CPU compatibility layer is installed only without CUDA")
def test_every_cpu_compat_patch_is_exercised(golden):
    """Each patched megatron-core module (and replaced function / wrapped method) redirected at
    least one CUDA request to the CPU during the golden runs: no patch is dead weight."""
    need(*ALL_TAGS)
    hits = {}
    for path in glob.glob(str(golden / "*" / "hits_*.json")):
        with open(path) as f:
            for module, counts in json.load(f).items():
                for what, n in counts.items():
                    hits.setdefault(module, {}).setdefault(what, 0)
                    hits[module][what] += n
    missing = sorted(m for m in cpu_compat.patched_modules() if not any(hits.get(m, {}).values()))
    assert not missing, f"patched but never exercised: {missing}; hits: {hits}"
    assert hits["megatron.core.pipeline_parallel.schedules"]["zeros"] > 0
    assert hits["megatron.core.pipeline_parallel.p2p_communication"]["cuda.current_device"] > 0
    # The AVERAGE layouts averaged through the twins, not through gloo's own AVG.
    averaged = hits["megatron.core.distributed.param_and_grad_buffer"]
    assert averaged["all_reduce.AVG"] > 0 and averaged["reduce_scatter_tensor.AVG"] > 0


@pytest.mark.parametrize("tag", sorted(ELASTIC_EXPECTED))
def test_document_chunk_runs_exercise_what_they_claim(golden, tag):
    """The elastic / seq1f1b golden runs really mixed the chunk kinds and checkpointed as named
    (so the gradient checks above cover slicing, packing and recomputation)."""
    need(tag)
    variant = next(v for v, (_, layouts) in VARIANTS.items() if tag in layouts)
    with open(golden / variant / f"plan_{tag}.json") as f:
        plan = json.load(f)
    kinds, checkpointing = ELASTIC_EXPECTED[tag]
    assert kinds <= set(plan["kinds"]), plan["kinds"]
    counts = {c for row in plan["ckpt"] for c in row}
    fixed = "--recompute-granularity" in VARIANTS[variant][1][tag][1]
    assert (set(plan["status"]) == {"fixed"}) == fixed, plan["status"]
    if checkpointing == "none":
        assert counts == {0}
    elif checkpointing == "all":
        assert counts == {2}, "both layers of each stage (4 layers at PP=2)"
    elif checkpointing == "uniform":
        assert all(len(set(row)) == 1 for row in plan["ckpt"]) and counts != {0}
        assert max(counts) < 2, "uniform case must checkpoint part of the stage's layers"
    else:
        assert len(counts) > 1 and any(len(set(row)) > 1 for row in plan["ckpt"]), plan["ckpt"]


def test_helix_runs_needed_padding(golden):
    """Helix completes the micro-batch count to a multiple of p x folds with empty
    micro-batches: 4 micro-batches at p x folds = 8, 2 per data-parallel rank at 4, and 1, 3
    and 5 at 4."""
    need("pp4_helix_recompute", "pp2_dp2_helix", "pp2_helix_m1", "pp2_helix_m3", "pp2_helix_m5")
    for variant, tag, count in [("learned", "pp4_helix_recompute", 4),
                                ("rope_swiglu_rmsnorm", "pp2_dp2_helix", 2),
                                ("one_microbatch", "pp2_helix_m1", 1),
                                ("three_microbatches", "pp2_helix_m3", 3),
                                ("five_microbatches", "pp2_helix_m5", 5)]:
        with open(golden / variant / f"helix_{tag}.json") as f:
            record = json.load(f)
        assert record["microbatches"] == count, record
        assert record["padding"] == -count % (2 * (4 if tag.startswith("pp4") else 2)), record


@pytest.mark.parametrize("tag,rows", [("pp2_helix_mlp_chunk", 24),
                                      ("pp2_tp2_sp_helix_recompute_mlp_chunk", 12),
                                      ("pp2_dropout_helix_recompute_mlp_chunk", 24)])
def test_helix_mlp_ran_in_chunks(golden, tag, rows):
    """The chunked-MLP runs really chunked: 24 positions a chunk over a 64-position sequence
    (32 rows per rank with TP=2 and SP), so three chunks per MLP block."""
    need(tag)
    variant = next(v for v, (_, layouts) in VARIANTS.items() if tag in layouts)
    with open(golden / variant / f"helix_{tag}.json") as f:
        assert json.load(f)["mlp_rows"] == rows


def rank_records(golden, tag: str, prefix: str) -> list[dict]:
    """Every rank's ``<prefix>_<tag>_<rank>.json`` of layout ``tag``: one per rank of its
    launch."""
    variant = next(v for v, (_, layouts) in VARIANTS.items() if tag in layouts)
    paths = sorted(glob.glob(str(golden / variant / f"{prefix}_{tag}_[0-9]*.json")))
    assert len(paths) == VARIANTS[variant][1][tag][0], paths
    records = []
    for path in paths:
        with open(path) as f:
            records.append(json.load(f))
    return records


@pytest.mark.parametrize("tag", sorted(SPPO_EXPECTED))
def test_sppo_runs_exercise_what_they_claim(golden, tag):
    """The sppo golden runs cut the long documents into the asked subsequences (unevenly) and
    packed short ones whole into rows; on every rank
    (tensor-, context- and data-parallel peers included) every subsequence but a cut
    document's last moved part of its offloadable saved bytes to the host tier and back, the
    asked share of them over the run (within 10%); runs with offloading off moved nothing."""
    need(tag)
    n, ratio = SPPO_EXPECTED[tag]
    packed = []
    for record in rank_records(golden, tag, "sppo"):
        counts, lengths = record["counts"], record["lengths"]
        assert max(counts) == n and sum(counts) == len(lengths)
        assert len(set(lengths)) > 2, "uneven cuts"
        packed.append(max(record["documents"]) > 1)
        alphas = record["alphas"][record["stage"]]
        offloads = record["offloads"]
        assert record["host_used"] == 0, "everything offloaded came back"
        if ratio is None:
            assert not offloads and not any(alphas)
            continue
        assert len(offloads) == sum(counts) - len(counts)
        assert all(alpha == ratio for _, alpha, _, _ in offloads)
        assert all(0 < moved <= offloadable for _, _, offloadable, moved in offloads)
        moved = sum(r[3] for r in offloads) / sum(r[2] for r in offloads)
        assert abs(moved - ratio) <= 0.1 * ratio, moved
        assert record["host_peak"] > 0
    assert any(packed), "short documents packed (on some data-parallel replica)"


#: tag -> layers of each stage every unit of an sppo run recomputes under Megatron's recompute
#: flags (uniform at PP = 4: the stage's one layer; block 1 at PP = 2: the first of two).
SPPO_RECOMPUTED = {"pp4_sppo_n5_uniform_recompute": 1, "pp2_ulysses2_sppo_default_loss_mbs2": 1}


@pytest.mark.parametrize("tag", sorted(SPPO_RECOMPUTED))
def test_sppo_recomputes_megatrons_layers(golden, tag):
    """Under Megatron's recompute flags every stage's plan checkpoints the flags' layers, its
    schedule recomputes every unit once before its backward (the executor refuses a backward
    of a checkpointed unit that was not recomputed), and ``--sppo-offload auto`` offloads
    nothing."""
    need(tag)
    for record in rank_records(golden, tag, "sppo"):
        assert record["checkpointed"] == [SPPO_RECOMPUTED[tag]] * len(record["alphas"])
        assert record["recomputes"] == sum(record["counts"]) > 0
        assert not record["offloads"] and not any(a for row in record["alphas"] for a in row)


@pytest.mark.parametrize("tag", sorted(MUX_EXPECTED))
def test_sppo_multiplexed_runs_ran_the_shares(golden, tag):
    """The multiplexed runs (golden above) executed the first subsequence as shares: stage
    ``h`` ran the forwards of blocks ``0..h`` and their backwards in reverse; the steady
    subsequences but the last offloaded at the asked ratio, the shares never."""
    need(tag)
    pp, n, ratio = MUX_EXPECTED[tag]
    paths = sorted(glob.glob(str(golden / "one_microbatch" / f"sppo_{tag}_[0-9]*.json")))
    assert len(paths) == pp, paths
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        h = record["stage"]
        assert record["counts"] == [n]
        assert record["shares"] == [f"{h}F0.mux{k}" for k in range(h + 1)] + \
            [f"{h}B0.mux{k}" for k in range(h, -1, -1)]
        offloaded = sorted(unit for unit, *_ in record["offloads"])
        assert offloaded == ([] if ratio is None else list(range(1, n - 1)))
        assert all(alpha == ratio for _, alpha, _, _ in record["offloads"])
        assert record["host_used"] == 0


@pytest.mark.parametrize("tag", OVERLAP_TAGS)
def test_overlapped_reduction_starts_inside_the_last_backward(golden, tag):
    """With --overlap-grad-reduce (Megatron's default --align-grad-reduce), the first stage's
    buckets (several) each start their reduction once, all of them inside the rank's last
    backward action (under SPPO's multiplexing, the owner's share of the first subsequence,
    which also takes its helper's weight gradients), from the backward hooks: the first bucket's
    reduction runs while the backward still computes the others' gradients. Under helix each
    layer part's last backward holds its parameters' last gradients: every reduction starts
    inside one of those, and one before the rank's last backward starts. The later stage has
    one bucket (Megatron buckets the first stage only), started once, after its last
    backward."""
    need(tag)
    helix = "helix" in tag
    for record in rank_records(golden, tag, "overlap"):
        events = record["events"]
        reduces = [i for i, (what, _) in enumerate(events) if what == "reduce"]
        assert sorted(events[i][1] for i in reduces) == list(range(record["bucket_groups"]))
        ends = [i for i, (what, _) in enumerate(events) if what == "end"]
        last_end = ends[-1]
        last_start = max(i for i, (what, _) in enumerate(events) if what == "start")
        assert events[last_start][1] == events[last_end][1]
        if record["pp_rank"] != 0:
            assert record["bucket_groups"] == 1, record
            assert all(i > last_end for i in reduces), events
        elif helix:
            assert record["bucket_groups"] >= 2, record
            last_of_part = {events[i][1].split(".l")[-1]: i for i in ends}
            windows = [(events.index(["start", events[i][1]]), i) for i in last_of_part.values()]
            assert all(any(start < i < end for start, end in windows) for i in reduces), events
            assert any(i < last_start for i in reduces), events
        else:
            assert record["bucket_groups"] >= 2, record
            assert all(last_start < i < last_end for i in reduces), events


@pytest.mark.parametrize("tag", DISTOPT_TAGS + INSTANCES_TAGS
                         + ["pp2_vp2_dp2_dplast_distopt_interleaved"])
def test_distributed_optimizer_updates_like_the_reference(golden, tag):
    """Under the distributed optimizer (each data-parallel rank steps its shard of each bucket,
    then the shards are all-gathered: with --overlap-param-gather by the forward pre-hooks of
    the next step's forwards under the schedule; with an instance per replica, INSTANCES, each
    rank steps the whole of its buckets after the instances' all-reduce) the parameters the
    next step finds have moved from the initial ones as Megatron's optimizer moves them in one process, given the run's
    gradients (checked against the reference above: Adam's first step divides each gradient
    by its magnitude, so gradients within their bounds can still move near-zero entries
    differently). The update is compared, with the gradients' bounds, once each parameter is
    rounded to the reference's where the two are neighbours in float32: a parameter holds
    ``initial + update`` rounded to its own precision, so one unit in its last place is the
    rounding, not the update (a norm weight near 1 moved by 1e-3 rounds to 6e-8, 6e-5 of
    the update)."""
    need(tag)
    variant = next(v for v, (_, layouts) in VARIANTS.items() if tag in layouts)
    record = load(golden / variant / f"params_{tag}.pt")
    assert set(record["updated"]) == set(record["expected"]) == set(record["initial"])
    for name, initial in record["initial"].items():
        expected, updated = record["expected"][name], record["updated"][name]
        assert (expected - initial).abs().sum() > 0, f"the reference step left {name} unchanged"
        neighbours = (updated == torch.nextafter(expected, updated)) & (updated != expected)
        updated = torch.where(neighbours, expected, updated)
        assert_gradient_close(updated - initial, expected - initial, name)


@pytest.mark.parametrize("tag", [tag for tag in DISTOPT_TAGS
                                 if "--overlap-param-gather" in VARIANTS["learned"][1][tag][1]])
def test_parameter_gather_overlaps_the_first_forward(golden, tag):
    """With --overlap-param-gather (non-interleaved schedules: Megatron's --align-param-gather
    is off), in the step after the optimizer's every bucket group of a rank all-gathers its
    parameters once, waited for by a forward pre-hook of Megatron's DDP before the first
    forward of any module whose parameters it holds, which dispatches the next group's; none
    is in flight at the end. On the first stage (several bucket groups) a later bucket's
    all-gather is still in flight when the first module's forward (the embedding's) starts."""
    need(tag)
    paths = sorted(glob.glob(str(golden / "learned" / f"gather_{tag}_*.json")))
    assert len(paths) == VARIANTS["learned"][1][tag][0], paths
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        events, groups = record["events"], record["bucket_groups"]
        assert record["pending"] == [], record
        gathers = [event[1] for event in events if event[0] == "gather"]
        waits = [event[1] for event in events if event[0] == "wait"]
        assert sorted(gathers) == sorted(waits) == list(range(groups)), events
        forwards = [event for event in events if event[0] == "forward"]
        assert forwards and all(not set(in_flight) - set(gathers)
                                for _, _, in_flight in forwards), events
        first = events.index(forwards[0])
        assert ["wait", groups - 1] in events[:first], events
        if record["pp_rank"] == 0:
            assert groups >= 2, record
            assert forwards[0][1].startswith("embedding") and forwards[0][2], events


#: The pipelines and data-parallel groups (global ranks) of PP=2 x DP=2 in Megatron's default
#: order (tp-cp-ep-dp-pp) and with --use-tp-pp-dp-mapping (tp-cp-ep-pp-dp).
RANK_ORDERS = {"default": {"pipeline": [[0, 2], [1, 3]], "data": [[0, 1], [2, 3]]},
               "dp_last": {"pipeline": [[0, 1], [2, 3]], "data": [[0, 2], [1, 3]]}}
PP2_DP2_TAGS = sorted(tag for _, layouts in VARIANTS.values()
                      for tag, (ranks, flags) in layouts.items()
                      if ranks == 4 and tag.startswith("pp2_dp2"))


@pytest.mark.parametrize("tag", PP2_DP2_TAGS)
def test_ranks_are_placed_in_the_order_asked(golden, tag):
    """The PP=2 x DP=2 runs placed their ranks as Megatron's order asks: with
    --use-tp-pp-dp-mapping the pipelines are consecutive ranks, without it the data-parallel
    replicas are (so the golden checks above cover both placements)."""
    need(tag)
    variant = next(v for v, (_, layouts) in VARIANTS.items() if tag in layouts)
    order = "dp_last" if DP_LAST[0] in VARIANTS[variant][1][tag][1] else "default"
    found = {"pipeline": set(), "data": set()}
    for rank in range(4):
        with open(golden / variant / f"groups_{tag}_{rank}.json") as f:
            record = json.load(f)
        for kind in found:
            assert rank in record[kind], (rank, record)
            found[kind].add(tuple(record[kind]))
    assert {kind: sorted(map(list, groups)) for kind, groups in found.items()} \
        == RANK_ORDERS[order]


def _count(flags: list, flag: str, default: int = 1) -> int:
    return int(flags[flags.index(flag) + 1]) if flag in flags else default


#: ``(variant, tag)`` of the layouts with tensor or context parallelism.
SPLIT_TAGS = [(variant, tag) for variant, (_, layouts) in VARIANTS.items()
              for tag, (_, flags) in layouts.items()
              if "--tensor-model-parallel-size" in flags or "--context-parallel-size" in flags]


@pytest.mark.parametrize("variant,tag", SPLIT_TAGS)
def test_tensor_and_context_parallel_groups_are_the_sizes_asked(golden, variant, tag):
    """Every rank of a layout with --tensor-model-parallel-size TP or --context-parallel-size
    CP is in a tensor-parallel group of TP ranks and a context-parallel group of CP ranks, and
    each of its attention modules holds 1 / TP of the heads (Megatron splits the heads and
    their projections over the tensor-parallel ranks) and runs sequence parallelism where the
    layout asks it: the loss and gradients checked above are those of a model split as asked,
    not of more data-parallel replicas of the whole model or of the activations whole on every
    tensor-parallel rank, whose numbers are the same (what the mutation check's reset of
    either size or of --sequence-parallel gives)."""
    need(tag)
    model_flags, layouts = VARIANTS[variant]
    nprocs, flags = layouts[tag]
    tp, cp = _count(flags, "--tensor-model-parallel-size"), _count(flags, "--context-parallel-size")
    argv = [*TINY_MODEL, *model_flags, *flags]
    heads = _count(argv[len(argv) - 1 - argv[::-1].index("--num-attention-heads"):],
                   "--num-attention-heads")
    for rank in range(nprocs):
        with open(golden / variant / f"groups_{tag}_{rank}.json") as f:
            record = json.load(f)
        assert (len(record["tensor"]), len(record["context"])) == (tp, cp), (rank, record)
        assert rank in record["tensor"] and rank in record["context"], (rank, record)
        assert record["heads"] and set(record["heads"]) == {heads // tp}, (rank, record)
        assert record["sequence_parallel"] == ["--sequence-parallel" in flags], (rank, record)


@pytest.mark.parametrize("tag", sorted(VARIANTS["moe"][1]))
def test_experts_are_spread_over_the_ranks_asked(golden, tag):
    """Each rank of the moe runs holds 1 / (EP x ETP) of the experts' weights of its MoE layers
    (per layer, the experts' fc1 and fc2 of hidden x ffn entries each) and its expert groups
    have EP and ETP ranks, carved from its data-parallel replicas: the expert-parallel runs
    place 2 of the 4 experts on each rank, the experts' tensor-parallel runs (ETP defaults to
    the tensor-parallel size) half of every expert on each, so the gradients checked above
    are those of spread experts. Experts spread otherwise than the dense weights (over
    expert-parallel ranks, or tensor-parallel ranks of another count) are all reduced apart
    from the other weights (Megatron's expert buckets), the others with them."""
    need(tag)
    model_flags, layouts = VARIANTS["moe"]
    nprocs, flags = layouts[tag]
    tp = _count(flags, "--tensor-model-parallel-size")
    ep, etp = _count(flags, EP2[0]), _count(flags, ETP2[0], default=tp)
    per_layer = (_count(model_flags, "--num-experts") * 2 * _count(TINY_MODEL, "--hidden-size")
                 * _count(model_flags, "--moe-ffn-hidden-size"))
    for rank in range(nprocs):
        with open(golden / "moe" / f"groups_{tag}_{rank}.json") as f:
            record = json.load(f)
        assert record["moe_layers"] > 0, record
        assert record["expert_entries"] * ep * etp == record["moe_layers"] * per_layer, record
        assert (len(record["expert_model"]), len(record["expert_tensor"])) == (ep, etp), record
        assert rank in record["expert_model"] and rank in record["expert_tensor"], record
        apart = ep > 1 or etp != tp
        assert record["expert_entries_apart"] == (record["expert_entries"] if apart else 0)
        if apart:
            assert sorted({*record["expert_model"], *record["expert_tensor"]}) \
                == sorted(record["data"]), record
