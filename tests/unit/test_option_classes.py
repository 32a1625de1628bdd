"""Every option of the installed megatron-core's parser (and the project's) is in exactly one
class of :mod:`megatron.plugin.option_classes`, each honoured cell's proof passes its option,
each schedule beside Megatron's declares its own cells (``gpipe``, registered from outside the
source tree, too), and the start-up refuses all at once, before anything slow, with a working
``--help``."""
import argparse
import functools
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import time

import pytest

from harness import NULL_TOKENIZER_256, REPO, TINY_MODEL, python_path
from megatron.plugin import arguments, option_classes, registry
from megatron.plugin.schedule_spec import ScheduleSpec

sys.path.insert(0, REPO)
from tests.schedules import gpipe  # noqa: E402

SCRIPT = "pretrain_gpt_elastic.py"


def _options(parser):
    return {action.dest: action.option_strings[0] for action in parser._actions
            if action.option_strings}


def test_every_option_of_the_parser_is_in_exactly_one_class():
    honoured = set(option_classes.HONOURED) | {dest for dest, _, _ in option_classes.cells()}
    classes = [option_classes.INERT, honoured, set(option_classes.REFUSED)]
    options = _options(arguments.build_parser())
    unclassified = sorted(flag for dest, flag in options.items()
                          if not any(dest in names for names in classes))
    assert not unclassified, f"options in no class: {unclassified}"
    twice = sorted(dest for dest in options if sum(dest in names for names in classes) > 1)
    assert not twice, f"options in more than one class: {twice}"


def test_every_option_that_counts_samples_is_named_as_counting_documents(monkeypatch):
    """A sample is a document here (a sequence of --seq-length tokens in Megatron-LM): the
    table names every option that counts samples, and start-up says what a sample is."""
    from megatron.plugin.document_data import sample_meaning

    options = _options(arguments.build_parser())
    counting = {dest for dest in options if dest.endswith("_samples")}
    assert counting | {"global_batch_size", "rampup_batch_size"} \
        == option_classes.COUNT_DOCUMENTS
    assert option_classes.COUNT_DOCUMENTS <= set(option_classes.classes())
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = arguments.parse([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                            "--pipeline-schedule", "sppo"])
    assert sample_meaning(args) == (
        "pretrain_gpt_elastic.py: a sample is one document (or a piece of 65 tokens of a longer "
        "one) "
        "under --pipeline-schedule sppo, not a sequence of --seq-length tokens as in "
        "Megatron-LM: --global-batch-size 12 is 12 documents per step, and --lr-decay-samples, "
        "--lr-warmup-samples, --lr-wsd-decay-samples, --rampup-batch-size, --train-samples "
        "count documents")


def test_an_option_in_no_class_is_refused_naming_it(monkeypatch):
    from megatron.training import arguments as megatron_arguments

    original = megatron_arguments.add_megatron_arguments

    def with_a_new_option(parser):
        parser = original(parser)
        parser.add_argument("--option-of-a-new-release", type=int, default=0)
        return parser

    monkeypatch.setattr(megatron_arguments, "add_megatron_arguments", with_a_new_option)
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]
    arguments.check_command_line(argv)  # not given: nothing to refuse
    with pytest.raises(ValueError, match="--option-of-a-new-release is not classified"):
        arguments.check_command_line([*argv, "--option-of-a-new-release", "3"])


