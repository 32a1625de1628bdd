"""``pretrain_gpt_elastic.py`` on Megatron-LM's own training loop (``megatron.training``).

Megatron-LM parses and validates every flag (the schedules add theirs through the extra-args
hook), builds the model through :func:`model_provider`, loads and saves checkpoints, logs,
evaluates and steps the optimizer. The project hands it three things: the model provider (the
layer spec with the project's document attention), a dataset provider whose iterators yield one
global batch of whole documents per step (:mod:`megatron.plugin.document_data`), and
``forward_step``. The schedule named by ``--pipeline-schedule`` enters through
``get_forward_backward_func`` (:mod:`megatron.plugin.registry`), which turns each global batch
into what that schedule consumes.

The signatures differ between releases: 0.17's ``pretrain`` and ``initialize_megatron`` parse
the arguments themselves (``extra_args_provider``); 0.18 and 0.19 parse with
``parse_and_validate_args`` and ``pretrain`` takes a config container built from the parsed
arguments. :func:`run_pretrain` (the training script) and :func:`initialize` (tests and
benchmarks that drive single steps) call whichever is installed.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import inspect
import logging
import os
import sys
import traceback
from typing import Callable, Sequence

import torch
from megatron.core.enums import ModelType

from megatron.plugin import (arguments, checkpoint_errors, cpu_compat, error_once, gpt2_bpe,
                             gpu_proofs, hang_report, optimizer_state, registry, shared_gpu)
from megatron.plugin.batches import forward_step
from megatron.plugin.document_data import sample_meaning, train_valid_test_datasets_provider
from megatron.plugin.model import model_provider
from megatron.plugin.pipeline import group_cache, run_settings

log = logging.getLogger(__name__)

MODEL_TYPE = ModelType.encoder_or_decoder


def run_pretrain() -> None:
    """Parse the command line with Megatron-LM's parser and train with its ``pretrain``."""
    _prepare()
    # The project's refusals, all at once, before Megatron-LM's validation (which may build a
    # tokenizer, and download its vocabulary) and before any process group.
    gpt2_bpe.install(arguments.check_command_line(sys.argv[1:], training=True))
    from megatron.training import training as megatron_training

    store = _restart_store()
    if not getattr(megatron_training.load_checkpoint, "explains_failures", False):
        megatron_training.load_checkpoint = checkpoint_errors.explained_load(
            megatron_training.load_checkpoint)
        megatron_training.save_checkpoint = checkpoint_errors.explained_save(
            megatron_training.save_checkpoint)
    heartbeat = hang_report.start(_agent_store("longctx"))
    # Megatron-LM's pretrain returns (or, after --exit-interval, --exit-duration-in-mins or an
    # exit signal, exits 0 after a barrier) with its process groups alive. A gloo rank that
    # exits with them alive can abort its interpreter after the work is done, which torchrun
    # takes for a failure and answers by running the whole job again: shutdown() first.
    try:
        _pretrain(store)
    except SystemExit as done:
        if done.code in (None, 0):
            shutdown()
        raise
    except BaseException as error:
        if hang_report.is_timeout(error):
            hang_report.report(heartbeat, error)
        raise
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    shutdown()


def _pretrain(store) -> None:
    """Megatron-LM's ``pretrain`` as the installed release takes it (see the module doc)."""
    from megatron.training import pretrain
    from megatron.training import training as megatron_training

    if _parses_in_initialize():
        megatron_training.initialize_megatron = _with_checks(megatron_training.initialize_megatron)
        pretrain(train_valid_test_datasets_provider, model_provider, MODEL_TYPE, forward_step,
                 extra_args_provider=arguments.add_arguments, args_defaults=arguments.DEFAULTS,
                 store=store)
        return
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    with _refusals():
        args = parse_and_validate_args(extra_args_provider=arguments.add_arguments,
                                       args_defaults=arguments.DEFAULTS)
    arguments.check_training_args(args)
    _after_parsing(args)
    # No model config in the container: Megatron then builds the model with model_provider.
    with _refusals():
        container = pretrain_cfg_container_from_args(args, None)
    pretrain(container, train_valid_test_dataset_provider=train_valid_test_datasets_provider,
             model_provider=model_provider, model_type=MODEL_TYPE,
             forward_step_func=forward_step, store=store)


def report_error(error: BaseException) -> None:
    """Print ``error`` (a refusal: the training script exits 2 with it) to stderr once for the
    ranks it happened on (:mod:`megatron.plugin.error_once`, through torchrun's agent store)."""
    def write(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if "RANK" not in os.environ:
        write(f"error: {error}")
        return
    error_once.report(str(error), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                      _agent_store("errors"), write)


def _restart_store():
    """The process groups' store when torchrun has restarted its workers, else ``None``
    (``env://``, as Megatron-LM does).

    torchrun (``--max-restarts``) restarts every worker with the rendezvous store of its agent,
    which still holds the previous attempt's keys: the restarted ranks read their peers' old
    addresses and wait in gloo's (or NCCL's) connection set-up until the distributed timeout
    (``--distributed-timeout-minutes``). A prefix per attempt
    (``TORCHELASTIC_RESTART_COUNT``) gives every attempt keys of its own."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return None
    return _agent_store("restart")


def _agent_store(name: str):
    """A client of torchrun's agent store (it outlives the workers) under the prefix
    ``<name>_<attempt>``, so each restart attempt has keys of its own; ``None`` when the
    workers were not started by torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=datetime.timedelta(minutes=30))
    return torch.distributed.PrefixStore(f"{name}_{attempt}", agent)


