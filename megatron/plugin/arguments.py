"""Flags of ``pretrain_gpt_elastic.py``: Megatron-LM's own parser, plus the project's group.

Megatron-LM parses and validates every one of its flags (``megatron.training.arguments``);
:func:`add_arguments` is the extra-args hook that adds ``--pipeline-schedule``, the runtime's
flags and each registered schedule's group. :func:`check_args` then refuses, by name and with
what to use instead, every setting this script would not honour with Megatron-LM's meaning:
flags read only by the code this script replaces (Megatron-LM's GPT model builder and GPT
dataset), options a schedule cannot run, and ``--tensorboard-dir`` without the ``tensorboard``
package (Megatron-LM would warn and write nothing). It runs before any process does work.

Defaults that differ from Megatron-LM's, and why:

* ``--transformer-impl local``: the layer spec is Megatron's local spec with the project's
  document attention in place of core attention (``megatron/plugin/layers/attention.py``).
* ``--dataloader-type external``: batches are whole documents, one global batch per step, from
  :mod:`megatron.plugin.document_data`; ``single`` and ``cyclic`` are Megatron's per-sample
  loaders and are refused.
* ``--reset-position-ids --reset-attention-mask`` are always in force: positions restart at
  every document and no token attends across a document boundary.
* Without CUDA: ``--distributed-backend gloo``, ``--use-cpu-initialization``, and Megatron's
  fused CUDA kernels off (they change speed, not results).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from typing import Sequence

import torch

from megatron.plugin import cpu_compat, registry

#: ``args_defaults`` for Megatron's parser (applied where a flag was not given).
DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer", "dataloader_type": "external"}

_CPU_DEFAULTS = dict(distributed_backend="gloo", use_cpu_initialization=True,
                     gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                     bias_gelu_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)

#: Flags read only by the model builder and dataset this script replaces, refused when set
#: away from Megatron's default: ``dest -> what to do instead``.
NOT_IMPLEMENTED = {
    "spec": "the layer spec is the local spec with document attention; drop --spec",
    "use_legacy_models": "only megatron-core models are built; drop --use-legacy-models",
    "heterogeneous_layers_config_path": "heterogeneous layers are not built; drop the flag",
    "num_experts": "mixture-of-experts layers are not built by this script; drop --num-experts",
    "multi_latent_attention": "multi-latent attention is not built; drop the flag",
    "mtp_num_layers": "multi-token prediction is not built; drop --mtp-num-layers",
    "qk_layernorm": "the document attention has no Q/K layer norm; drop --qk-layernorm",
    "fp8": "FP8 needs Transformer Engine layers, which this script does not build; drop "
           "--fp8-format",
    "sft": "supervised fine-tuning data is not read; drop --sft",
    "fim_data": "fill-in-the-middle data is not read; drop --fim-data",
    "eod_mask_loss": "every label of a document counts in the loss; drop --eod-mask-loss",
    "train_data_path": "give the data with --data-path (and --split)",
    "valid_data_path": "give the data with --data-path (and --split)",
    "test_data_path": "give the data with --data-path (and --split)",
    "data_args_path": "give the data with --data-path (and --split)",
    "per_split_data_args_path": "give the data with --data-path (and --split)",
    "multiple_validation_sets": "one validation split is read; drop the flag",
    "full_validation": "validation runs --eval-iters batches; drop --full-validation",
    "rampup_batch_size": "the global batch size (documents) is fixed: drop --rampup-batch-size",
    # Options of Megatron's attention and rotary embedding the document attention does not
    # implement (megatron/plugin/layers/attention.py).
    "use_rope_scaling": "the document attention's RoPE has no frequency scaling; drop "
                        "--use-rope-scaling",
    "rotary_seq_len_interpolation_factor": "the document attention's RoPE does not interpolate "
                                           "positions; drop the flag",
    "no_rope_freq": "the document attention applies RoPE in every layer; drop --no-rope-freq",
    "window_size": "the document attention is causal over the whole document, without a "
                   "sliding window; drop --window-size",
    "window_attn_skip_freq": "the document attention has no sliding window; drop the flag",
    "softmax_type": "the document attention uses the plain softmax; drop --softmax-type",
    "experimental_attention_variant": "the layer spec has softmax attention only; drop the flag",
    "linear_attention_freq": "the layer spec has softmax attention only; drop the flag",
    "qk_l2_norm": "the local layer spec has no Q/K L2 norm (Transformer Engine's has); drop "
                  "--qk-l2-norm",
}

#: Position embeddings the model builds (``--position-embedding-type``).
POSITION_EMBEDDINGS = ("learned_absolute", "rope")


#: Megatron-LM options that change how a pipeline schedule runs, refused for the schedules that
#: are not Megatron's own (their executors do not implement them); Megatron's own schedules run
#: them with Megatron's code: ``dest -> why and what to do instead``.
DOCUMENT_SCHEDULE_REFUSALS = {
    "overlap_param_gather": "the document schedules do not gather parameters in the forward; "
                            "drop --overlap-param-gather",
    "overlap_grad_reduce": "the document schedules reduce gradients after the last backward; "
                           "drop --overlap-grad-reduce",
    "tp_comm_overlap": "tensor-parallel communication overlap needs Transformer Engine; drop "
                       "--tp-comm-overlap",
    "decoder_first_pipeline_num_layers": "the document schedules place num-layers / PP layers "
                                         "on every stage; drop the flag",
    "decoder_last_pipeline_num_layers": "the document schedules place num-layers / PP layers "
                                        "on every stage; drop the flag",
    "account_for_embedding_in_pipeline_split": "the document schedules place num-layers / PP "
                                               "layers on every stage; drop the flag",
    "account_for_loss_in_pipeline_split": "the document schedules place num-layers / PP layers "
                                          "on every stage; drop the flag",
    "pipeline_model_parallel_layout": "the document schedules place num-layers / PP layers on "
                                      "every stage; drop --pipeline-model-parallel-layout",
    "enable_cuda_graph": "the document schedules' shapes change every step; drop the flag",
    "cuda_graph_impl": "the document schedules' shapes change every step; drop --cuda-graph-impl",
    "defer_embedding_wgrad_compute": "the document schedules compute every weight gradient in "
                                     "its backward; drop the flag",
    "delay_wgrad_compute": "the document schedules compute every weight gradient in its "
                           "backward; drop --delay-wgrad-compute",
    "fine_grained_activation_offloading": "use sppo's --sppo-offload (or elastic's per-chunk "
                                          "checkpointing) instead",
    "num_layers_per_virtual_pipeline_stage": "the document schedules run one model chunk per "
                                             "rank; drop the flag, or use 'interleaved'",
    "num_virtual_stages_per_pipeline_rank": "the document schedules run one model chunk per "
                                            "rank; drop the flag, or use 'interleaved'",
}


#: Each schedule argument group -> ``(flag, dest, default)`` of the flags it added (filled by
#: :func:`add_arguments`; :func:`check_args` refuses those of groups the schedule lacks).
_GROUP_FLAGS: dict = {}


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
    _GROUP_FLAGS.clear()
    for spec in registry.specs():
        for add in spec.argument_groups:
            if add not in _GROUP_FLAGS:  # schedules may share a group
                before = len(parser._actions)
                add(parser)
                _GROUP_FLAGS[add] = [(action.option_strings[0], action.dest, action.default)
                                     for action in parser._actions[before:]]
    parser.set_defaults(transformer_impl="local", reset_position_ids=True,
                        reset_attention_mask=True)
    if not torch.cuda.is_available():
        parser.set_defaults(**_CPU_DEFAULTS)
    elif importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        # The local layers fuse weight-gradient accumulation with apex's CUDA extension only;
        # without it Megatron-LM's default (on) stops at model construction. Off computes the
        # same gradients unfused.
        parser.set_defaults(gradient_accumulation_fusion=False)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Megatron-LM's parsing and validation of ``argv`` with the project's flags, then
    :func:`check_args`; no process group or global state is touched (tools and tests).
    Megatron reads the world size from ``WORLD_SIZE``; without CUDA the CPU layer is
    installed first (validation queries the device for tensor and context parallelism)."""
    from megatron.training.arguments import parse_args, validate_args

    if not torch.cuda.is_available():
        cpu_compat.install()

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


