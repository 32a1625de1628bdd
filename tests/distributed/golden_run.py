"""The golden gradient tests' worker (``golden_worker.py`` runs :func:`main` under torchrun).

Modes:
* ``init`` (1 process): build the model with the given seed and save it with Megatron-LM's
  ``save_checkpoint`` (``--save``), so every layout starts from identical parameters.
* ``run`` (any layout): Megatron-LM's loader reads those weights (``--load``, resharded into
  the layout), run one training step (Megatron's ``train_step``:
  the schedule under test over the fixed documents, then the optimizer step), then save the reduced gradients (``main_grad``) *as model
  weights* — dist_checkpointing then reshards them into any other layout — and the loss.
  Document-level schedules (``elastic``, ``seq1f1b``) also write their plan's chunk kinds and
  checkpointing table (``plan_<tag>.json``), ``helix`` its micro-batch and padding counts
  and MLP chunk rows (``helix_<tag>.json``), ``sppo`` its subsequences, offload ratios and
  what each offload moved, per rank (``sppo_<tag>_<rank>.json``), so the test can check what a
  run exercised.
  With ``--overlap-grad-reduce`` a first forward-backward over other documents (no optimizer
  step) comes before the measured step: Megatron's DDP starts a bucket's reduction from the
  backward hooks only in a step after the first. The measured step then records, per rank, the
  order of its backward actions' starts and ends and of the buckets' reduction starts
  (``overlap_<tag>_<rank>.json``).
  With ``--use-distributed-optimizer`` the reduced gradients are all-gathered over each
  bucket's group before they are captured (each rank's reduce-scatter leaves its own shard
  reduced), and the parameters the next step's forwards find are saved (``params_<tag>``; with
  ``--overlap-param-gather`` after a forward-backward that gathers them through Megatron's
  forward pre-hooks, recording the all-gathers against the first forwards:
  ``gather_<tag>_<rank>.json``); the reference compares them with Megatron's optimizer stepping
  the single-process model with the run's gradients (``params_<tag>.pt``).
  Every rank records the global ranks of its pipeline, data-parallel and expert groups, and
  how much of the experts' weights it holds (``groups_<tag>_<rank>.json``). Finally record
  which CPU-compatibility patches were exercised (``hits_<tag>_<rank>.json``). Under Megatron's
  native ``1f1b`` the order in which its loop called ``forward_step`` / ``backward_step`` on
  each rank is recorded too (``order_<tag>_<rank>.json``), an independent oracle for the IR
  generator of 1F1B.
* ``reference`` (1 process): the single-process reference over whole documents, each document
  alone (no packing): per-token loss and gradients (``reference.pt``), and the gradients of
  Megatron's default loss (``reference_default_mbs<N>.pt`` for micro-batch sizes
  :data:`DEFAULT_LOSS_MICRO_BATCH_SIZES`; see :func:`default_loss_gradients`); with
  ``--golden-aux-loss-coeff C`` also both losses plus Megatron's auxiliary load-balancing loss
  at coefficient ``C`` over Megatron's micro-batches of each size (``reference_aux_mbs<N>.pt``,
  ``reference_default_mbs<N>_aux.pt``; see :func:`aux_loss_gradients`) and the project's
  loss per document (``reference_docaux.pt``, ``reference_default_mbs1_docaux.pt``; see
  :func:`document_aux_gradients`); then, for every
  tag given, load that run's gradient checkpoint into the single-process layout. Everything is
  written with ``torch.save`` for the test to compare.

With ``--golden-keyed-dropout`` every mode draws its dropout masks from each token's
identity (:mod:`keyed_dropout`), so that a run with dropout and the reference drop the same
entries.

One launch runs one command line, or, with ``--golden-layouts FILE`` as its only arguments,
every command line of ``FILE`` (a JSON list of argument lists, all for the launch's number of
ranks) one after another in the same processes: each is initialised afresh by Megatron-LM
(:func:`launch.initialize`) after :func:`launch.reset` undid the previous one, so a launch
pays the interpreter's start and the imports once.
"""
import argparse
import contextlib
import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.utils import get_model_config

from megatron.plugin import cpu_compat, launch
from megatron.plugin.batches import (eod_mask_token, forward_step, loss_tokens, micro_batch,
                                     micro_batch_rows, pack_row)
