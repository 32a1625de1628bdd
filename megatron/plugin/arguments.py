"""Flags of ``pretrain_gpt_elastic.py``: Megatron-LM's own parser, plus the project's group.

Megatron-LM parses and validates every one of its flags (``megatron.training.arguments``);
:func:`add_arguments` is the extra-args hook that adds ``--pipeline-schedule``, the runtime's
flags and each registered schedule's group. Before Megatron-LM's validation,
:func:`check_command_line` refuses, all at once and by name with what to use instead, the flags
Megatron-LM requires and lacks (:func:`missing_flags`; its validation names one per launch),
every option given that :mod:`megatron.plugin.option_classes` refuses, does not prove under the
selected schedule, or does not classify, and every rule of :data:`RULES` (checks across options:
a missing ``--calculate-per-token-loss``, ``--ddp-average-in-collective`` beside it, distributed
optimizer instances that do not divide the replicas or that overlap their reduction under the
project's schedules, Ulysses' head divisibility, the schedule's own ``check_args``, what needs
CUDA, the flash attention backend in fp32, Transformer Engine without CUDA or its package,
``--tensorboard-dir`` without ``tensorboard``, the folders of
``--metrics-jsonl`` and ``--trace-dir``, made here or refused when they cannot be written);
:func:`check_args` runs the rules again on the validated arguments, and
:func:`substitution_lines` says what runs where an accepted value names something else
(:mod:`megatron.plugin.substitutions`).

Defaults that differ from Megatron-LM's, and why:

* ``--transformer-impl local``: the layer spec is Megatron's local spec with the project's
  document attention in place of core attention (``megatron/plugin/layers/attention.py``);
  ``transformer_engine`` builds Megatron's Transformer Engine layers with the same attention
  (``megatron/plugin/layers/te_layers.py``) where CUDA and the package are present.
* ``--dataloader-type external``: batches are whole documents, one global batch per step, from
  :mod:`megatron.plugin.document_data`; ``single`` and ``cyclic`` are Megatron's per-sample
  loaders and are refused.
* ``--reset-position-ids --reset-attention-mask`` are always in force: positions restart at
  every document and no token attends across a document boundary.
* Without CUDA: ``--distributed-backend gloo``, ``--use-cpu-initialization``, and Megatron's
  fused CUDA kernels off (they change speed, not results).
* Megatron's fused weight-gradient accumulation (``--gradient-accumulation-fusion``, on by
  default) is off without apex's CUDA extension, with ``--overlap-grad-reduce``, and where the
  schedule computes with borrowed copies of weights (``ScheduleSpec.borrows_weights``: sppo's
  ``--sppo-multiplex``; :func:`megatron.plugin.model.model_config` says why): the same
  gradients, unfused.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from typing import Sequence

import torch

from megatron.plugin import (cpu_compat, flop_count, option_classes, registry, shared_gpu,
                             substitutions, tokenizer_needs)

#: ``args_defaults`` for Megatron's parser (applied where a flag was not given).
DEFAULTS = {"tokenizer_type": tokenizer_needs.DEFAULT_TOKENIZER, "dataloader_type": "external"}

_CPU_DEFAULTS = dict(distributed_backend="gloo", use_cpu_initialization=True,
                     gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                     bias_gelu_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)

def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the project's flags and the schedules' groups."""
    g = parser.add_argument_group("long-context pipeline schedules")
    g.add_argument("--pipeline-schedule", default=registry.DEFAULT,
                   help="default (Megatron's own choice), or a registered schedule: "
                        + ", ".join(registry.schedule_names()[1:]))
    g.add_argument("--pipeline-timeout-s", type=float, default=600.0,
                   help="IR schedules: seconds a pipeline transfer may wait before failing "
                        "with the rank, action and peer named")
    g.add_argument("--metrics-jsonl", default=None,
                   help="write one JSON object per iteration to this file (last rank)")
    g.add_argument("--trace-dir", default=None,
                   help="write Chrome-trace JSON of the executor's actions per rank")
    g.add_argument("--moe-per-document-aux-loss-coeff", type=float, default=0.0,
                   help="elastic and seq1f1b with --num-experts: coefficient of a "
                        "load-balancing loss of this project's, not Megatron's: the Switch "
                        "formula of Megatron's aux_loss over each document's own tokens "
                        "(megatron/plugin/layers/document_router.py), where Megatron's "
                        "--moe-aux-loss-coeff takes it over each micro-batch's packed rows, "
                        "which these schedules do not run (0: off)")
    added = set()
    for spec in registry.specs():
        for add in spec.argument_groups:
            if add not in added:  # schedules may share a group
                added.add(add)
                add(parser)
    parser.set_defaults(transformer_impl="local", reset_position_ids=True,
                        reset_attention_mask=True)
    if not torch.cuda.is_available():
        parser.set_defaults(**_CPU_DEFAULTS)
    elif importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        # The local layers fuse weight-gradient accumulation with apex's CUDA extension only;
        # without it Megatron-LM's default (on) stops at model construction. Off computes the
        # same gradients unfused.
        parser.set_defaults(gradient_accumulation_fusion=False)
    for action in parser._actions:
        # argparse formats help strings with %: a stray one in Megatron-LM's own (0.19's
        # --moe-paged-stash-buffer-size-factor-cuda) stops --help.
        if action.help and "%" in action.help and not _formats(action.help):
            action.help = action.help.replace("%", "%%")
    return parser