def _golden_module():
    path = os.path.join(REPO, "tests", "distributed", "test_golden_megatron.py")
    spec = importlib.util.spec_from_file_location("golden_layouts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def _golden_argv():
    """tag -> the golden run's command line (the tiny model, the variant's flags, the
    layout's)."""
    return {tag: [*TINY_MODEL, *model_flags, *flags]
            for model_flags, layouts in _golden_module().VARIANTS.values()
            for tag, (_, flags) in layouts.items()}


def _test_source(proof):
    path, _, name = proof.partition("::")
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    if name:
        assert f"def {name}(" in text, f"{proof}: no such test"
    return text


#: Every honoured cell of the registered schedules, and those ``gpipe`` declares (the tests
#: register it from outside the source tree).
CELLS = [*option_classes.cells(),
         *((dest, gpipe.SPEC.name, proof) for dest, proof in sorted(gpipe.SPEC.proofs.items()))]


@functools.lru_cache(maxsize=1)
def _golden_parser():
    """The parser with the golden worker's own flag that the layouts use."""
    parser = arguments.build_parser()
    parser.add_argument("--golden-docs")
    parser.add_argument("--golden-eod-every")
    parser.add_argument("--golden-aux-loss-coeff")
    parser.add_argument("--golden-keyed-dropout", action="store_true")
    return parser


def _mutation_check():
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import mutation_check

    return mutation_check


def _no_effect_values() -> dict:
    """The options whose no-effect value is not their default (``scripts/mutation_check.py``)."""
    return _mutation_check().NO_EFFECT


@pytest.mark.parametrize("dest,schedule,proof", CELLS)
def test_each_honoured_cell_names_a_test_that_passes_the_option(dest, schedule, proof):
    parser = _golden_parser()
    flag = _options(parser)[dest]
    if not proof.startswith("golden:"):
        assert flag in _test_source(proof), f"{proof} does not pass {flag}"
        return
    tag = proof.removeprefix("golden:")
    argv = _golden_argv()[tag]
    args, given = arguments.given_options(parser, argv)
    off = _no_effect_values()
    # Megatron's default may be the value that changes the numbers (dropout 0.1, no effect at 0).
    assert dest in given or (dest in off and off[dest] != parser.get_default(dest)), \
        f"{tag} does not pass {flag} with a value other than its default"
    assert dest not in off or getattr(args, dest) != off[dest], \
        f"{tag} runs {flag} at {off[dest]!r}, where it has no effect: a proof must run it at " \
        f"a value that changes the numbers"
    ran = argv[argv.index("--pipeline-schedule") + 1]
    if schedule == "default":
        assert ran in ("1f1b", "interleaved"), tag
    elif schedule != "*":
        assert ran == schedule, (tag, ran)


def test_no_golden_proof_runs_its_option_where_the_mutation_check_finds_no_effect():
    """The mutation check's static verdict over every cell (``NOT CAUGHT (no-effect value)``,
    found without running anything): a golden layout that runs its option at the value the
    check would reset it to cannot fail without the option's meaning. The offenders are listed
    together."""
    check = _mutation_check()
    offenders = sorted(f"{dest}:{schedule} {proof} (at {check.no_effect_value(dest)!r})"
                       for dest, schedule, proof in CELLS
                       if check.runs_at_no_effect(dest, proof))
    assert not offenders, "golden proofs run at their option's no-effect value: " \
        + "; ".join(offenders)


@pytest.mark.parametrize("schedule,proof",
                         sorted(option_classes.proving(option_classes.SPLIT_EXPERTS).items()))
def test_experts_split_over_their_own_tensor_parallel_size_name_a_layout_that_does(schedule,
                                                                                   proof):
    """The layouts that prove experts split over another tensor-parallel size than the other
    layers (``arguments.RULES`` takes it where one is named) have MoE layers, pass that size and
    run the schedule named."""
    argv = _golden_argv()[proof.removeprefix("golden:")]
    args, given = arguments.given_options(_golden_parser(), argv)
    assert {"num_experts", "expert_tensor_parallel_size"} <= set(given)
    assert args.expert_tensor_parallel_size != args.tensor_model_parallel_size
    ran = argv[argv.index("--pipeline-schedule") + 1]
    assert ran == ("1f1b" if schedule == "default" else schedule), (schedule, ran)


def test_a_one_item_list_of_the_default_is_the_default():
    """Megatron-LM's several-valued options mean their single default by a list of it alone
    (``--moe-router-load-balancing-type aux_loss``, given by Megatron-LM's MoE configs, is
    Megatron's default): not given, so not refused; another value still is."""
    parser = arguments.build_parser()
    for values, expected in ((["aux_loss"], False), (["seq_aux_loss"], True),
                             (["aux_loss", "seq_aux_loss"], True)):
        _, given = arguments.given_options(
            parser, ["--moe-router-load-balancing-type", *values])
        assert ("moe_router_load_balancing_type" in given) is expected, values
    _, given = arguments.given_options(parser, ["--moe-aux-loss-coeff", "0"])
    assert "moe_aux_loss_coeff" not in given


def test_only_defaults_are_honoured_without_a_proof():
    parser = arguments.build_parser()
    for dest, honoured in option_classes.HONOURED.items():
        if not option_classes.proving(dest):
            default = arguments.DEFAULTS.get(dest, parser.get_default(dest))
            assert honoured.values == (default,), dest


@pytest.mark.parametrize("schedule", ["elastic", "seq1f1b"])
def test_planner_flags_reach_the_planner(schedule, monkeypatch):
    """``--elastic-solver-time-limit`` is the solver's limit per candidate pipeline, and
    ``--elastic-reserved-gb`` the part of ``--elastic-memory-gb`` never planned for: with 8 of
    26 MB reserved, the plan training runs (its cost model as ``elastic_pipe.run_costs`` builds
    it) cuts a 4000-token document so that what it holds fits the other 18 MB, where the
    whole budget keeps the document whole and holds more than 18 MB."""
    from elastic_pipe.flags import scheduler_config
    from elastic_pipe.planning import plan_schedule
    from longctx.cost_model import GB
    from longctx.job_costs import cost_model_from_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    lengths, budget, reserved = (4000, 100, 50), 0.026, 0.008

    def planned(*flags):
        args = arguments.parse([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                                "--pipeline-schedule", schedule, "--elastic-min-slice-tokens",
                                "256", "--elastic-memory-gb", str(budget), *flags])
        cost = cost_model_from_args(args, 256, args.elastic_memory_gb, args.elastic_reserved_gb)
        plan = plan_schedule(lengths, schedule, cost.model, cost.hardware, cost.parallel,
                             scheduler_config(args))
        held = max(plan.peak_memory_bytes) - cost.parallel.reserved_gb * GB
        return args, plan, held

    args, plan, held = planned("--elastic-solver-time-limit", "0.5",
                               "--elastic-reserved-gb", str(reserved))
    assert scheduler_config(args).solver_time_limit == 0.5
    # Megatron's micro-batches, the planners' candidate for documents that fit (#26)
    chunking = scheduler_config(args).chunking
    assert (chunking.seq_length, chunking.micro_batch_size) == \
        (args.seq_length, args.micro_batch_size)
    _, whole, whole_held = planned("--elastic-reserved-gb", "0")
    assert whole_held > (budget - reserved) * GB >= held
    assert max(p.num_slices for p in plan.pipelines) > max(p.num_slices for p in whole.pipelines)


def test_log_throughput_needs_megatrons_lengths(monkeypatch):
    """--log-throughput is honoured where megatron-core counts FLOPs over recorded sequence
    lengths (0.19, tests/e2e/test_flop_count.py), refused by name where it cannot (0.17)."""
    from megatron.plugin import flop_count

    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
            "--log-throughput"]
    refusal = "--log-throughput: this megatron-core release counts FLOPs as if every sample"
    if flop_count.counts_real_lengths():
        arguments.check_command_line(argv)
        monkeypatch.setattr(flop_count, "_recorder", lambda: None)
    with pytest.raises(ValueError, match=refusal):
        arguments.check_command_line(argv)


