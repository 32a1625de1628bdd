"""Every registered schedule x every Megatron option that changes what a schedule must do
(recomputation, micro-batch size): either accepted, with the golden layout that proves it is
honoured with Megatron's meaning, or refused at start-up naming the flag. A schedule registered
later falls into the refusal column until a golden layout is named for it here. Megatron's
default loss (no ``--calculate-per-token-loss``): accepted by every schedule, with the golden
layout of each schedule that forms its loss from units of its own."""
import importlib.util
import os
import re

import pytest

from megatron.plugin import arguments, cpu_compat, option_classes, registry

OPTIONS = {
    "full-uniform": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1"],
    "full-block": ["--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "1"],
    "selective": ["--recompute-granularity", "selective"],
    "micro-batch-size-2": ["--micro-batch-size", "2"],
}

#: (schedule, option) -> golden layout (tests/distributed/test_golden_megatron.py) that trains
#: it to the single-process reference. ``default`` picks Megatron's 1F1B at this layout.
HONOURED = {
    ("default", "full-uniform"): "pp2_full_recompute",
    ("default", "full-block"): "pp2_block_recompute_mbs2",
    ("default", "selective"): "pp2_selective_recompute",
    ("default", "micro-batch-size-2"): "pp2_block_recompute_mbs2",
    ("1f1b", "full-uniform"): "pp2_full_recompute",
    ("1f1b", "full-block"): "pp2_block_recompute_mbs2",
    ("1f1b", "selective"): "pp2_selective_recompute",
    ("1f1b", "micro-batch-size-2"): "pp2_block_recompute_mbs2",
    ("interleaved", "full-uniform"): "pp2_vp2_interleaved_uniform_recompute_mbs2",
    ("interleaved", "full-block"): "pp2_vp2_interleaved_block_recompute",
    ("interleaved", "selective"): "pp2_vp2_interleaved_selective_recompute",
    ("interleaved", "micro-batch-size-2"): "pp2_vp2_interleaved_uniform_recompute_mbs2",
    ("1f1b-ir", "full-uniform"): "pp2_ir_uniform_recompute_mbs2",
    ("1f1b-ir", "full-block"): "pp2_ir_block_recompute",
    ("1f1b-ir", "selective"): "pp2_ir_selective_recompute",
    ("1f1b-ir", "micro-batch-size-2"): "pp2_ir_uniform_recompute_mbs2",
    ("elastic", "full-uniform"): "pp2_full_recompute_elastic",
    ("elastic", "full-block"): "pp2_block_recompute_elastic",
    ("seq1f1b", "full-uniform"): "pp2_full_recompute_seq1f1b",
    ("seq1f1b", "full-block"): "pp2_block_recompute_seq1f1b",
    ("helix", "micro-batch-size-2"): "pp2_helix_mbs2",
    ("elastic", "micro-batch-size-2"): "pp2_elastic_default_loss_mbs2",
    ("seq1f1b", "micro-batch-size-2"): "pp2_seq1f1b_default_loss_mbs2",
    ("sppo", "micro-batch-size-2"): "pp2_ulysses2_sppo_default_loss_mbs2",
    ("sppo", "full-uniform"): "pp4_sppo_n5_uniform_recompute",
    ("sppo", "full-block"): "pp2_ulysses2_sppo_default_loss_mbs2",
}

#: The flag a refusal must name, per option.
FLAG = {"full-uniform": "--recompute-granularity", "full-block": "--recompute-granularity",
        "selective": "--recompute-granularity", "micro-batch-size-2": "--micro-batch-size"}

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
        "--pipeline-model-parallel-size", "2", "--calculate-per-token-loss",
        "--max-position-embeddings", "64", "--micro-batch-size", "1",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]


def _layout_flags(schedule):
    if schedule == "interleaved":
        return ["--num-layers-per-virtual-pipeline-stage", "1"]
    return []