from megatron.plugin.document_data import GlobalBatch
from megatron.plugin.pipeline.ir import Kind

import keyed_dropout


def golden_documents(count: int, seq_length: int, vocab: int, seed: int):
    """Skewed lengths: a few documents near ``seq_length`` and many short ones."""
    rng = np.random.default_rng(seed)
    lengths = []
    for i in range(count):
        if i % 4 == 0:
            lengths.append(int(rng.integers(seq_length // 2, seq_length + 1)))
        else:
            lengths.append(int(rng.integers(2, seq_length // 4)))
    return [rng.integers(0, vocab, size=n + 1).astype(np.int64) for n in lengths]


#: Micro-batch sizes of the default-loss references (the layouts trained without
#: ``--calculate-per-token-loss`` name one of them), and the context-parallel sizes of those,
#: whose default loss depends on the degree (:mod:`megatron.plugin.context_loss`).
DEFAULT_LOSS_MICRO_BATCH_SIZES = (1, 2)
DEFAULT_LOSS_CONTEXT_PARALLEL_SIZES = (2,)


def golden_arguments(parser):
    group = parser.add_argument_group("golden test")
    group.add_argument("--golden-mode", choices=["init", "run", "reference"], required=True)
    group.add_argument("--golden-dir", required=True)
    group.add_argument("--golden-tag", default="")
    group.add_argument("--golden-tags", nargs="*", default=[])
    group.add_argument("--golden-docs", type=int, default=12)
    group.add_argument("--golden-eod-every", type=int, default=0,
                       help="put the tokenizer's end-of-document token at every K-th input of "
                            "each document (from the third on; 0: nowhere)")
    group.add_argument("--golden-aux-loss-coeff", type=float, default=0.0,
                       help="reference mode: also write the references with Megatron's "
                            "auxiliary load-balancing loss at this coefficient (the layouts "
                            "that name them pass it as --moe-aux-loss-coeff) and with the "
                            "project's per document (as --moe-per-document-aux-loss-coeff)")
    group.add_argument("--golden-keyed-dropout", action="store_true",
                       help="every mode: hidden and attention dropout draw masks keyed by "
                            "each token's identity (keyed_dropout.py), so that the run and the "
                            "reference drop the same entries")
    return parser


def with_eod_tokens(docs, every: int, eod: int):
    """``docs`` with ``eod`` at inputs ``2, 2 + every, ...`` of each (what ``--eod-mask-loss``
    masks); the last token, a label only, is left alone."""
    planted = []
    for doc in docs:
        doc = doc.copy()
        doc[2:len(doc) - 1:every] = eod
        planted.append(doc)
    return planted


def _sharded_state(model) -> dict:
    if len(model) == 1:
        return {"model": model[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(model)}


def save_model(directory: str, model) -> None:
    """Model weights only, in Megatron's distributed format (any layout can load them)."""
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(model), directory)
    dist.barrier()


def load_model(directory: str, model) -> None:
    loaded = dist_checkpointing.load(_sharded_state(model), directory)
    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    for chunk, key in zip(model, keys):
        chunk.module.load_state_dict(loaded[key], strict=True)


def capture_grads_before_step(model, optimizer) -> dict:
    """Wrap ``optimizer.step`` to copy every parameter's reduced gradient (``main_grad``, after
    ``finalize_model_grads``) first: the optimizer's clipping scales it in place."""
    captured = {}
    step = optimizer.step

    def capturing_step(*args, **kwargs):
        with whole_reduced_grads(model):
            for chunk in model:
                for param in chunk.module.parameters():
                    grad = getattr(param, "main_grad", None)
                    if grad is None:
                        grad = param.grad
                    captured[param] = (grad.detach().clone().view_as(param)
                                       if grad is not None else torch.zeros_like(param))
        return step(*args, **kwargs)

    optimizer.step = capturing_step
    return captured


@contextlib.contextmanager
def whole_reduced_grads(model):
    """For the duration, every bucket's gradients are the reduced ones everywhere. With the
    distributed optimizer each data-parallel rank's reduce-scatter leaves only its own shard of
    each bucket reduced (the rest holds the rank's local sums): the shards are all-gathered
    over the bucket's group, and the local sums put back afterwards (the optimizer reads its
    shard only)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    saved = []
    for chunk in model:
        if not chunk.ddp_config.use_distributed_optimizer:
            continue
        for group in [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]:
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            for bucket in group.buckets:
                local = bucket.grad_data.clone()
                dist.all_gather_into_tensor(bucket.grad_data, shard_buffer(local, size)[rank],
                                            group=group.intra_distributed_optimizer_instance_group)
                saved.append((bucket.grad_data, local))
    try:
        yield
    finally:
        for grad_data, local in saved:
            grad_data.copy_(local)


def grads_as_weights(model, captured: dict):
    """Replace every parameter's data by its captured reduced gradient."""
    for chunk in model:
        for param in chunk.module.parameters():
            param.data.copy_(captured[param])


@contextlib.contextmanager
def recording_call_order(order: list):
    """For the duration, wrap megatron-core's ``forward_step``/``backward_step`` (as its
    schedules call them) to append ``"F<microbatch>"`` / ``"B<k>"`` to ``order``. 1F1B runs
    backwards first-in first-out, so the k-th backward is micro-batch k."""
    from megatron.core.pipeline_parallel import schedules

    forward, backward = schedules.forward_step, schedules.backward_step

    def forward_step(*args, current_microbatch=None, **kwargs):
        order.append(f"F{current_microbatch}")
        return forward(*args, current_microbatch=current_microbatch, **kwargs)

    def backward_step(*args, **kwargs):
        order.append(f"B{sum(1 for step in order if step[0] == 'B')}")
        return backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward


def first_step(model, args, vocab: int) -> None:
    """One forward-backward over other documents than the measured step's (a different plan),
    without an optimizer step: the step in which Megatron's DDP counts each parameter's
    grad-ready hooks."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    docs = golden_documents(args.golden_docs, args.seq_length, vocab, args.seed + 1)
    data_iterator = RerunDataIterator(iter([GlobalBatch(docs, lambda: docs)]))
    # Inside Megatron's rerun state machine, as its train_step runs a step.
    while get_rerun_state_machine().should_run_forward_backward(data_iterator):
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data_iterator, model=model,
            num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.decoder_seq_length,
            forward_only=False)


@contextlib.contextmanager
def recording_overlap(model, events: list):
    """For the duration, append ``["start", action]`` / ``["end", action]`` around every
    backward action the executor runs and ``["reduce", i]`` when bucket group ``i`` of the
    rank's model chunk dispatches its reduction (a call of ``start_grad_sync`` that finds it
    already in flight, as ``finish_grad_sync`` makes, dispatches nothing; with several
    distributed-optimizer instances none is ever in flight: Megatron keeps no handle)."""
    from megatron.plugin.pipeline import executor
    from megatron.plugin.pipeline.ir import Kind

    groups = [*model[0].bucket_groups, *model[0].expert_parallel_bucket_groups]
    handler_of = executor._handler

    def recorded(run, action):
        handler = handler_of(run, action)
        if action.kind is not Kind.BACKWARD:
            return handler

        def backward(run, index, action):
            events.append(["start", str(action)])
            result = handler(run, index, action)
            events.append(["end", str(action)])
            return result
        return backward

    def reducing(index, group, start):
        def start_grad_sync(*args, **kwargs):
            if group.grad_reduce_handle is None:  # not a call that finds it in flight
                events.append(["reduce", index])
            return start(*args, **kwargs)
        return start_grad_sync

    for index, group in enumerate(groups):
        group.start_grad_sync = reducing(index, group, group.start_grad_sync)
    executor._handler = recorded
    try:
        yield len(groups)
    finally:
        executor._handler = handler_of
        for group in groups:
            del group.start_grad_sync


@contextlib.contextmanager
def recording_param_gather(model, events: list):
    """For the duration, append ``["gather", i]`` when bucket group ``i`` of the rank's model
    chunk dispatches its parameters' all-gather, ``["wait", i]`` when a forward pre-hook of
    Megatron's DDP waits for it, and ``["forward", name, in_flight]`` when a module with
    parameters starts its first forward (after DDP's own pre-hook), with the bucket groups
    whose all-gathers are in flight then."""
    chunk = model[0]
    groups = [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]

    def dispatching(index, group, start):
        def start_param_sync(*args, **kwargs):
            result = start(*args, **kwargs)
            if group.param_gather_handle is not None:
                events.append(["gather", index])
            return result
        return start_param_sync

    def waiting(index, group, finish):
        def finish_param_sync(*args, **kwargs):
            if group.param_gather_handle is not None or not group.param_gather_dispatched:
                events.append(["wait", index])
            return finish(*args, **kwargs)
        return finish_param_sync

    started = set()

    def forward_started(name):
        def hook(module, *unused):
            if name not in started:
                started.add(name)
                events.append(["forward", name, [i for i, group in enumerate(groups)
                                                 if group.param_gather_handle is not None]])
        return hook

    for index, group in enumerate(groups):
        group.start_param_sync = dispatching(index, group, group.start_param_sync)
        group.finish_param_sync = waiting(index, group, group.finish_param_sync)
    handles = [module.register_forward_pre_hook(forward_started(name))
               for name, module in chunk.module.named_modules()
               if any(True for _ in module.parameters(recurse=False))]
    try:
        yield len(groups)
    finally:
        for handle in handles:
            handle.remove()
        for group in groups:
            del group.start_param_sync, group.finish_param_sync


def placement(model) -> dict:
    """The global ranks of this rank's pipeline, data-parallel, tensor-parallel,
    context-parallel, expert-parallel and experts' tensor-parallel groups; the attention heads
    each of its attention modules holds and whether they run sequence parallelism; the number of MoE layers it holds, the number of
    entries of their experts' weights it holds, and how many of those Megatron marks
    ``allreduce=False`` (reduced over the expert data-parallel group, not the data-parallel
    one)."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def ranks(group):
        return dist.get_process_group_ranks(group)

    modules = [module for chunk in model for module in chunk.module.modules()]
    layers = [module for module in modules if isinstance(module, MoELayer)]
    experts = [param for layer in layers for param in layer.experts.parameters()]
    return {"pipeline": ranks(parallel_state.get_pipeline_model_parallel_group()),
            "data": ranks(parallel_state.get_data_parallel_group()),
            "tensor": ranks(parallel_state.get_tensor_model_parallel_group()),
            "context": ranks(parallel_state.get_context_parallel_group()),
            "heads": [module.num_attention_heads_per_partition for module in modules
                      if isinstance(module, Attention)],
            "sequence_parallel": sorted({module.config.sequence_parallel for module in modules
                                         if isinstance(module, Attention)}),
            "expert_model": ranks(parallel_state.get_expert_model_parallel_group()),
            "expert_tensor": ranks(parallel_state.get_expert_tensor_parallel_group()),
            "moe_layers": len(layers),
            "expert_entries": sum(param.numel() for param in experts),
            "expert_entries_apart": sum(param.numel() for param in experts
                                        if not getattr(param, "allreduce", True))}


def command_lines(argv: list[str]) -> list[list[str]]:
    """The command lines this launch runs: ``argv`` itself, or those of ``--golden-layouts``."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--golden-layouts")
    known, rest = parser.parse_known_args(argv)
    if known.golden_layouts is None:
        return [argv]
    if rest:
        raise SystemExit(f"--golden-layouts FILE takes no other arguments (put them in FILE's "
                         f"command lines); got {rest}")
    with open(known.golden_layouts) as f:
        return json.load(f)


def main():
    for argv in command_lines(sys.argv[1:]):
        args = launch.initialize(argv, golden_arguments)
        dropout = keyed_dropout.keyed() if args.golden_keyed_dropout \
            else contextlib.nullcontext()
        try:
            with dropout:
                run(args)
        except Exception as error:
            raise RuntimeError(f"golden {args.golden_mode} {args.golden_tag!r} in "
                               f"{args.golden_dir} failed") from error
        launch.reset()
    launch.shutdown()


def run(args):
    vocab = 256
    model, optimizer, scheduler, config = launch.setup_model_and_optimizer()
    docs = golden_documents(args.golden_docs, args.seq_length, vocab, args.seed)
    if args.golden_eod_every:
        from megatron.training import get_tokenizer

        docs = with_eod_tokens(docs, args.golden_eod_every, get_tokenizer().eod)
    if args.golden_mode == "init":
        from megatron.training.checkpointing import save_checkpoint

        save_checkpoint(0, model, optimizer, scheduler, 0)  # into --save
        return
    if args.golden_mode == "run":
        from megatron.core.pipeline_parallel import get_forward_backward_func
        batch = GlobalBatch(docs, lambda: docs)
        data_iterator = [iter([batch]) for _ in model] if len(model) > 1 else iter([batch])
        order: list[str] = []
        recording = recording_call_order(order) if args.pipeline_schedule == "1f1b" \
            else contextlib.nullcontext()
        events: list = []
        if args.overlap_grad_reduce:
            first_step(model, args, vocab)
            recording = recording_overlap(model, events)
        # Megatron's train_step: the schedule, then the optimizer step (grad norm and
        # clipping), which sees the gradients after they are captured.
        captured = capture_grads_before_step(model, optimizer)
        with recording as groups:
            record = launch.train_step(model, optimizer, scheduler, config, data_iterator)
        if args.overlap_grad_reduce:
            name = f"overlap_{args.golden_tag}_{dist.get_rank()}.json"
            with open(os.path.join(args.golden_dir, name), "w") as f:
                json.dump({"pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                           "bucket_groups": groups, "events": events}, f)
        tokens = record["num_tokens"]
        loss_sum = record["lm_loss"] * tokens
        num_microbatches = record["num_microbatches"]
        data_iterator = get_forward_backward_func().last_input
        plan = getattr(data_iterator, "plan", None)
        if plan is not None and dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"plan_{args.golden_tag}.json"), "w") as f:
                json.dump({"kinds": [chunk.kind for chunk in plan.chunks()],
                           "ckpt": plan.ckpt_table(),
                           "status": [p.status for p in plan.pipelines]}, f)
        if hasattr(data_iterator, "padding") and dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"helix_{args.golden_tag}.json"), "w") as f:
                json.dump({"microbatches": num_microbatches,
                           "padding": data_iterator.padding,
                           "mlp_rows": data_iterator.mlp_rows}, f)
        offloader = getattr(data_iterator, "offloader", None)
        if offloader is not None:
            name = f"sppo_{args.golden_tag}_{dist.get_rank()}.json"
            with open(os.path.join(args.golden_dir, name), "w") as f:
                json.dump({**data_iterator.subsequences.to_dict(),
                           "stage": parallel_state.get_pipeline_model_parallel_rank(),
                           "shares": [str(a) for a in data_iterator.schedule[
                               parallel_state.get_pipeline_model_parallel_rank()]
                               if a.is_compute() and a.part is not None],
                           "recomputes": sum(a.kind is Kind.RECOMPUTE for a in
                                             data_iterator.schedule[
                                                 parallel_state.get_pipeline_model_parallel_rank()]),
                           "offloads": [[r.unit[0], r.ratio, r.offloadable, r.moved]
                                        for r in offloader.records],
                           "host_peak": offloader.tier.peak, "host_used": offloader.tier.used},
                          f)
        if args.use_distributed_optimizer:
            updated_parameters(model, args, vocab)
        grads_as_weights(model, captured)
        save_model(os.path.join(args.golden_dir, f"grads_{args.golden_tag}"), model)
        if dist.get_rank() == 0:
            with open(os.path.join(args.golden_dir, f"loss_{args.golden_tag}.json"), "w") as f:
                json.dump({"loss_sum": loss_sum, "tokens": tokens}, f)
        if order:
            name = f"order_{args.golden_tag}_{dist.get_rank()}.json"
            with open(os.path.join(args.golden_dir, name), "w") as f:
                json.dump({"pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                           "pp": args.pipeline_model_parallel_size,
                           "microbatches": num_microbatches, "order": order}, f)
        name = f"groups_{args.golden_tag}_{dist.get_rank()}.json"
        with open(os.path.join(args.golden_dir, name), "w") as f:
            json.dump(placement(model), f)
        hits = {module: dict(counter) for module, counter in cpu_compat.HITS.items()}
        name = f"hits_{args.golden_tag}_{dist.get_rank()}.json"
        with open(os.path.join(args.golden_dir, name), "w") as f:
            json.dump(hits, f)
        return
    # reference: whole documents, one at a time, on a plain single-process model.
    module = model[0].module
    weights = [1.0] * len(docs)
    loss_sum, tokens, grads = weighted_gradients(model, docs, weights)
    reference = {name: grad / tokens for name, grad in grads.items()}
    torch.save({"loss_sum": loss_sum, "tokens": tokens, "grads": reference},
               os.path.join(args.golden_dir, "reference.pt"))
    for size in DEFAULT_LOSS_MICRO_BATCH_SIZES:
        default = default_loss_gradients(model, docs, args.seq_length, size)
        torch.save({"loss_sum": loss_sum, "tokens": tokens, "grads": default},
                   os.path.join(args.golden_dir, f"reference_default_mbs{size}.pt"))
        for cp in DEFAULT_LOSS_CONTEXT_PARALLEL_SIZES:
            torch.save({"loss_sum": loss_sum, "tokens": tokens,
                        "grads": default_loss_gradients(model, docs, args.seq_length, size, cp)},
                       os.path.join(args.golden_dir, f"reference_default_mbs{size}_cp{cp}.pt"))
        if args.golden_aux_loss_coeff:
            save_aux_references(model, docs, args, size, loss_sum, tokens, reference, default)
    initial = {name: p.detach().clone() for name, p in module.named_parameters()}
    for tag in args.golden_tags:
        load_model(os.path.join(args.golden_dir, f"grads_{tag}"), model)
        grads = {name: p.detach().clone() for name, p in module.named_parameters()}
        torch.save(grads, os.path.join(args.golden_dir, f"grads_{tag}.pt"))
        if os.path.isdir(os.path.join(args.golden_dir, f"params_{tag}")):
            expected = reference_step(model, optimizer, initial, grads)
            load_model(os.path.join(args.golden_dir, f"params_{tag}"), model)
            params = {name: p.detach().clone() for name, p in module.named_parameters()}
            torch.save({"initial": initial, "expected": expected, "updated": params},
                       os.path.join(args.golden_dir, f"params_{tag}.pt"))



def save_aux_references(model, docs, args, size: int, loss_sum: float, tokens: int,
                        per_token: dict, default: dict) -> None:
    """The references with Megatron's auxiliary load-balancing loss over the micro-batches of
    ``size`` rows: the per-token loss's gradients ``per_token`` plus the auxiliary term's, and
    Megatron's default loss's (``default``, at that micro-batch size) plus the auxiliary
    term's; at size 1 also both with the loss defined per document
    (``reference_docaux.pt``, ``reference_default_mbs1_docaux.pt``:
    :func:`document_aux_gradients`)."""
    coeff = args.golden_aux_loss_coeff
    if size == 1:
        aux = document_aux_gradients(model, docs, coeff, per_token=True)
        torch.save({"loss_sum": loss_sum, "tokens": tokens,
                    "grads": {name: grad + aux[name] / tokens
                              for name, grad in per_token.items()}},
                   os.path.join(args.golden_dir, "reference_docaux.pt"))
        aux = document_aux_gradients(model, docs, coeff, per_token=False)
        torch.save({"loss_sum": loss_sum, "tokens": tokens,
                    "grads": {name: grad + aux[name] for name, grad in default.items()}},
                   os.path.join(args.golden_dir, "reference_default_mbs1_docaux.pt"))
    aux = aux_loss_gradients(model, docs, args.seq_length, size, coeff, per_token=True)
    torch.save({"loss_sum": loss_sum, "tokens": tokens,
                "grads": {name: grad + aux[name] / tokens for name, grad in per_token.items()}},
               os.path.join(args.golden_dir, f"reference_aux_mbs{size}.pt"))
    aux = aux_loss_gradients(model, docs, args.seq_length, size, coeff, per_token=False)
    torch.save({"loss_sum": loss_sum, "tokens": tokens,
                "grads": {name: grad + aux[name] for name, grad in default.items()}},
               os.path.join(args.golden_dir, f"reference_default_mbs{size}_aux.pt"))


@contextlib.contextmanager
def recording_router_logits(module):
    """For the duration, every MoE router of ``module`` appends the logits of each call,
    ``[tokens, experts]``, to its list in the yielded ``{router: [logits, ...]}``."""
    from megatron.core.transformer.moe.router import TopKRouter

    recorded = {router: [] for router in module.modules() if isinstance(router, TopKRouter)}

    def recording(router, gating):
        def gate(hidden):
            logits = gating(hidden)
            recorded[router].append(logits.reshape(-1, logits.shape[-1]))
            return logits
        return gate

    for router in recorded:
        router.gating = recording(router, router.gating)
    try:
        yield recorded
    finally:
        for router in recorded:
            del router.gating


def switch_balancing_loss(logits: torch.Tensor, topk: int, coeff: float) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss of ``T`` tokens' router ``logits``
    ``[T, E]`` (Megatron's ``aux_loss`` with softmax scores): ``coeff x E`` times the sum over
    the experts of the share of the ``T x topk`` routings each receives times its mean score."""
    scores = torch.softmax(logits.float(), dim=-1)
    routed = torch.zeros_like(scores).scatter(1, scores.topk(topk, dim=1).indices, 1.0)
    count, experts = scores.shape
    share = routed.sum(dim=0) / (count * topk)
    return coeff * experts * torch.sum(share * scores.mean(dim=0))


def aux_loss_gradients(model, docs, seq_length: int, micro_batch_size: int, coeff: float,
                       per_token: bool) -> dict:
    """Gradients of Megatron's auxiliary load-balancing loss over the micro-batches Megatron's
    schedules receive (the project's packing, ``micro_batch_rows``: ``micro_batch_size`` rows
    of ``seq_length`` inputs, padding included, which the router routes like any token), as
    its router computes it per call, summed over the MoE layers: each micro-batch's loss of all
    its tokens' logits, here recorded from each document run alone and from each row's padding
    run alone (the padding is a segment of its own: zeros at positions from 0). Scaled as
    Megatron scales it before its finalize step: by the micro-batch's token count under the
    per-token loss (the gradients are then divided by the step's loss tokens, as the loss's),
    by one over the number of micro-batches under the default loss."""
    model[0].zero_grad_buffer()
    module = model[0].module
    topk = get_model_config(module).moe_router_topk
    lengths = [len(doc) - 1 for doc in docs]
    batches = micro_batch_rows(lengths, seq_length, micro_batch_size)
    for rows in batches:
        pieces = [docs[index] for row in rows for index in row]
        pads = [seq_length - sum(lengths[index] for index in row) for row in rows]
        pieces += [np.zeros(pad + 1, dtype=np.int64) for pad in pads if pad]
        with recording_router_logits(module) as recorded:
            for piece in pieces:
                forward_step(iter([micro_batch([pack_row([piece])])]), module)
        loss = sum(switch_balancing_loss(torch.cat(calls), topk, coeff)
                   for calls in recorded.values())
        (loss * (len(rows) * seq_length if per_token else 1.0 / len(batches))).backward()
    return {name: p.main_grad.detach().clone().view_as(p)
            for name, p in module.named_parameters()}


def document_aux_gradients(model, docs, coeff: float, per_token: bool) -> dict:
    """Gradients of the auxiliary load-balancing loss defined per document (what ``elastic``
    and ``seq1f1b`` run, ``megatron.plugin.layers.document_router``): each document run alone,
    the Switch formula over its own tokens' logits at every MoE layer, summed over the layers;
    weighted by the document's tokens under the per-token loss (the gradients are then divided
    by the step's loss tokens, as the loss's), by one over the number of documents under the
    default loss (one replica)."""
    model[0].zero_grad_buffer()
    module = model[0].module
    topk = get_model_config(module).moe_router_topk
    for doc in docs:
        with recording_router_logits(module) as recorded:
            forward_step(iter([micro_batch([pack_row([doc])])]), module)
        loss = sum(switch_balancing_loss(torch.cat(calls), topk, coeff)
                   for calls in recorded.values())
        (loss * ((len(doc) - 1) if per_token else 1.0 / len(docs))).backward()
    return {name: p.main_grad.detach().clone().view_as(p)
            for name, p in module.named_parameters()}


def updated_parameters(model, args, vocab: int) -> None:
    """After the measured step under the distributed optimizer: save the parameters as the
    next step's forwards find them (``params_<tag>``). Each rank updated its shard of each
    bucket; with ``--overlap-param-gather`` the all-gathers are left to the forward pre-hooks
    of the next step, so a forward-backward over other documents runs first (no optimizer
    step), recording the all-gathers' dispatches and waits against the modules' first forwards
    (``gather_<tag>_<rank>.json``, with the bucket groups whose all-gather is still in
    flight after it)."""
    directory = args.golden_dir
    if args.overlap_param_gather:
        for chunk in model:
            chunk.zero_grad_buffer()
        events: list = []
        with recording_param_gather(model, events) as groups:
            first_step(model, args, vocab)
        chunk = model[0]
        pending = [i for i, group in enumerate([*chunk.bucket_groups,
                                                *chunk.expert_parallel_bucket_groups])
                   if group.param_gather_handle is not None]
        name = f"gather_{args.golden_tag}_{dist.get_rank()}.json"
        with open(os.path.join(directory, name), "w") as f:
            json.dump({"pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                       "bucket_groups": groups, "pending": pending, "events": events}, f)
    save_model(os.path.join(directory, f"params_{args.golden_tag}"), model)


def reference_step(model, optimizer, initial: dict, grads: dict) -> dict:
    """The parameters after Megatron's optimizer, fresh (no state), steps the single-process
    model from ``initial`` once with ``grads`` (the LR scheduler's first learning rate, as in
    the runs' step)."""
    module = model[0].module
    model[0].zero_grad_buffer()
    for name, param in module.named_parameters():
        param.data.copy_(initial[name])
        param.main_grad.copy_(grads[name].view_as(param.main_grad))
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.optimizer.state.clear()
    optimizer.step()
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def weighted_gradients(model, docs, weights):
    """``(loss sum, tokens, gradients of the sum of each document's loss sum times its
    weight)``, every document alone through the single-process model (Megatron DDP's hooks
    accumulate into ``main_grad``; no sync in one process). A document's weight is a number,
    or an array of one weight per input (each token's loss times its own weight)."""
    model[0].zero_grad_buffer()
    module = model[0].module
    loss_sum, tokens = 0.0, 0
    for doc, weight in zip(docs, weights):
        batch = micro_batch([pack_row([doc])])
        if isinstance(weight, np.ndarray):
            batch.loss_weights = torch.from_numpy(weight).view(1, -1)
        output, loss_fn = forward_step(iter([batch]), module)
        doc_loss, doc_tokens, report = loss_fn(output)
        if isinstance(weight, np.ndarray):
            # loss_func returns the weighted sum times the document's token count
            (doc_loss / max(int(doc_tokens), 1)).backward()
        else:
            (doc_loss * weight).backward()
        loss_sum += float(report["lm loss"][0])
        tokens += int(doc_tokens)
    grads = {name: p.main_grad.detach().clone().view_as(p)
             for name, p in module.named_parameters()}
    return loss_sum, tokens, grads


def default_loss_gradients(model, docs, seq_length: int, micro_batch_size: int,
                           context_parallel: int = 1) -> dict:
    """Gradients of Megatron's default loss at one data-parallel rank: the documents grouped
    into the micro-batches Megatron's schedules receive (the project's packing,
    ``micro_batch_rows``), the mean over those micro-batches of each one's token mean,
    computed here from per-document loss sums (each document alone); a micro-batch's tokens are
    its loss tokens (``--eod-mask-loss`` masks the end-of-document inputs).

    With ``context_parallel`` ranks, Megatron's: each row of a micro-batch cut into
    ``2 x context_parallel`` chunks, rank ``r`` holding chunks ``r`` and ``2 x cp - 1 - r`` of
    every row, a micro-batch's loss the mean over the ranks of their shares' token means; here
    each document's tokens take the weight of the share their row positions fall in."""
    lengths = [len(doc) - 1 for doc in docs]
    counted = [loss_tokens(doc) for doc in docs]
    batches = micro_batch_rows(lengths, seq_length, micro_batch_size)
    if context_parallel == 1:
        weights = [0.0] * len(docs)
        for rows in batches:
            members = [index for row in rows for index in row]
            for index in members:
                weights[index] = 1.0 / (sum(counted[i] for i in members) * len(batches))
        return weighted_gradients(model, docs, weights)[2]
    chunk = seq_length // (2 * context_parallel)
    share_of = [min(c, 2 * context_parallel - 1 - c) for c in range(2 * context_parallel)]
    eod = eod_mask_token()
    counts = [np.ones(n) if eod is None else (doc[:-1] != eod).astype(np.float64)
              for doc, n in zip(docs, lengths)]
    weights = [None] * len(docs)
    for rows in batches:
        shares, tokens = {}, np.zeros(context_parallel)
        for row in rows:
            start = 0
            for index in row:
                positions = np.arange(start, start + lengths[index])
                shares[index] = np.array([share_of[p // chunk] for p in positions])
                np.add.at(tokens, shares[index], counts[index])
                start += lengths[index]
        for index, share in shares.items():
            weights[index] = 1.0 / (np.maximum(tokens[share], 1) * context_parallel
                                    * len(batches))
    return weighted_gradients(model, docs, weights)[2]