def _run(*argv, env=None, timeout=120):
    start = time.monotonic()
    result = subprocess.run([sys.executable, SCRIPT, *argv], cwd=REPO, capture_output=True,
                            text=True, timeout=timeout,
                            env=dict(os.environ, PYTHONPATH=python_path(), WORLD_SIZE="2",
                                     **(env or {})))
    return result, time.monotonic() - start


def test_every_refusal_comes_in_one_start_up_without_a_traceback(tmp_path):
    """Three refused options for three reasons, a schedule's own flag under another schedule
    and a missing flag: one exit 2 naming them all."""
    result, _ = _run(*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--eval-interval", "1",
                     "--pipeline-schedule", "elastic", "--multi-latent-attention", "--qk-l2-norm",
                     "--grad-reduce-in-bf16", "--sppo-offload", "1",
                     "--calculate-per-token-loss")
    assert result.returncode == 2, result.stderr[-3000:]
    for named in ("--multi-latent-attention is not supported", "--qk-l2-norm is not supported",
                  "--grad-reduce-in-bf16 is not supported by --pipeline-schedule elastic",
                  "--sppo-offload is a flag of --pipeline-schedule sppo"):
        assert named in result.stderr, (named, result.stderr[-3000:])
    assert "Traceback" not in result.stderr