def _formats(text: str) -> bool:
    """Whether ``text`` is a valid argparse help format (its ``%`` escaped or ``%(name)s``)."""
    try:
        text % {"default": None, "prog": "", "dest": "", "type": None, "choices": None,
                "metavar": None, "required": False, "help": "", "option_strings": [],
                "nargs": None, "const": None, "deprecated": False}
    except (KeyError, ValueError, TypeError):
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    """The parser Megatron-LM's ``parse_args`` builds, with the project's flags."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    return add_arguments(add_megatron_arguments(parser))


def given_options(parser: argparse.ArgumentParser, argv: Sequence[str]):
    """``(namespace, given)``: ``argv`` parsed, and ``dest -> (flag, value)`` of each option
    it sets to a value other than its default. A one-item list is its item: Megatron-LM's
    options that take several values (``nargs='+'``: ``--moe-router-load-balancing-type
    aux_loss``, ``--moe-aux-loss-coeff``, ``--cp-comm-type``) have a single value as their
    default and mean that value by a list of it alone (``validate_args`` unpacks some of them).
    argparse exits 2 on a malformed command line (unknown flag, bad value) as it does inside
    Megatron-LM's parser."""
    namespace = parser.parse_args(argv)
    saved = parser._defaults, [(action, action.default) for action in parser._actions]
    parser._defaults = {}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        named = vars(parser.parse_args(argv))
    finally:
        parser._defaults = saved[0]
        for action, default in saved[1]:
            action.default = default
    flags = {}
    for action in parser._actions:
        if action.dest in named and action.option_strings:
            flags.setdefault(action.dest, action.option_strings[0])
    defaults = {action.dest: parser.get_default(action.dest) for action in parser._actions}
    given = {dest: (flags[dest], getattr(namespace, dest)) for dest in named
             if dest in flags and _single(getattr(namespace, dest)) != defaults.get(dest)}
    return namespace, given