def initialize(argv: Sequence[str], extra_args_provider: Callable | None = None):
    """Megatron-LM's start-up without its loop, for tests and benchmarks that run single steps:
    parse ``argv`` (Megatron's flags, the project's, and ``extra_args_provider``'s), validate,
    check, initialize the process groups and seeds, and select the schedule. Returns the
    arguments (also Megatron's global ``get_args()``)."""
    _prepare()
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron

    def extra(parser):
        arguments.add_arguments(parser)
        return extra_args_provider(parser) if extra_args_provider else parser

    gpt2_bpe.install(arguments.check_command_line(argv, extra_args_provider=extra_args_provider))
    with arguments.command_line(argv), _refusals():
        if _parses_in_initialize():
            initialize_megatron(extra_args_provider=extra, args_defaults=arguments.DEFAULTS,
                                allow_no_cuda=True)
            _after_parsing(get_args())
        else:
            from megatron.training.arguments import parse_and_validate_args

            _after_parsing(parse_and_validate_args(extra_args_provider=extra,
                                                   args_defaults=arguments.DEFAULTS))
            initialize_megatron(allow_no_cuda=True)
    return get_args()


def setup_model_and_optimizer():
    """Megatron-LM's model (``get_model`` with :func:`model_provider`: DDP-wrapped chunks),
    optimizer and LR scheduler from the flags, plus the model config prepared for a schedule
    the way Megatron's ``train()`` prepares it. Returns ``(model, optimizer, scheduler,
    config)``."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.training import get_args
    from megatron.training import training as megatron_training
    from megatron.core.utils import get_model_config

    model, optimizer, scheduler = megatron_training.setup_model_and_optimizer(
        model_provider_func=model_provider, model_type=MODEL_TYPE)
    args = get_args()
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:
        config.no_sync_func = _per_chunk(model, "no_sync")
        if args.align_grad_reduce:
            config.grad_sync_func = _per_chunk(model, "start_grad_sync")
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = _per_chunk(model, "start_param_sync")
    return model, optimizer, scheduler, config


def _per_chunk(model: list, method: str):
    """Each model chunk's ``method``, as Megatron's ``train()`` hands it to the schedule: the
    one function with one chunk, else the list."""
    funcs = [getattr(chunk, method) for chunk in model]
    return funcs[0] if len(funcs) == 1 else funcs


def train_step(model, optimizer, scheduler, config, data_iterator, iteration: int = 0):
    """One training step on ``data_iterator`` (of global batches) as Megatron's loop takes it (``megatron.training.train_step``: zero
    the grad buffers, the selected schedule's forward-backward inside the rerun state machine,
    the optimizer step and the LR-scheduler step). Returns the schedule's record
    (:mod:`megatron.plugin.reporting`) extended with Megatron's ``update_successful`` and
    ``grad_norm``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import training as megatron_training

    schedule = get_forward_backward_func()
    # Megatron's loop wraps the iterators it builds for the rerun state machine.
    if isinstance(data_iterator, list):
        data_iterator = [RerunDataIterator(iterator) for iterator in data_iterator]
    else:
        data_iterator = RerunDataIterator(data_iterator)
    result = megatron_training.train_step(forward_step, data_iterator, model, optimizer,
                                          scheduler, config, schedule, iteration=iteration)
    _, skipped, _, _, _, grad_norm = result[:6]
    return dict(schedule.reporter.last, update_successful=not skipped, grad_norm=grad_norm)