def test_flags_refused_for_one_reason_are_named_together():
    messages = option_classes.refusals(
        {"moe_expert_capacity_factor": ("--moe-expert-capacity-factor", 1.0),
         "moe_pad_expert_input_to_capacity": ("--moe-pad-expert-input-to-capacity", True)},
        "1f1b")
    assert len(messages) == 1 and ("--moe-expert-capacity-factor, "
                                   "--moe-pad-expert-input-to-capacity are not supported"
                                   in messages[0]), messages


def test_the_flags_megatron_accepts_only_beside_a_refused_one_are_named_with_it(monkeypatch):
    """Following a refusal leads into no further refusal: a refused option's dependents
    (options Megatron-LM accepts only beside it) are named beside it (here: with a class whose
    refusal of ``cuda_graph_impl`` alone would leave --rl-training-cuda-graphs), and followed
    through (dropping the distributed optimizer would leave --overlap-param-gather and its
    optimizer-step variant)."""
    parser = arguments.build_parser()
    dests = set(_options(parser))
    assert all(dest in dests and {n[0] if isinstance(n, tuple) else n for n in needers} <= dests
               for dest, needers in option_classes.NEEDED_BY.items())
    given = {"cuda_graph_impl": ("--cuda-graph-impl", "local"),
             "rl_training_cuda_graphs": ("--rl-training-cuda-graphs", True)}
    monkeypatch.setattr(option_classes, "REFUSED",
                        {"cuda_graph_impl": "graphs are not run here; drop the flag"})
    monkeypatch.setattr(option_classes, "INERT",
                        option_classes.INERT | {"rl_training_cuda_graphs"})
    messages = option_classes.refusals(given, "1f1b")
    assert messages[-1] == ("--rl-training-cuda-graphs is accepted by Megatron-LM only beside a "
                            "flag refused above: drop --rl-training-cuda-graphs with it")
    assert option_classes.companions(
        {"overlap_param_gather": ("--overlap-param-gather", True),
         "overlap_param_gather_with_optimizer_step": ("--overlap-param-gather-with-optimizer-step",
                                                      True)},
        ["use_distributed_optimizer"]) == ["--overlap-param-gather",
                                           "--overlap-param-gather-with-optimizer-step"]
    fsdp = {"use_megatron_fsdp": ("--use-megatron-fsdp", True)}
    assert option_classes.companions(
        {**fsdp, "ckpt_format": ("--ckpt-format", "fsdp_dtensor")},
        ["use_megatron_fsdp"]) == ["--ckpt-format fsdp_dtensor"]
    assert option_classes.companions({**fsdp, "ckpt_format": ("--ckpt-format", "torch")},
                                     ["use_megatron_fsdp"]) == []


def test_a_missing_flag_is_named_beside_the_refused_ones(monkeypatch):
    # Ulysses splits the heads: one query group cannot be split over two ranks.
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as refused:
        arguments.check_command_line([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                                      "--context-parallel-size", "2", "--group-query-attention",
                                      "--num-query-groups", "1", "--pipeline-schedule",
                                      "1f1b-ir", "--multi-latent-attention"],
                                     training=True)
    text = str(refused.value)
    for named in ("choose a degree that divides them", "--multi-latent-attention is not supported",
                  "--eval-interval is not set"):
        assert named in text, text