def _golden_module():
    path = os.path.join(os.path.dirname(__file__), "..", "distributed",
                        "test_golden_megatron.py")
    spec = importlib.util.spec_from_file_location("golden_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _golden_layouts():
    return {tag: flags for _, layouts in _golden_module().VARIANTS.values()
            for tag, (_, flags) in layouts.items()}


CELLS = [(schedule, option) for schedule in registry.schedule_names() for option in OPTIONS]


@pytest.mark.parametrize("schedule,option", CELLS)
def test_option_is_honoured_or_refused_by_name(schedule, option, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*BASE, *_layout_flags(schedule), "--pipeline-schedule", schedule, *OPTIONS[option]]
    if (schedule, option) in HONOURED:
        args = arguments.parse(argv)
        assert args.pipeline_schedule == schedule
        return
    with pytest.raises(ValueError, match=FLAG[option]):
        arguments.parse(argv)


def test_every_honoured_pair_has_its_golden_layout():
    layouts = _golden_layouts()
    for (schedule, option), tag in HONOURED.items():
        assert tag in layouts, (schedule, option, tag)
        flags = layouts[tag]
        schedule_flag = flags[flags.index("--pipeline-schedule") + 1]
        assert schedule_flag == ("1f1b" if schedule == "default" else schedule), tag
        text = " ".join(flags)
        assert " ".join(OPTIONS[option]) in text, (tag, option)


PER_TOKEN_LOSS = "--calculate-per-token-loss"
#: Megatron's default loss: schedule -> the golden layout trained without
#: ``--calculate-per-token-loss`` (``default`` picks Megatron's 1F1B). ``1f1b-ir`` and
#: ``helix`` run Megatron's micro-batches through Megatron's ``forward_step``, the others
#: weight tokens themselves.
DEFAULT_LOSS_LAYOUTS = {
    "default": "pp2_default_loss_mbs2",
    "1f1b": "pp2_default_loss_mbs2",
    "interleaved": "pp2_vp2_ulysses2_interleaved_default_loss",
    "1f1b-ir": "pp2_dp2_overlap_ir",
    "elastic": "pp2_elastic_default_loss_mbs2",
    "seq1f1b": "pp2_seq1f1b_default_loss_mbs2",
    "sppo": "pp2_ulysses2_sppo_default_loss_mbs2",
    "helix": "pp2_helix_default_loss",
}


@pytest.mark.parametrize("schedule", registry.schedule_names())
def test_megatron_default_loss_is_accepted_with_its_golden_layout(schedule, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [flag for flag in BASE if flag != PER_TOKEN_LOSS]
    args = arguments.parse([*argv, *_layout_flags(schedule), "--pipeline-schedule", schedule])
    assert not args.calculate_per_token_loss
    golden = _golden_module()
    tag = DEFAULT_LOSS_LAYOUTS[schedule]
    assert tag in golden.DEFAULT_LOSS
    flags = _golden_layouts()[tag]
    assert flags[flags.index("--pipeline-schedule") + 1] == \
        ("1f1b" if schedule == "default" else schedule), tag


@pytest.mark.parametrize("schedule", ["default", "1f1b", "interleaved", "1f1b-ir"])
def test_context_parallel_takes_megatrons_default_loss_with_its_micro_batches(schedule,
                                                                               monkeypatch):
    """Megatron's micro-batches under Ulysses: the default loss weighs each token as
    Megatron's own context-parallel split does (megatron/plugin/context_loss.py), so it is
    accepted; Megatron-LM's validation refuses a --seq-length that its 2 x CP chunks do not
    divide, whatever the loss."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [flag for flag in BASE if flag != PER_TOKEN_LOSS]
    flags = [*_layout_flags(schedule), "--context-parallel-size", "2", "--pipeline-schedule",
             schedule]
    assert arguments.parse([*argv, *flags]).context_parallel_size == 2
    with pytest.raises(AssertionError, match="multiple of 2 \\* context-parallel-size"):
        arguments.parse([*BASE, *flags, "--seq-length", "66", "--max-position-embeddings",
                         "128"])


def test_cp_comm_type_accepts_the_values_that_run_ulysses(monkeypatch):
    """The document attention runs Ulysses all-to-all for every --cp-comm-type: a2a and
    Megatron's default p2p, one value or one per layer, are accepted; allgather and a2a+p2p
    are refused naming what to pass."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*BASE, "--context-parallel-size", "2", "--pipeline-schedule", "1f1b"]
    assert arguments.parse([*argv, "--cp-comm-type", "a2a"]).cp_comm_type == ["a2a"]
    per_layer = ["a2a", "p2p", "p2p", "a2a"]
    assert arguments.parse([*argv, "--cp-comm-type", *per_layer]).cp_comm_type == per_layer
    for value in (["allgather"], ["a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1"],
                  ["a2a", "allgather", "a2a", "a2a"]):
        with pytest.raises(ValueError, match="--cp-comm-type .* is not supported .* pass "
                                             "--cp-comm-type a2a"):
            arguments.parse([*argv, "--cp-comm-type", *value])


#: Options the document schedules refuse (Megatron's own schedules run them with Megatron's
#: code): each with the flags that set it.
DOCUMENT_REFUSED = {
    "defer_embedding_wgrad_compute": ["--defer-embedding-wgrad-compute"],
    "num_layers_per_virtual_pipeline_stage": ["--num-layers-per-virtual-pipeline-stage", "1"],
}

DOCUMENT_SCHEDULES = [name for name in registry.schedule_names() if not registry.is_megatron(name)]


@pytest.mark.parametrize("schedule", DOCUMENT_SCHEDULES)
@pytest.mark.parametrize("dest", sorted(DOCUMENT_REFUSED))
def test_document_schedules_refuse_what_their_executors_do_not_run(schedule, dest, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert dest in option_classes.REFUSED or option_classes.proof(dest, schedule) is None
    flag = arguments.megatron_defaults()[dest][0]
    argv = [*BASE, "--pipeline-schedule", schedule, *DOCUMENT_REFUSED[dest]]
    if schedule in ("helix", "sppo") and dest == "num_layers_per_virtual_pipeline_stage":
        flag = "drop --num-layers-per-virtual-pipeline-stage"  # their own, earlier refusal
    with pytest.raises(ValueError, match=flag):
        arguments.parse(argv)


@pytest.mark.parametrize("schedule", DOCUMENT_SCHEDULES)
def test_overlapped_gradient_reduction_is_honoured(schedule, monkeypatch):
    """``--overlap-grad-reduce`` (with ``--ddp-bucket-size``) under every executor schedule,
    each proved by a golden layout (the schedule's ``ScheduleSpec.proofs``)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*BASE, "--pipeline-schedule", schedule, "--overlap-grad-reduce",
            "--ddp-bucket-size", "10000"]
    assert option_classes.proof("overlap_grad_reduce", schedule).startswith("golden:")
    args = arguments.parse(argv)
    assert args.overlap_grad_reduce and args.ddp_bucket_size == 10000


#: Megatron's uneven pipeline splits: honoured where the schedule runs Megatron's layer map
#: (golden layouts), refused where the schedule places layers itself or needs equal stages
#: (sppo's multiplexed helpers).
UNEVEN_SPLITS = [
    ("helix", ["--decoder-first-pipeline-num-layers", "1"],
     "helix places its layer parts by its own mapping"),
    ("sppo", ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
              "--sppo-multiplex"],
     "--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split with "
     "--sppo-multiplex: the multiplexed helpers run another stage's layers"),
    ("sppo", ["--decoder-last-pipeline-num-layers", "3", "--sppo-multiplex"],
     "drop --decoder-last-pipeline-num-layers or --sppo-multiplex"),
    ("interleaved", ["--decoder-first-pipeline-num-layers", "1",
                     "--num-layers-per-virtual-pipeline-stage", "1"],
     "--decoder-first-pipeline-num-layers is not supported by --pipeline-schedule interleaved"),
]


@pytest.mark.parametrize("schedule,flags,refusal", UNEVEN_SPLITS)
def test_uneven_splits_are_refused_where_stages_must_be_equal(schedule, flags, refusal,
                                                              monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        arguments.parse([*BASE, "--pipeline-schedule", schedule, *flags])


#: Mixture-of-experts options that depend on how many tokens one call holds, or that no test
#: proves, refused by name under a document schedule (dropless routing is honoured: golden).
MOE_REFUSED = [
    (["--moe-expert-capacity-factor", "1.0"], "an expert's capacity counts the tokens of one "
                                              "forward call"),
    (["--moe-pad-expert-input-to-capacity"], "drop the flag (dropless routing"),
    (["--moe-router-load-balancing-type", "seq_aux_loss"], "only Megatron's default aux_loss "
                                                           "is proven"),
    (["--moe-router-enable-expert-bias"], "each schedule pads differently"),
    (["--expert-model-parallel-size", "2"], "elastic plans each replica's documents apart"),
    (["--moe-token-dispatcher-type", "alltoall"], "it chooses how the ranks of spread experts "
                                                  "exchange tokens"),
    (["--moe-token-dispatcher-type", "flex"], "(it honours allgather and alltoall)"),
    ([], "add --disable-bias-linear"),
    (["--expert-tensor-parallel-size", "2"], "the calls would not pair up. Drop "
                                             "--expert-tensor-parallel-size, or use 1f1b"),
]


@pytest.mark.parametrize("schedule", ["default", "elastic", "helix", "sppo"])
def test_the_experts_tensor_parallel_size_is_taken_where_no_layer_has_experts(schedule,
                                                                             monkeypatch):
    """Without --num-experts the experts' tensor-parallel size sizes Megatron's expert groups
    only (golden with tensor parallelism); with experts at their own size it is refused."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*BASE, "--pipeline-schedule", schedule, "--pipeline-model-parallel-size", "2",
            "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "1"]
    assert arguments.check_command_line(argv).expert_tensor_parallel_size == 1


#: Experts spread over ranks (EP), split over ranks (ETP) and Megatron's all-to-all token
#: dispatcher: taken where a golden layout proves them (two data-parallel replicas of PP=2),
#: refused by name elsewhere: ``(flags, {schedule: refusal, or None where taken})``.
SPREAD_EXPERTS = [
    (["--expert-model-parallel-size", "2"], {
        "default": None, "1f1b": None, "interleaved": None, "1f1b-ir": None,
        "elastic": "elastic plans each replica's documents apart",
        "seq1f1b": "seq1f1b plans each replica's documents apart",
        "sppo": "sppo cuts each replica's documents into its own subsequences",
        "helix": "no test proves that its MoE calls pair up across replicas"}),
    (["--expert-tensor-parallel-size", "2"], {
        "default": None, "1f1b": None, "1f1b-ir": None,
        "interleaved": "no test proves experts split over another tensor-parallel size",
        "seq1f1b": "Drop --expert-tensor-parallel-size, or use 1f1b or 1f1b-ir",
        "helix": "Drop --expert-tensor-parallel-size, or use 1f1b or 1f1b-ir"}),
    (["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"], {
        "default": None, "1f1b": None, "interleaved": None, "1f1b-ir": None,
        "sppo": "--moe-token-dispatcher-type is not supported by --pipeline-schedule sppo"}),
]


@pytest.fixture
def release_019(monkeypatch):
    """The megatron-core release the experts' own tensor-parallel size is proven on (0.17 keeps
    whole experts on each rank: :func:`test_experts_split_over_ranks_are_refused_on_0_17`)."""
    monkeypatch.setattr(cpu_compat, "megatron_core_version", lambda: "0.19.2")


def test_experts_split_over_ranks_are_refused_on_0_17(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(cpu_compat, "megatron_core_version", lambda: "0.17.0")
    with pytest.raises(ValueError, match=re.escape(
            "on megatron-core 0.17.0: its golden layouts pass on megatron-core 0.19 and fail "
            "on this release")):
        arguments.check_command_line([*BASE, "--pipeline-schedule", "1f1b", "--num-experts",
                                      "4", "--disable-bias-linear",
                                      "--expert-tensor-parallel-size", "2"])


@pytest.mark.parametrize("flags,expected", SPREAD_EXPERTS)
def test_spread_experts_are_taken_where_every_replica_calls_the_moe_layers_alike(
        flags, expected, monkeypatch, release_019):
    monkeypatch.setenv("WORLD_SIZE", "4")
    for schedule, refusal in expected.items():
        argv = [*BASE, "--pipeline-schedule", schedule, "--num-experts", "4",
                "--disable-bias-linear", *flags]
        if schedule == "interleaved":
            argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
        if refusal is None:
            arguments.check_command_line(argv)
            continue
        with pytest.raises(ValueError, match=re.escape(refusal)):
            arguments.check_command_line(argv)


def test_experts_split_under_megatrons_virtual_stages_are_refused(monkeypatch, release_019):
    """Under ``default`` with virtual stages Megatron runs its interleaved schedule, where no
    test proves experts split over their own tensor-parallel size."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="--pipeline-schedule interleaved: no test proves"):
        arguments.check_command_line([
            *BASE, "--pipeline-schedule", "default", "--num-layers-per-virtual-pipeline-stage",
            "1", "--num-experts", "4",
            "--disable-bias-linear", "--expert-tensor-parallel-size", "2"])


@pytest.mark.parametrize("flags,refusal", MOE_REFUSED)
def test_moe_options_outside_dropless_routing_are_refused_by_name(flags, refusal, monkeypatch,
                                                                  release_019):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*BASE, "--pipeline-schedule", "elastic", "--num-experts", "4", *flags]
    if refusal != "add --disable-bias-linear":
        argv.append("--disable-bias-linear")
    with pytest.raises(ValueError, match=re.escape(refusal)):
        arguments.check_command_line(argv)


AUX_SCHEDULES = ["1f1b", "interleaved", "1f1b-ir", "elastic", "seq1f1b", "helix", "sppo"]


def _per_document(schedule: str) -> bool:
    """Whether ``schedule`` takes the project's per-document load-balancing loss."""
    return option_classes.proof("moe_per_document_aux_loss_coeff", schedule) is not None


def _moe_argv(schedule: str, *flags: str) -> list:
    argv = [*BASE, "--pipeline-schedule", schedule, "--num-experts", "4",
            "--disable-bias-linear", *flags]
    if schedule == "interleaved":
        argv += ["--num-layers-per-virtual-pipeline-stage", "1"]
    return argv


@pytest.mark.parametrize("schedule", AUX_SCHEDULES)
def test_megatrons_aux_loss_is_taken_only_where_the_router_runs_megatrons_micro_batches(
        schedule, monkeypatch):
    """Megatron's auxiliary load-balancing loss is a formula over each router call's tokens,
    once per micro-batch of packed rows: taken under the schedules whose calls are Megatron's
    micro-batches (golden against Megatron's value); refused by name under the others, elastic
    and seq1f1b naming the per-document loss as what to pass instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = _moe_argv(schedule, "--moe-aux-loss-coeff", "0.01")
    if schedule in ("1f1b", "interleaved", "1f1b-ir"):
        assert arguments.check_command_line(argv).moe_aux_loss_coeff == [0.01]
        return
    if _per_document(schedule):
        refusal = (f"--moe-aux-loss-coeff is not supported by --pipeline-schedule {schedule}: "
                   f".*cannot compute Megatron's value.*pass --moe-per-document-aux-loss-coeff "
                   f"instead")
    else:
        refusal = "--moe-aux-loss-coeff.*this schedule calls the router on units of its own"
    with pytest.raises(ValueError, match=refusal):
        arguments.check_command_line(argv)


@pytest.mark.parametrize("schedule", AUX_SCHEDULES)
def test_the_per_document_aux_loss_is_the_project_flag_of_elastic_and_seq1f1b(schedule,
                                                                              monkeypatch):
    """``--moe-per-document-aux-loss-coeff`` (the project's loss per document, golden against
    a reference of that definition) is taken under elastic and seq1f1b, where it builds the
    per-document router with its coefficient, and refused elsewhere with Megatron's flag named
    instead; without it those schedules build Megatron's router, with no auxiliary loss."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron.plugin import model
    from megatron.plugin.layers.document_router import DocumentRouter

    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = _moe_argv(schedule, "--moe-per-document-aux-loss-coeff", "0.01")
    if not _per_document(schedule):
        with pytest.raises(ValueError, match="--moe-per-document-aux-loss-coeff.*pass "
                                             "--moe-aux-loss-coeff for Megatron's"):
            arguments.check_command_line(argv)
        return
    for flags, router, coeff in ((argv, DocumentRouter, 0.01),
                                 (_moe_argv(schedule), TopKRouter, 0.0)):
        args = arguments.parse(flags)
        mlp = model.layer_spec(args, 1, None).layer_specs[0].submodules.mlp
        # megatron-core 0.19 gives the MoE layer's spec as a partial, 0.17 and 0.18 a ModuleSpec
        submodules = mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules
        assert submodules.router is router
        assert model.model_config(args).moe_aux_loss_coeff == coeff


#: A flag of one schedule's group under a schedule without that group would do nothing:
#: ``(schedule, flags, the refusal or None where the group is the schedule's own)``.
FOREIGN_FLAGS = [
    ("elastic", ["--helix-folds", "1"], "--helix-folds is a flag of --pipeline-schedule helix"),
    ("1f1b", ["--sppo-offload", "1"], "--sppo-offload is a flag of --pipeline-schedule sppo"),
    ("sppo", ["--elastic-slices", "2"],
     "--elastic-slices is a flag of --pipeline-schedule elastic / seq1f1b"),
    ("helix", ["--hardware-profile", "h100"],
     "--hardware-profile is a flag of --pipeline-schedule elastic / seq1f1b / sppo"),
    ("sppo", ["--hardware-profile", "h100"], None),
    ("seq1f1b", ["--hardware-profile", "h100", "--elastic-slices", "2"], None),
]


@pytest.mark.parametrize("schedule,flags,refusal", FOREIGN_FLAGS)
def test_flags_of_another_schedule_are_refused(schedule, flags, refusal, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*BASE, "--pipeline-schedule", schedule, *flags]
    if refusal is None:
        assert arguments.parse(argv).hardware_profile == "h100"
        return
    with pytest.raises(ValueError, match=f"{refusal} and would do nothing under "
                                         f"--pipeline-schedule {schedule}: drop it"):
        arguments.parse(argv)


@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b", "sppo"])
def test_the_hardware_profile_prices_the_plan(schedule, monkeypatch):
    """``--hardware-profile h100`` is the profile the schedule's planner prices with (the cost
    model of :func:`~longctx.job_costs.cost_model_from_args`, which elastic and seq1f1b plan
    each batch with and sppo sizes its subsequences with), not the CPU's default (a800): the
    plan elastic and seq1f1b run predicts the times of H100's profile, other than A800's."""
    from elastic_pipe.flags import scheduler_config
    from elastic_pipe.planning import plan_schedule
    from longctx.hardware import load_profile
    from longctx.job_costs import cost_model_from_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    slices = [] if schedule == "sppo" else ["--elastic-slices", "2"]
    args = arguments.parse([*BASE, "--pipeline-schedule", schedule, *slices,
                            "--hardware-profile", "h100"])
    cost = cost_model_from_args(args, 256)
    assert cost.hardware == load_profile("h100") != load_profile("a800")
    if schedule == "sppo":
        return
    lengths = (4000, 2100, 1000, 500, 300, 100, 50, 20)

    def predicted(hardware):
        return plan_schedule(lengths, schedule, cost.model, hardware, cost.parallel,
                             scheduler_config(args)).predicted_time_s

    assert predicted(cost.hardware) == predicted(load_profile("h100")) \
        != predicted(load_profile("a800"))


@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
def test_the_smallest_slice_lets_the_planner_cut_finer(schedule, monkeypatch):
    """``--elastic-min-slice-tokens 256``: the automatic slice count goes down to first slices
    of 256 tokens, so the plan training runs cuts a 4000-token document into slices that fit
    18 MB a GPU, no more of them than 256-token slices allow; at the default 4096 the document
    cannot be cut and no plan fits that budget."""
    from elastic_pipe.flags import scheduler_config
    from elastic_pipe.planning import plan_schedule
    from longctx.cost_model import GB
    from longctx.job_costs import cost_model_from_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    lengths, budget = (4000, 100, 50), 0.018

    def planned(*flags):
        args = arguments.parse([*BASE, "--pipeline-schedule", schedule, "--elastic-memory-gb",
                                str(budget), "--elastic-reserved-gb", "0", *flags])
        cost = cost_model_from_args(args, 256, args.elastic_memory_gb, args.elastic_reserved_gb)
        return plan_schedule(lengths, schedule, cost.model, cost.hardware, cost.parallel,
                             scheduler_config(args))

    plan = planned("--elastic-min-slice-tokens", "256")
    slices = [piece for chunk in plan.chunks() for piece in chunk.pieces if piece.doc == 0]
    assert 1 < len(slices) <= lengths[0] // 256
    assert max(plan.peak_memory_bytes) <= budget * GB
    with pytest.raises(ValueError, match=r"no (plan|fixed chunk size) fits 0\.018 GB"):
        planned()


_FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
#: What each schedule's refusal of --recompute-activations names instead.
RECOMPUTE_ACTIVATIONS_INSTEAD = {
    **{schedule: ["--recompute-granularity", "selective"]
       for schedule in ("default", "1f1b", "interleaved", "1f1b-ir")},
    "elastic": _FULL_UNIFORM, "seq1f1b": _FULL_UNIFORM, "sppo": _FULL_UNIFORM,
    "helix": ["--helix-recompute-without-attention"],
}


@pytest.mark.parametrize("schedule", registry.schedule_names())
def test_recompute_activations_is_refused_naming_what_the_schedule_takes_instead(schedule,
                                                                                monkeypatch):
    """``--recompute-activations`` (Megatron-LM's spelling of ``--recompute-granularity
    selective``) is refused under every schedule, naming the recomputation the schedule runs;
    the flags named are accepted there."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*BASE, "--pipeline-schedule", schedule, *_layout_flags(schedule)]
    instead = RECOMPUTE_ACTIVATIONS_INSTEAD[schedule]
    with pytest.raises(ValueError) as refused:
        arguments.check_command_line([*argv, "--recompute-activations"])
    text = str(refused.value)
    assert ("--recompute-activations is not supported by pretrain_gpt_elastic.py: it is "
            "Megatron-LM's older spelling of --recompute-granularity selective") in text, text
    assert f"pass {' '.join(instead)}" in text, text
    arguments.parse([*argv, *instead])


#: Megatron options of the attention, position embedding and model that a schedule's model
#: would not honour: ``(flags, schedule, what the refusal names)``.
MODEL_REFUSED = [
    (["--position-embedding-type", "none"], "1f1b", "--position-embedding-type none"),
    (["--position-embedding-type", "mrope", "--mrope-section", "2", "1", "1"], "elastic",
     "--position-embedding-type mrope"),
    (["--position-embedding-type", "rope", "--use-rope-scaling"], "1f1b", "--use-rope-scaling"),
    (["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "2"],
     "sppo", "--rotary-seq-len-interpolation-factor"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "2"], "1f1b", "--no-rope-freq"),
    (["--window-size", "16,0"], "elastic", "--window-size"),
    (["--softmax-type", "off-by-one"], "1f1b", "--softmax-type"),
    (["--qk-l2-norm"], "helix", "--qk-l2-norm"),
    (["--attention-output-gate"], "helix", "--attention-output-gate"),
    # Megatron computes the MuP width multiplier and replaces a value given.
    (["--use-mup", "--mup-width-mult", "2"], "elastic", "--mup-width-mult"),
    # Megatron-LM takes its local attention backend only with its legacy local spec.
    (["--attention-backend", "local"], "elastic",
     "--attention-backend local is not supported .* use --attention-backend unfused"),
    (["--use-flash-attn"], "1f1b", "--use-flash-attn"),
    # Context parallelism is Ulysses all-to-all, never Megatron's ring or hierarchy.
    (["--context-parallel-size", "2", "--cp-comm-type", "allgather"], "1f1b-ir",
     "--cp-comm-type"),
    (["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "1"],
     "elastic", "--hierarchical-context-parallel-sizes"),
    # No golden layout recomputes other modules or distributes the saved activations.
    (["--recompute-granularity", "selective", "--recompute-modules", "mlp", "layernorm"],
     "1f1b-ir", "--recompute-modules"),
    (["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
      "--recompute-method", "uniform", "--distribute-saved-activations"], "1f1b-ir",
     "--distribute-saved-activations"),
]


@pytest.mark.parametrize("flags,schedule,named", MODEL_REFUSED)
def test_model_options_the_model_would_not_honour_are_refused(flags, schedule, named,
                                                              monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=named):
        arguments.parse([*BASE, "--pipeline-schedule", schedule, *flags])


def test_an_fp32_residual_is_refused_before_megatrons_validation(monkeypatch):
    """Megatron-LM takes ``--fp32-residual-connection`` with bf16 or fp16 only (CUDA): the
    project's refusal comes first (no schedule proves it; helix's parts and SPPO's multiplexed
    helpers would hand the residual on in the model's dtype)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for schedule in ("helix", "sppo", "1f1b"):
        with pytest.raises(ValueError, match="--fp32-residual-connection is not supported"):
            arguments.check_command_line([*BASE, "--pipeline-schedule", schedule,
                                          "--fp32-residual-connection"])


def test_a_timeout_change_that_needs_cuda_is_refused_without_it(monkeypatch):
    """Megatron-LM synchronizes the device before it applies
    ``--distributed-timeout-seconds-after-init`` (after the first iteration): on a machine
    without CUDA the flag is refused at start-up instead of failing there."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(arguments.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--distributed-timeout-seconds-after-init needs CUDA"):
        arguments.parse([*BASE, "--distributed-timeout-seconds-after-init", "10"])


@pytest.mark.parametrize("schedule", registry.schedule_names())
def test_average_in_collective_takes_megatrons_default_loss(schedule, monkeypatch):
    """``--ddp-average-in-collective`` (Megatron's DDP averaging the replicas' gradients in its
    collectives) is accepted under every schedule with Megatron's default loss, and refused
    beside ``--calculate-per-token-loss``, which Megatron's DDP asserts against, by name."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = [*_layout_flags(schedule), "--pipeline-schedule", schedule,
             "--ddp-average-in-collective"]
    argv = [flag for flag in BASE if flag != PER_TOKEN_LOSS]
    assert arguments.parse([*argv, *flags]).ddp_average_in_collective
    with pytest.raises(ValueError, match="--ddp-average-in-collective with "
                                         "--calculate-per-token-loss: .* drop"):
        arguments.parse([*BASE, *flags])


def test_distributed_optimizer_instances_are_refused_where_megatron_would_assert(monkeypatch):
    """``--num-distributed-optimizer-instances`` (Megatron's partial distributed optimizer) is
    accepted beside ``--use-distributed-optimizer`` where it divides the data-parallel replicas
    (two at PP=2 on four ranks), refused by name otherwise, and under a schedule without a
    proof."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    distopt = ["--pipeline-schedule", "1f1b", "--use-distributed-optimizer"]
    assert arguments.parse([*BASE, *distopt, "--num-distributed-optimizer-instances",
                            "2"]).num_distributed_optimizer_instances == 2
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances 2 splits .* add "
                                         "--use-distributed-optimizer"):
        arguments.parse([*BASE, "--pipeline-schedule", "1f1b",
                         "--num-distributed-optimizer-instances", "2"])
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances 4: .* 2 data- "
                                         "and context-parallel ranks: pass a divisor"):
        arguments.parse([*BASE, *distopt, "--num-distributed-optimizer-instances", "4"])
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances .* no test"):
        arguments.parse([*BASE, "--pipeline-schedule", "1f1b-ir", "--use-distributed-optimizer",
                         "--num-distributed-optimizer-instances", "2"])
    # Overlapped, as Megatron-LM's configurations of it run: Megatron keeps no handle of a
    # started reduction then, and the document schedules' check of the buckets' starts reads
    # the grad-ready counts instead (tests/unit/test_grad_sync.py).
    overlap = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
               "--overlap-grad-reduce", "--overlap-param-gather"]
    for schedule in ("1f1b", "elastic", "seq1f1b", "sppo"):
        assert arguments.parse([*BASE, "--pipeline-schedule", schedule, *overlap]) \
            .num_distributed_optimizer_instances == 2


def test_the_attention_output_gate_is_refused_where_no_model_or_test_covers_it(monkeypatch):
    """``--attention-output-gate`` trains under the schedules its golden layouts prove; helix
    refuses it (its part memory model lacks the gate's tensors) and so does sppo's
    multiplexing (no test of the helpers' shares with it), each by name."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    gate = [*BASE, "--attention-output-gate"]
    for schedule in ("1f1b", "elastic", "seq1f1b", "sppo"):
        assert arguments.parse([*gate, "--pipeline-schedule", schedule]).attention_output_gate
    with pytest.raises(ValueError, match="--attention-output-gate is not supported by "
                                         "--pipeline-schedule helix: its memory model"):
        arguments.parse([*gate, "--pipeline-schedule", "helix"])
    with pytest.raises(ValueError, match="--sppo-multiplex with --attention-output-gate: .* "
                                         "Drop --sppo-multiplex"):
        arguments.parse([*gate, "--pipeline-schedule", "sppo", "--sppo-multiplex"])


@pytest.mark.parametrize("extra,chunk,shards", [
    (["--context-parallel-size", "2"], "3", 2),
    (["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], "6", 4)])
def test_helix_mlp_chunks_cover_whole_rows_of_every_rank_sharing_a_sequence(extra, chunk, shards,
                                                                            monkeypatch):
    """Each rank that holds a share of a sequence (context and sequence parallelism) chunks
    its share: ``--helix-mlp-chunk-size`` must divide among them, and the refusal says so."""
    monkeypatch.setenv("WORLD_SIZE", str(2 * shards))
    argv = [*BASE, "--pipeline-schedule", "helix", *extra]
    arguments.parse([*argv, "--helix-mlp-chunk-size", str(2 * shards)])
    with pytest.raises(ValueError, match=f"--helix-mlp-chunk-size {chunk} must be a multiple "
                                         f"of {shards}, the ranks that share a sequence"):
        arguments.parse([*argv, "--helix-mlp-chunk-size", chunk])


MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-ffn-hidden-size", "48"]


@pytest.mark.parametrize("parallel", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    ["--context-parallel-size", "2"]], ids=["tp2_sp", "cp2"])
@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-ir", "elastic", "seq1f1b", "helix", "sppo"])
def test_moe_layers_run_at_tensor_and_context_parallelism(parallel, schedule, monkeypatch):
    """MoE layers with tensor (sequence) or context parallelism under every schedule (golden
    layouts ``pp2_tp2_sp_moe_*``, ``pp2_ulysses2_moe_*``), with Megatron's auxiliary loss
    under 1f1b and 1f1b-ir (per micro-batch) and the project's per document under elastic and
    seq1f1b (counted over the ranks that hold parts of a document's rows)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*BASE, *MOE, *parallel, "--pipeline-schedule", schedule]
    arguments.parse(argv)
    if schedule in ("1f1b", "1f1b-ir"):
        aux = [*argv, "--moe-aux-loss-coeff", "0.01"]
        assert arguments.parse(aux).moe_aux_loss_coeff == 0.01
    elif _per_document(schedule):
        aux = [*argv, "--moe-per-document-aux-loss-coeff", "0.01"]
        assert arguments.parse(aux).moe_per_document_aux_loss_coeff == 0.01