def reset() -> None:
    """Undo :func:`initialize` and what a run built on it, on every rank, keeping the default
    process group: the next :func:`initialize` in this process then starts from the state a
    fresh process has (tests run several layouts in one launch this way).

    Reset, after a barrier (no rank tears down while a peer still works):

    * Megatron-LM's global state, with its own teardown (``destroy_global_state``, what its
      in-process restart calls): the parsed arguments, tokenizer, timers and other global
      variables, the micro-batch calculator, the global memory buffer, the model-parallel
      groups and the rerun state machine;
    * the checkpoint version and loaded iteration that Megatron's loader records;
    * every process group but the default one, destroyed (Megatron's teardown forgets its
      groups without destroying them, and on gloo each group keeps its own polling threads,
      which would add up over the layouts of a launch and slow every later one), then the
      garbage collector run: a group whose last references sit in reference cycles (models,
      optimizers and their hooks) keeps its threads until the cycles are collected. A cycle
      through autograd's C++ nodes is never collected: DDP's gradient hooks sit on each
      parameter's gradient accumulator, and while something else holds that node (the fp32
      distributed optimizer's shards, views of the parameters with autograd history, do; so
      do the MoE layouts with tensor or context parallelism) the collector cannot see the
      hooks' references back to the wrapper. So every Megatron DDP wrapper still alive after
      the collection is emptied (nothing may use a run's model after a reset: its groups are
      gone), which frees its model, buffers and groups, and the collector runs again; and the
      caches of the groups the schedules create themselves
      (:mod:`megatron.plugin.pipeline.group_cache`: a cache hit on some ranks but not on others
      would stall the group creation the others enter);
    * Megatron's own ``get_forward_backward_func`` everywhere (:func:`initialize` selects the
      schedule again);
    * the CPU-compatibility counters (:data:`cpu_compat.HITS`): they count the next run only.

    Kept: the default process group (Megatron's initialisation skips ``init_process_group``
    when one exists; under torchrun a new one would meet the old one's keys in the agent's
    store), what :func:`initialize` installs once and idempotently (the CPU compatibility layer,
    the dataset helpers), the registered schedules, and the schedules' caches of plans (pure
    functions of their arguments). The random generators and Megatron's RNG tracker need no reset:
    :func:`initialize` seeds them again (``model_parallel_cuda_manual_seed`` resets the
    tracker's states)."""
    import torch.distributed as dist
    from megatron.training import checkpointing
    from megatron.training.training import destroy_global_state

    if dist.is_initialized():
        dist.barrier()
    destroy_global_state()
    checkpointing._CHECKPOINT_VERSION = None
    checkpointing.set_loaded_iteration(None)
    group_cache.forget_all()
    if dist.is_initialized():
        default = dist.group.WORLD
        for group in [group for group in dist.distributed_c10d._world.pg_map
                      if group is not default]:
            dist.destroy_process_group(group)
    gc.collect()
    _empty_uncollected_wrappers()
    registry.restore_megatron()
    cpu_compat.HITS.clear()


def _empty_uncollected_wrappers() -> None:
    from megatron.core.distributed import DistributedDataParallel

    wrappers = [obj for obj in gc.get_objects() if isinstance(obj, DistributedDataParallel)]
    for wrapper in wrappers:
        wrapper.__dict__.clear()
    if wrappers:
        del wrappers
        gc.collect()


def shutdown() -> None:
    """Tear the process groups down after a run, on every rank: a barrier keeps a fast rank
    from destroying a group a peer still uses, and exiting with gloo's threads alive can abort
    the interpreter after the work is done."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return
    parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()


def _prepare() -> None:
    shared_gpu.apply()  # before torch.distributed and CUDA initialise
    if not torch.cuda.is_available():
        cpu_compat.install()
    optimizer_state.install()
    _use_shipped_dataset_helpers()


def _parses_in_initialize() -> bool:
    """megatron-core 0.17: ``initialize_megatron`` (and ``pretrain``) parse the flags."""
    from megatron.training.initialize import initialize_megatron

    return "extra_args_provider" in inspect.signature(initialize_megatron).parameters


def _after_parsing(args) -> None:
    arguments.check_args(args)
    announce(args)
    run_settings.configure(args.pipeline_timeout_s, args.trace_dir)
    registry.use_schedule(args.pipeline_schedule)


def announce(args) -> None:
    """Rank 0's start-up lines, once per start-up: what a sample is, a warning per option
    still unproven on GPUs (:func:`megatron.plugin.gpu_proofs.warnings`), and what runs in
    place of what an accepted option names
    (:func:`megatron.plugin.arguments.substitution_lines`)."""
    if args.rank != 0:
        return
    log.info(sample_meaning(args))
    for line in gpu_proofs.warnings(args):
        log.warning(line)
    for line in arguments.substitution_lines(args):
        log.info(line)


def _with_checks(initialize_megatron):
    """0.17: run the project's checks right after Megatron parsed and validated the flags."""

    def initialize(*args, **kwargs):
        from megatron.training import get_args

        with _refusals():
            result = initialize_megatron(*args, allow_no_cuda=True, **kwargs)
        arguments.check_training_args(get_args())
        _after_parsing(get_args())
        return result

    return initialize


@contextlib.contextmanager
def _refusals():
    """Megatron-LM validates the flags with ``assert``: its refusal becomes a ``ValueError``
    (the training script exits 2 with it) naming the check, its message, or the asserted
    expression when it has none."""
    try:
        yield
    except AssertionError as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        what = str(err) or frame.line
        raise ValueError(f"Megatron-LM refused the arguments "
                         f"({os.path.basename(frame.filename)}:{frame.lineno}): {what}") from err


def _use_shipped_dataset_helpers() -> None:
    """Megatron-LM's start-up runs ``make`` for the C++ dataset helpers. The megatron-core
    wheel ships them compiled, but not the Makefile, so ``make`` fails and rank 0 exits: use
    the compiled module when it imports, and compile only when it does not."""
    from megatron.core.datasets import utils

    compile_helpers = utils.compile_helpers
    if getattr(compile_helpers, "uses_shipped", False):
        return

    def compiled_or_compile():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            compile_helpers()

    compiled_or_compile.uses_shipped = True
    utils.compile_helpers = compiled_or_compile