def test_every_required_megatron_flag_missing_is_named_in_one_start_up(monkeypatch):
    """Megatron-LM's validation asserts its required flags one at a time (six launches to learn
    them); the start-up check names every one missing at once, beside the other refusals."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [*NULL_TOKENIZER_256, "--calculate-per-token-loss", "--eval-interval", "1",
            "--pipeline-schedule", "elastic", "--qk-l2-norm"]
    with pytest.raises(ValueError) as refused:
        arguments.check_command_line(argv, training=True)
    text = str(refused.value)
    assert ("Megatron-LM needs --micro-batch-size, --num-layers, --hidden-size, "
            "--num-attention-heads, --seq-length, --max-position-embeddings and --train-iters N "
            "(or --train-samples N), not given: pass each") in text, text
    assert "--qk-l2-norm is not supported" in text, text
    # Tools that do not train need no training length; --use-checkpoint-args takes the shape
    # from the checkpoint.
    with pytest.raises(ValueError, match=r"Megatron-LM needs --micro-batch-size, not given: "
                                         r"pass it$"):
        arguments.check_command_line([*NULL_TOKENIZER_256, "--calculate-per-token-loss",
                                      "--use-checkpoint-args", "--load", "ckpt"])
    assert arguments.missing_flags(arguments.check_command_line(TINY_MODEL), True) == []


_LENGTH = TINY_MODEL.index("--train-iters")
#: The tiny model's flags without its training length.
_WITHOUT_LENGTH = TINY_MODEL[:_LENGTH] + TINY_MODEL[_LENGTH + 2:]


@pytest.mark.parametrize("flags,named", [
    (["--train-iters", "3", "--lr-warmup-iters", "3"],
     "warms up over 3 iterations (--lr-warmup-iters) but decays over 3"),
    (["--train-iters", "10", "--lr-decay-iters", "4", "--lr-warmup-iters", "5"],
     "lower --lr-warmup-iters or raise --lr-decay-iters"),
    (["--train-iters", "10", "--lr-warmup-fraction", "1.0"],
     "warms up over 10 iterations (--lr-warmup-fraction)"),
    (["--train-samples", "64", "--lr-warmup-samples", "80"],
     "warms up over 80 samples (--lr-warmup-samples) but decays over 64"),
    (["--train-iters", "10", "--min-lr", "1"], "lower --min-lr"),
    (["--train-iters", "10", "--lr-warmup-init", "1"], "lower --lr-warmup-init"),
])
def test_a_learning_rate_schedule_megatron_would_assert_on_is_refused_at_start_up(flags, named):
    """Megatron-LM's scheduler asserts these only once the model is built; here they are
    named at start-up with what to change."""
    argv = [*_WITHOUT_LENGTH, "--eval-interval", "1000", *flags]
    with pytest.raises(ValueError, match=re.escape(named)):
        arguments.check_command_line(argv, training=True)


def test_a_learning_rate_schedule_that_warms_up_before_it_decays_starts():
    argv = [*_WITHOUT_LENGTH, "--eval-interval", "1000", "--train-iters", "10",
            "--lr-warmup-iters", "9", "--min-lr", "1e-5"]
    assert arguments.check_command_line(argv, training=True).lr_warmup_iters == 9


def test_an_unknown_schedule_is_refused_before_tokenizers_and_the_network(tmp_path):
    """No tokenizer flags: Megatron-LM's default GPT-2 tokenizer would download its vocabulary
    (and fail offline) before the schedule name was looked at. Nothing is downloaded; where
    Megatron's download could not run (no ``wget`` package, an empty cache) the start-up names
    --tokenizer-type beside the schedule."""
    result, seconds = _run("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                           "4", "--seq-length", "64", "--max-position-embeddings", "64",
                           "--micro-batch-size", "1", "--global-batch-size", "2",
                           "--train-iters", "1", "--lr", "1e-3", "--pipeline-schedule", "zigzag",
                           env={"HF_HUB_OFFLINE": "1", "http_proxy": "http://127.0.0.1:9",
                                "https_proxy": "http://127.0.0.1:9",
                                "TORCH_HOME": str(tmp_path / "torch-home")})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "unknown pipeline schedule 'zigzag'" in result.stderr
    assert "wget library" not in result.stderr and "Downloading" not in result.stderr
    if importlib.util.find_spec("wget") is None:
        assert "no --tokenizer-type (Megatron-LM's default for GPT is GPT2BPETokenizer)" \
            in result.stderr
    assert "Traceback" not in result.stderr
    assert seconds < 60, seconds


def test_help_prints_with_the_projects_group():
    result, _ = _run("--help")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "long-context pipeline schedules:" in result.stdout
    assert "--pipeline-schedule" in result.stdout
    assert "--moe-router-topk" in result.stdout  # Megatron-LM's own options too


def test_the_core_names_only_megatrons_schedules():
    """The core's table proves options under Megatron's own schedules and every schedule;
    the others declare theirs in their ``ScheduleSpec``."""
    megatron = {name for name in registry.schedule_names() if registry.is_megatron(name)}
    assert megatron == {"default", "1f1b", "interleaved"}
    named = {schedule for honoured in option_classes.HONOURED.values()
             for schedule in honoured.proofs} | set(option_classes.EXPERT_TP)
    assert named <= megatron | {"*"}, named - megatron
    assert inspect.isfunction(option_classes.refusals)


def _own_flags(spec: ScheduleSpec) -> set:
    parser = argparse.ArgumentParser()
    for add in spec.argument_groups:
        add(parser)
    return {action.dest for action in parser._actions}


@pytest.mark.parametrize("spec", [*registry.specs(), gpipe.SPEC], ids=lambda spec: spec.name)
def test_a_schedules_table_names_options_it_can_honour(spec):
    """A schedule's table names options of the parser that are neither inert nor refused
    everywhere nor proved for every schedule; what only schedules' tables name is a flag of
    its own (refused elsewhere as doing nothing there). Its refusals may also give its own
    reason for an option refused everywhere (what to pass instead under it)."""
    dests = set(_options(arguments.build_parser())) | {option_classes.SPLIT_EXPERTS}
    for dest in (*spec.proofs, *spec.refusals):
        assert dest in dests, (spec.name, dest)
        assert dest not in option_classes.INERT, dest
        assert dest not in option_classes.REFUSED or dest not in spec.proofs, dest
        assert "*" not in getattr(option_classes.HONOURED.get(dest), "proofs", {}), dest
    own = set(spec.proofs) - set(option_classes.HONOURED) - {option_classes.SPLIT_EXPERTS}
    assert own <= _own_flags(spec), (spec.name, own - _own_flags(spec))


def test_a_schedule_registered_from_outside_honours_what_its_spec_declares(monkeypatch):
    """No edit of the core: a schedule's ``proofs`` and ``refusals`` are read once it is
    registered; what it does not name is refused (with the core's reason, or its own), and
    its own flag is refused under the other schedules as doing nothing there."""
    def given(dest, flag, value=4):
        return {dest: (flag, value)}

    spec = ScheduleSpec("outside", run=lambda call: [],
                        proofs={"num_layers": "golden:pp2_gpipe_outside",
                                "outside_knob": "golden:pp2_gpipe_outside"},
                        refusals={"hidden_size": "outside keeps its own width: drop {flag}"})
    with pytest.raises(ValueError, match="unknown pipeline schedule 'outside'"):
        option_classes.proof("num_layers", "outside")
    assert option_classes.classes().get("outside_knob") is None
    monkeypatch.setitem(registry._SPECS, spec.name, spec)
    assert option_classes.proof("num_layers", "outside") == "golden:pp2_gpipe_outside"
    assert option_classes.refusals(given("num_layers", "--num-layers"), "outside") == []
    assert option_classes.refusals(given("hidden_size", "--hidden-size"), "outside") == [
        "outside keeps its own width: drop --hidden-size"]
    assert option_classes.refusals(given("seq_length", "--seq-length"), "outside") == [
        "--seq-length is not supported by --pipeline-schedule outside: no test proves it under "
        "this schedule yet: drop it, or use a schedule that has one"]
    assert option_classes.classes()["outside_knob"] == "honoured"
    assert option_classes.refusals(given("outside_knob", "--outside-knob"), "1f1b") == [
        "--outside-knob is a flag of --pipeline-schedule outside and would do nothing under "
        "--pipeline-schedule 1f1b: drop it"]


def test_the_distributed_optimizer_runs_without_cuda_and_half_precision_does_not(monkeypatch):
    """On a machine without CUDA the distributed optimizer and its overlaps are accepted (fp32:
    the CPU compatibility layer lets megatron-core build its shards of CPU tensors), under
    Megatron's 1F1B and a document schedule; --bf16 is refused as needing CUDA."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    distopt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    for schedule in ("1f1b", "elastic"):
        arguments.check_command_line([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", schedule, *distopt])
    with pytest.raises(arguments.Refusals, match="--bf16 and --fp16 need CUDA"):
        arguments.check_command_line([*TINY_MODEL, "--pipeline-model-parallel-size", "2",
                                      "--pipeline-schedule", "1f1b", *distopt, "--bf16"])


def test_cudas_memory_reports_are_refused_without_cuda_naming_each(monkeypatch):
    """Megatron-LM's allocator reports fail without CUDA (an empty ``memory_stats()`` at the
    first log line, no driver for the snapshot): refused together at start-up there, accepted
    where CUDA is."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    reports = ["--log-memory-to-tensorboard", "--record-memory-history",
               "--log-device-memory-used"]
    argv = [*TINY_MODEL, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b",
            "--tensorboard-dir", "tb", *reports]
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(arguments.Refusals, match=re.escape(
            ", ".join(reports) + " read CUDA's memory allocator")):
        arguments.check_command_line(argv)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert arguments._cpu_memory_reports(arguments.parse(argv)) is None