def _single(value):
    """A one-item list's item; any other value itself."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


class Refusals(ValueError):
    """Every refusal of one command line, one per line."""

    def __init__(self, messages: Sequence[str]):
        self.messages = list(dict.fromkeys(messages))
        super().__init__("\n".join(self.messages) if len(self.messages) == 1 else
                         f"{len(self.messages)} settings to change:\n- "
                         + "\n- ".join(self.messages))


def check_command_line(argv: Sequence[str], training: bool = False,
                       extra_args_provider=None) -> argparse.Namespace:
    """Refuse, all at once and before anything slow (Megatron-LM's validation, tokenizers,
    process groups), what ``argv`` asks that this script would not honour: an unknown
    ``--pipeline-schedule``, every option given that :mod:`megatron.plugin.option_classes`
    refuses or does not classify, Megatron-LM's required flags not given
    (:func:`missing_flags`), and the rules of :data:`RULES` (``training``: also what
    Megatron-LM's training loop needs). ``--help`` prints and exits here. The flags of
    ``extra_args_provider`` (a tool's or test's own) are its business. Returns the parsed flags
    (Megatron-LM's validation has not run on them)."""
    parser = build_parser()
    known = {action.dest for action in parser._actions}
    if extra_args_provider is not None:
        parser = extra_args_provider(parser) or parser
    args, given = given_options(parser, argv)
    given = {dest: value for dest, value in given.items() if dest in known}
    messages = missing_flags(args, training)
    try:
        registry.check_name(args.pipeline_schedule)
    except ValueError as err:
        messages.append(str(err))
    else:
        messages += option_classes.refusals(given, args.pipeline_schedule)
        messages += rule_refusals(args)
    if training:
        messages += training_refusals(args)
    if messages:
        raise Refusals(messages)
    return args


#: What Megatron-LM's ``validate_args`` asserts is given, one assertion per launch: the
#: micro-batch and the model's shape (``--use-checkpoint-args`` takes the shape from ``--load``'s
#: checkpoint). ``dest -> flag``.
_REQUIRED_BATCH = {"micro_batch_size": "--micro-batch-size"}
_REQUIRED_SHAPE = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
                   "num_attention_heads": "--num-attention-heads",
                   "seq_length": "--seq-length",
                   "max_position_embeddings": "--max-position-embeddings"}


def missing_flags(args: argparse.Namespace, training: bool = False) -> list[str]:
    """Megatron-LM's required flags that ``args`` lacks, named together in one message (none:
    an empty list): :data:`_REQUIRED_BATCH` and :data:`_REQUIRED_SHAPE`, and with ``training``
    the training length (``--train-iters`` or ``--train-samples``, unless ``--skip-train``:
    Megatron-LM's loop multiplies by it)."""
    required = dict(_REQUIRED_BATCH)
    if not args.use_checkpoint_args:
        required.update(_REQUIRED_SHAPE)
    missing = [flag for dest, flag in required.items() if getattr(args, dest) is None]
    if training and not args.skip_train and args.train_iters is None and \
            args.train_samples is None:
        missing.append("--train-iters N (or --train-samples N)")
    if not missing:
        return []
    shown = missing[0] if len(missing) == 1 else \
        f"{', '.join(missing[:-1])} and {missing[-1]}"
    return [f"Megatron-LM needs {shown}, not given: pass "
            f"{'it' if len(missing) == 1 else 'each'}"]


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's parsing and validation of ``argv`` with the project's flags, then
    :func:`check_args`; no process group or global state is touched (tools and tests).
    Megatron reads the world size from ``WORLD_SIZE``; without CUDA the CPU layer is
    installed first (validation queries the device for tensor and context parallelism)."""
    from megatron.training.arguments import parse_args, validate_args

    if not torch.cuda.is_available():
        cpu_compat.install()

    check_command_line(argv)
    with command_line(argv):
        args = parse_args(add_arguments)
    validate_args(args, DEFAULTS)
    check_args(args)
    return args


@contextlib.contextmanager
def command_line(argv: Sequence[str]):
    """Megatron's parser reads ``sys.argv``: ``argv`` is the command line for the duration."""
    saved = sys.argv
    sys.argv = [saved[0], *argv]
    try:
        yield
    finally:
        sys.argv = saved


def megatron_defaults() -> dict:
    """Every flag's default as Megatron-LM's parser has it: ``dest -> (flag, default)``."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return {a.dest: (a.option_strings[0], a.default) for a in parser._actions
            if a.option_strings}


def training_refusals(args: argparse.Namespace) -> list[str]:
    """What Megatron-LM's training loop needs beyond its validation (the training script):
    ``--eval-interval``, a learning-rate schedule its scheduler takes, and a tokenizer whose
    files and package this machine has (:mod:`megatron.plugin.tokenizer_needs`)."""
    messages = [message] if (message := tokenizer_needs.refusal(args)) else []
    if args.eval_interval is None:
        messages.append("--eval-interval is not set (megatron-core 0.18 and later have no "
                        "default and Megatron-LM's loop divides by it): pass --eval-interval N, "
                        "with --eval-iters 0 to skip evaluation")
    return messages + _learning_rate_schedule(args)


def _learning_rate_schedule(args: argparse.Namespace) -> list[str]:
    """What Megatron-LM's learning-rate scheduler asserts when the model and optimizer are
    built (``OptimizerParamScheduler``, after the checkpoint and the data are set up), said at
    start-up: the warm-up ends before the decay does, and the rates are ordered."""
    messages = []
    if args.train_samples is None:
        unit, decay_flag, warmup_flag = "iterations", "--lr-decay-iters", "--lr-warmup-iters"
        decay, warmup = args.lr_decay_iters or args.train_iters, args.lr_warmup_iters
    else:
        unit, decay_flag, warmup_flag = "samples", "--lr-decay-samples", "--lr-warmup-samples"
        decay, warmup = args.lr_decay_samples or args.train_samples, args.lr_warmup_samples
    given = warmup_flag
    if args.lr_warmup_fraction is not None:
        warmup, given = args.lr_warmup_fraction * (decay or 0), "--lr-warmup-fraction"
    if decay is not None and warmup is not None and warmup >= decay:
        messages.append(f"the learning rate warms up over {warmup:g} {unit} ({given}) but "
                        f"decays over {decay:g} ({decay_flag}, else the training length): "
                        f"Megatron-LM's scheduler needs the warm-up shorter; lower {given} or "
                        f"raise {decay_flag}")
    if args.lr is not None and args.min_lr is not None and args.min_lr > args.lr:
        messages.append(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: Megatron-LM's "
                        "scheduler decays from --lr down to --min-lr; lower --min-lr")
    if args.lr is not None and args.lr_warmup_init > args.lr:
        messages.append(f"--lr-warmup-init {args.lr_warmup_init:g} is above --lr {args.lr:g}: "
                        "the warm-up rises to --lr; lower --lr-warmup-init")
    return messages


def check_training_args(args: argparse.Namespace) -> None:
    """Raise :class:`Refusals` with :func:`training_refusals`, if any."""
    messages = training_refusals(args)
    if messages:
        raise Refusals(messages)


def _pipeline_timeout(args):
    return "--pipeline-timeout-s must be > 0 seconds" if args.pipeline_timeout_s <= 0 else None


def _ulysses_heads(args):
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp <= 1:
        return None
    heads = args.num_attention_heads // tp
    groups = ((args.num_query_groups or args.num_attention_heads) if args.group_query_attention
              else args.num_attention_heads) // tp
    if heads % cp or groups % cp:
        return (f"Ulysses sequence parallelism splits the attention heads: {heads} heads and "
                f"{groups} query groups per tensor-parallel rank are not divisible by "
                f"--context-parallel-size {cp}; choose a degree that divides them")
    if args.seq_length % (cp * tp):
        return (f"--seq-length {args.seq_length} must be divisible by --context-parallel-size x "
                f"--tensor-model-parallel-size ({cp} x {tp})")
    return None


def _moe_expert_biases(args):
    if args.num_experts and args.add_bias_linear:
        return ("--num-experts with biased linear layers: megatron-core's local experts add "
                "their output bias in place to a tensor that autograd does not let change, and "
                "the first step fails: add --disable-bias-linear (as Megatron-LM's MoE "
                "configurations do)")
    return None


def _moe_expert_tensor_parallel(args):
    expert_tp = getattr(args, "expert_tensor_parallel_size", None)
    if not args.num_experts or expert_tp is None \
            or expert_tp == args.tensor_model_parallel_size:
        return None
    flag = "--expert-tensor-parallel-size"
    release = cpu_compat.megatron_core_version()
    if release.startswith("0.17."):
        return (f"{flag} {expert_tp} with --num-experts on megatron-core {release}: its golden "
                "layouts pass on megatron-core 0.19 and fail on this release (each rank keeps "
                f"whole experts): install megatron-core 0.19, or drop {flag} (the experts then "
                f"take --tensor-model-parallel-size {args.tensor_model_parallel_size})")
    schedule = args.pipeline_schedule
    if schedule == "default" and (args.num_layers_per_virtual_pipeline_stage
                                  or args.num_virtual_stages_per_pipeline_rank):
        schedule = "interleaved"  # what Megatron runs with virtual stages
    if option_classes.proof(option_classes.SPLIT_EXPERTS, schedule) is not None:
        return None
    own = option_classes.schedule_refusal("expert_model_parallel_size", schedule, flag)
    if own is not None:
        return own
    return (f"{flag} {expert_tp} with --num-experts is not supported by --pipeline-schedule "
            f"{schedule}: no test proves experts split over another tensor-parallel size than "
            f"the other layers under it yet: drop {flag} (the experts then take "
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}), or use 1f1b or "
            f"1f1b-ir")


def _average_with_per_token_loss(args):
    if args.ddp_average_in_collective and args.calculate_per_token_loss:
        return ("--ddp-average-in-collective with --calculate-per-token-loss: Megatron's DDP "
                "refuses it (under the per-token loss it sums the replicas' gradients and "
                "divides them by the step's loss tokens itself): drop "
                "--ddp-average-in-collective, or --calculate-per-token-loss (Megatron's default "
                "loss, whose replica average it computes in the collective)")
    return None


def _distributed_optimizer_instances(args):
    instances = args.num_distributed_optimizer_instances
    if instances <= 1:
        return None
    flag = f"--num-distributed-optimizer-instances {instances}"
    if not args.use_distributed_optimizer:
        return (f"{flag} splits Megatron's distributed optimizer into instances: add "
                "--use-distributed-optimizer, or drop it")
    replicas = getattr(args, "data_parallel_size", None)
    if replicas is None:
        return None  # known after Megatron-LM's validation (check_args)
    replicas *= args.context_parallel_size
    if replicas % instances:
        return (f"{flag}: each instance takes an equal share of the {replicas} data- and "
                "context-parallel ranks: pass a divisor of that number")
    if args.num_experts:
        expert_replicas = (replicas * args.tensor_model_parallel_size
                           // (args.expert_model_parallel_size
                               * (args.expert_tensor_parallel_size or 1)))
        if expert_replicas % instances:
            return (f"{flag}: each instance takes an equal share of the experts' "
                    f"{expert_replicas} data-parallel ranks too: pass a divisor of that number")
    return None


def _cpu_half_precision(args):
    if not torch.cuda.is_available() and (args.bf16 or args.fp16):
        return ("--bf16 and --fp16 need CUDA (megatron-core's mixed-precision optimizers only "
                "wrap CUDA tensors): drop them on a machine without a GPU (fp32 trains there, "
                "with the distributed optimizer too)")
    return None


def _cpu_timeout_after_init(args):
    if not torch.cuda.is_available() and \
            getattr(args, "distributed_timeout_seconds_after_init", None) is not None:
        return ("--distributed-timeout-seconds-after-init needs CUDA (Megatron-LM synchronizes "
                "the device before it changes the process groups' timeouts): use "
                "--distributed-timeout-minutes on a machine without a GPU")
    return None


def _cpu_profile(args):
    if not torch.cuda.is_available() and args.profile and not args.use_pytorch_profiler:
        return ("--profile starts and stops CUDA's profiler (for nsys) unless "
                "--use-pytorch-profiler is given: add --use-pytorch-profiler, or drop --profile "
                "on a machine without a GPU")
    return None


#: Megatron-LM's memory reports that read CUDA's caching allocator or driver and have no CPU
#: meaning: without CUDA the first fails on an empty ``torch.cuda.memory_stats()`` at the first
#: log line, the others call into a driver that is not there.
_CUDA_MEMORY_REPORTS = ("log_memory_to_tensorboard", "record_memory_history",
                        "log_device_memory_used")


def _cpu_memory_reports(args):
    given = [f"--{name.replace('_', '-')}" for name in _CUDA_MEMORY_REPORTS
             if getattr(args, name, False)]
    if given and not torch.cuda.is_available():
        return (f"{', '.join(given)} read CUDA's memory allocator, which a machine without a GPU "
                "does not have (Megatron-LM would fail at its first log line): drop them there; "
                "--metrics-jsonl records each step's peak activation bytes on any device")
    return None


def _flash_precision(args):
    backend = getattr(args, "attention_backend", None)
    if torch.cuda.is_available() and getattr(backend, "name", None) == "flash" \
            and not (args.bf16 or args.fp16):
        return ("--attention-backend flash: the flash kernel takes fp16 or bf16 only, and this "
                "run trains in fp32: add --bf16 or --fp16, or pass --attention-backend fused "
                "(the memory-efficient kernel, which takes fp32)")
    return None


def _transformer_engine(args):
    if args.transformer_impl != "transformer_engine":
        return None
    from megatron.plugin.layers import te_layers

    absent = te_layers.missing()
    if absent is None:
        return None
    return (f"--transformer-impl transformer_engine needs {absent}, which this machine lacks: "
            "run on a GPU machine with Transformer Engine (NVIDIA's NGC PyTorch containers ship "
            "it; elsewhere pip install --no-build-isolation transformer_engine[pytorch]), or "
            "pass --transformer-impl local (the same model with Megatron's local layers)")


def _moe_transformer_engine(args):
    if args.num_experts and args.transformer_impl == "transformer_engine":
        return ("no test proves --num-experts with --transformer-impl transformer_engine yet "
                "(Megatron's TE expert modules have not run under the schedules): pass "
                "--transformer-impl local with MoE layers")
    return None


def _tensorboard(args):
    if args.tensorboard_dir:
        error = _tensorboard_import_error()
        if error is not None:
            return (f"--tensorboard-dir {args.tensorboard_dir}: torch.utils.tensorboard cannot "
                    f"be imported ({error}), and without it Megatron-LM writes no TensorBoard "
                    "log: pip install tensorboard, or drop --tensorboard-dir")
    return None


def _throughput(args):
    if args.log_throughput and not flop_count.counts_real_lengths():
        return ("--log-throughput: this megatron-core release counts FLOPs as if every sample "
                "were --seq-length tokens long and cannot be told the documents' real lengths "
                "(megatron-core 0.19 can), which overstates a batch of documents: drop "
                "--log-throughput, or install megatron-core 0.19")
    return None


def _metrics_folder(args):
    path = args.metrics_jsonl
    if not path:
        return None
    if os.path.isdir(path):
        return (f"--metrics-jsonl {path} is a folder: give a file path (the folder it names is "
                "made if missing)")
    return _folder_refusal("--metrics-jsonl", path, os.path.dirname(os.path.abspath(path)))


def _trace_folder(args):
    return _folder_refusal("--trace-dir", args.trace_dir, args.trace_dir) \
        if args.trace_dir else None


def _folder_refusal(flag: str, value: str, folder: str) -> str | None:
    """Make ``folder``, where a run writes what ``flag`` asks for, and say why it cannot be
    written, if it cannot. Made here rather than checked: whether a folder can be made is
    known by making it, and the run needs it (every rank makes it: each writes its own trace,
    and the metrics' last rank may be on another host)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return (f"{flag} {value}: {folder} is a file, not a folder: give a path under a folder "
                f"you can write, or drop {flag}")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        return (f"{flag} {value}: the folder {folder} cannot be made ({error.strerror}): "
                f"give a path under a folder you can write, or drop {flag}")
    if not os.access(folder, os.W_OK | os.X_OK):
        return (f"{flag} {value}: the folder {folder} is not writable: give a path under a "
                f"folder you can write, or drop {flag}")
    return None


def _schedule_checks(args):
    spec = registry.spec(args.pipeline_schedule)
    if spec is None or spec.check_args is None:
        return None
    try:
        spec.check_args(args)
    except ValueError as err:
        return str(err)
    return None


#: The checks across options (what one option's class cannot say): each returns what to
#: change, or ``None``. They take the parsed flags before or after Megatron-LM's validation.
RULES = (_pipeline_timeout, _ulysses_heads, _schedule_checks,
         _moe_expert_biases, _moe_expert_tensor_parallel,
         _average_with_per_token_loss, _distributed_optimizer_instances,
         _cpu_half_precision, _cpu_timeout_after_init,
         _cpu_profile, _cpu_memory_reports, _flash_precision, _transformer_engine,
         _moe_transformer_engine, shared_gpu.refit_refusal,
         _tensorboard, _throughput, _metrics_folder, _trace_folder)


def rule_refusals(args: argparse.Namespace) -> list[str]:
    """The messages of the :data:`RULES` that refuse ``args``."""
    return [message for rule in RULES if (message := rule(args)) is not None]


def substitution_lines(args: argparse.Namespace) -> list[str]:
    """What start-up says runs in place of what an accepted option names: the core's records
    and the selected schedule's (:mod:`megatron.plugin.substitutions`), on the arguments the
    refusals let through."""
    spec = registry.spec(args.pipeline_schedule)
    return substitutions.lines(args, () if spec is None else spec.substitutions)


def check_args(args: argparse.Namespace) -> None:
    """Raise :class:`Refusals` with every rule of :data:`RULES` that refuses the validated
    arguments (the options themselves were checked on the command line:
    :func:`check_command_line`)."""
    messages = rule_refusals(args)
    if messages:
        raise Refusals(messages)


def _tensorboard_import_error() -> ImportError | None:
    """Why ``torch.utils.tensorboard`` (Megatron-LM's writer) cannot be imported, or ``None``.
    Megatron-LM only prints a warning when it is missing and writes nothing."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as error:
        return error
    return None