def check_training_args(args: argparse.Namespace) -> None:
    """What Megatron-LM's training loop needs beyond its validation (the training script)."""
    if args.eval_interval is None:
        raise ValueError("--eval-interval is not set (megatron-core 0.18 and later have no "
                         "default and Megatron-LM's loop divides by it): pass --eval-interval N, "
                         "with --eval-iters 0 to skip evaluation")


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag for a setting this script would not honour."""
    spec = registry.spec(args.pipeline_schedule)
    megatron_schedule = registry.is_megatron(args.pipeline_schedule)
    defaults = megatron_defaults()
    for dest, instead in NOT_IMPLEMENTED.items():
        if dest in defaults and getattr(args, dest, None) != defaults[dest][1]:
            raise ValueError(f"{defaults[dest][0]} is not supported by pretrain_gpt_elastic.py: "
                             f"{instead}")
    if args.position_embedding_type not in POSITION_EMBEDDINGS:
        raise ValueError(f"--position-embedding-type {args.position_embedding_type} is not "
                         f"supported by pretrain_gpt_elastic.py (the document attention "
                         f"implements {' and '.join(POSITION_EMBEDDINGS)}): use one of them")
    if args.transformer_impl != "local":
        raise ValueError("--transformer-impl transformer_engine is not supported by "
                         "pretrain_gpt_elastic.py (its layer spec is the local one with "
                         "document attention): pass --transformer-impl local")
    if args.dataloader_type != "external":
        raise ValueError(f"--dataloader-type {args.dataloader_type}: pretrain_gpt_elastic.py "
                         "reads whole documents per global batch itself; drop the flag")
    if args.pipeline_timeout_s <= 0:
        raise ValueError("--pipeline-timeout-s must be > 0 seconds")
    if (not megatron_schedule and spec.prepare_input is None and args.context_parallel_size > 1
            and not args.calculate_per_token_loss):
        raise ValueError(f"--pipeline-schedule {args.pipeline_schedule} with "
                         "--context-parallel-size > 1 runs Megatron's micro-batches, whose "
                         "default loss divides each context-parallel rank's share by that "
                         "share's own token count (a different loss at every degree): add "
                         "--calculate-per-token-loss, or use elastic, seq1f1b or sppo, which "
                         "weight every token as at one context-parallel rank")
    if args.context_parallel_size > 1 and megatron_schedule:
        raise ValueError("--context-parallel-size > 1 is not supported with Megatron's own "
                         "schedules here (ring attention needs Transformer Engine); use 1, or "
                         "an IR schedule (elastic, seq1f1b, 1f1b-ir, sppo), where it is Ulysses")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    if cp > 1:
        heads = args.num_attention_heads // tp
        groups = (args.num_query_groups if args.group_query_attention
                  else args.num_attention_heads) // tp
        if heads % cp or groups % cp:
            raise ValueError(f"Ulysses sequence parallelism splits the attention heads: "
                             f"{heads} heads and {groups} query groups per tensor-parallel "
                             f"rank are not divisible by --context-parallel-size {cp}; "
                             f"choose a degree that divides them")
        if args.seq_length % (cp * tp):
            raise ValueError(f"--seq-length {args.seq_length} must be divisible by "
                             f"--context-parallel-size x --tensor-model-parallel-size "
                             f"({cp} x {tp})")
    _check_foreign_flags(args, spec)
    if spec is not None and spec.check_args is not None:
        spec.check_args(args)
    if not megatron_schedule:
        for dest, instead in DOCUMENT_SCHEDULE_REFUSALS.items():
            if dest in defaults and getattr(args, dest, None) != defaults[dest][1]:
                raise ValueError(f"{defaults[dest][0]} is not supported by --pipeline-schedule "
                                 f"{args.pipeline_schedule}: {instead}")
    if not torch.cuda.is_available() and (args.bf16 or args.fp16
                                           or args.use_distributed_optimizer):
        raise ValueError("--bf16, --fp16 and --use-distributed-optimizer need CUDA "
                         "(megatron-core's mixed-precision and distributed optimizers only wrap CUDA tensors): "
                         "drop them on a machine without a GPU")
    if not torch.cuda.is_available() and \
            getattr(args, "distributed_timeout_seconds_after_init", None) is not None:
        raise ValueError("--distributed-timeout-seconds-after-init needs CUDA (Megatron-LM "
                         "synchronizes the device before it changes the process groups' "
                         "timeouts): use --distributed-timeout-minutes on a machine without a "
                         "GPU")
    if not torch.cuda.is_available() and args.profile and not args.use_pytorch_profiler:
        raise ValueError("--profile starts and stops CUDA's profiler (for nsys) unless "
                         "--use-pytorch-profiler is given: add --use-pytorch-profiler, or drop "
                         "--profile on a machine without a GPU")
    if args.tensorboard_dir:
        error = _tensorboard_import_error()
        if error is not None:
            raise ValueError(f"--tensorboard-dir {args.tensorboard_dir}: torch.utils.tensorboard "
                             f"cannot be imported ({error}), and without it Megatron-LM writes "
                             "no TensorBoard log: pip install tensorboard, or drop "
                             "--tensorboard-dir")


def _check_foreign_flags(args: argparse.Namespace, spec) -> None:
    """Refuse a flag of another schedule's group set away from its default: the selected
    schedule would ignore it."""
    mine = set(spec.argument_groups) if spec is not None else set()
    for add, flags in _GROUP_FLAGS.items():
        if add in mine:
            continue
        for flag, dest, default in flags:
            if getattr(args, dest, default) != default:
                owners = [s.name for s in registry.specs() if add in s.argument_groups]
                raise ValueError(f"{flag} is a flag of --pipeline-schedule "
                                 f"{' / '.join(owners)} and would do nothing under "
                                 f"--pipeline-schedule {args.pipeline_schedule}: drop it")


def _tensorboard_import_error() -> ImportError | None:
    """Why ``torch.utils.tensorboard`` (Megatron-LM's writer) cannot be imported, or ``None``.
    Megatron-LM only prints a warning when it is missing and writes nothing."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError as error:
        return error
    return None
