"""The training loop behind ``pretrain_gpt_elastic.py`` (Megatron-LM's ``pretrain`` on mcore).

One iteration: draw ``--global-batch-size`` documents (seeded, resumable), hand them to the
schedule selected with ``--pipeline-schedule`` through Megatron's ``get_forward_backward_func``,
step Megatron's optimizer and LR scheduler, log a Megatron-style line, and optionally write
metrics, evaluate and save. Megatron's own schedules receive the documents packed into
``--seq-length`` micro-batches with document boundaries; document-level schedules receive the
documents themselves (see :func:`schedule_input`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import schedules as megatron_schedules

from megatron.plugin import checkpointing, cpu_compat, registry
from megatron.plugin.arguments import validate_args
from megatron.plugin.batches import forward_step, pack_micro_batches
from megatron.plugin.memory import SavedTensorMeter, device_peak_bytes
from megatron.plugin.model import build_model_chunks, transformer_config
from megatron.plugin.pipeline import tracing
from megatron.plugin.sources import build_document_sources

logger = logging.getLogger(__name__)


def log_rank_last(message: str) -> None:
    """Megatron-LM's ``print_rank_last``: user-facing lines come from the last rank.

    Lines go through the ``megatron.plugin.training`` logger at INFO level; the training script
    routes it to stdout without a prefix, so they read like Megatron-LM's.
    """
    if dist.get_rank() == dist.get_world_size() - 1:
        logger.info("%s", message)


def log_rank_0(message: str) -> None:
    if dist.get_rank() == 0:
        logger.info("%s", message)


def initialize_distributed(args: argparse.Namespace) -> None:
    """Process group, CPU compatibility, argument checks against the world size, model
    parallel groups and seeds (Megatron-LM's ``seed + 100 x pipeline rank``)."""
    cuda = torch.cuda.is_available()
    if args.distributed_backend is None:
        args.distributed_backend = "nccl" if cuda else "gloo"
    backend = args.distributed_backend
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            backend, timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes))
    if not cuda:
        cpu_compat.install()
        if args.bf16 or args.fp16 or args.use_distributed_optimizer:
            raise ValueError(
                "--bf16, --fp16 and --use-distributed-optimizer need CUDA (megatron-core's "
                "mixed-precision and distributed optimizers only wrap CUDA tensors): drop them "
                "on a machine without a GPU")
    validate_args(args, dist.get_world_size())
    vp = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        vp = args.num_layers // args.pipeline_model_parallel_size \
            // args.num_layers_per_virtual_pipeline_stage
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=args.context_parallel_size,
    )
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(seed)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)


def setup_model_and_optimizer(args, vocab_size):
    """Megatron DDP-wrapped model chunks, Megatron optimizer and LR scheduler."""
    config = transformer_config(args)
    chunks = build_model_chunks(args, config, vocab_size)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
             for i, chunk in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=config.params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
    ), model)
    decay_iters = args.lr_decay_iters or args.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters, 1), wd_incr_style="constant",
        wsd_decay_steps=decay_iters if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if args.lr_decay_style == "WSD" else None,
    )
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
    else:
        config.no_sync_func = [m.no_sync for m in model]
    return model, optimizer, scheduler, config


def setup_job(args):
    """Process groups, data sources, model, optimizer and LR scheduler of one run:
    ``(sources, model, optimizer, scheduler, config)`` (the Trainer and the benchmarks)."""
    initialize_distributed(args)
    sources, vocab_size = build_document_sources(args)
    model, optimizer, scheduler, config = setup_model_and_optimizer(args, vocab_size)
    return sources, model, optimizer, scheduler, config


def timed_step(model, optimizer, config, args, documents, meter: SavedTensorMeter):
    """One training step between barriers, under ``meter`` (the benchmarks): ``(result,
    wall seconds, every rank's peak saved-activation bytes)``.

    The schedule's input is prepared (for ``elastic`` and ``seq1f1b``: the batch planned)
    before the timed span, because a training run prepares it off the critical path (the
    background planner); the preparation's wall seconds are in ``result["prepare_s"]``.
    """
    schedule_fn = megatron_schedules.get_forward_backward_func()
    start = time.perf_counter()
    prepared = schedule_input(schedule_fn, documents, args, model)
    prepare_s = time.perf_counter() - start
    meter.reset_peak()
    dist.barrier()
    start = time.perf_counter()
    with meter.active():
        result = step(model, optimizer, config, args, documents, prepared=prepared)
    dist.barrier()
    took = time.perf_counter() - start
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([float(meter.peak)], dtype=torch.float64))
    return dict(result, prepare_s=prepare_s), took, [int(p.item()) for p in peaks]


def schedule_input(schedule_fn, documents, args, model):
    """What the schedule consumes: ``(data_iterator, num_microbatches)``.

    A schedule function with a ``prepare_input(documents, args, model)`` attribute receives
    the documents (document-level schedules plan them). Megatron's own schedules get this data-
    parallel rank's share of packed ``--seq-length`` micro-batches; every model chunk (virtual
    stage) iterates over the same micro-batches.
    """
    prepare = getattr(schedule_fn, "prepare_input", None)
    if prepare is not None:
        return prepare(documents, args, model)
    dp = parallel_state.get_data_parallel_world_size()
    batches = pack_micro_batches(documents, args.seq_length, args.micro_batch_size, dp)
    mine = batches[parallel_state.get_data_parallel_rank()::dp]
    if len(model) == 1:
        return iter(mine), len(mine)
    return [iter(mine) for _ in model], len(mine)


def reduce_losses(losses_reduced) -> tuple[float, float]:
    """Global ``(loss_sum, tokens)`` of one step from the loss dicts of the stage that computes
    the loss (the last one, or stage 0 under helix); every rank gets them."""
    totals = torch.zeros(2, dtype=torch.float64)
    for report in losses_reduced:
        totals += report["lm loss"].detach().to("cpu", torch.float64)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dist.all_reduce(totals, group=group)
    # One pipeline stage holds the loss, the others add zeros: share it with every stage.
    dist.all_reduce(totals, group=parallel_state.get_pipeline_model_parallel_group())
    return float(totals[0]), float(totals[1])


def step(model, optimizer, config, args, documents, forward_only=False, next_documents=None,
         prepared=None):
    """One forward-backward over the documents (plus optimizer step unless forward_only).

    ``next_documents`` (the next training batch) goes to a schedule's ``prefetch_input`` when it
    has one, so that it can plan that batch while this one runs. ``prepared``: what
    :func:`schedule_input` returned for ``documents``, when the caller made it already.
    """
    schedule_fn = megatron_schedules.get_forward_backward_func()
    if prepared is None:
        prepared = schedule_input(schedule_fn, documents, args, model)
    data_iterator, num_microbatches = prepared
    prefetch = getattr(schedule_fn, "prefetch_input", None)
    if prefetch is not None and next_documents is not None:
        prefetch(next_documents, args, model)
    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    losses = schedule_fn(
        forward_step_func=forward_step, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, forward_only=forward_only,
    )
    loss_sum, tokens = reduce_losses(losses)
    result = {"loss_sum": loss_sum, "tokens": tokens, "num_microbatches": num_microbatches}
    timing = getattr(data_iterator, "timing", None)
    if timing is not None:
        result.update(plan_solve_s=timing.solve_s, plan_wait_s=timing.waited_s)
    planned = getattr(data_iterator, "planned_activation_bytes", None)
    if planned is not None:
        result["planned_activation_bytes"] = planned
    if not forward_only:
        ok, grad_norm, _ = optimizer.step()
        result.update(update_successful=ok, grad_norm=grad_norm)
    return result


class Trainer:
    """Owns the model, optimizer, scheduler, data and logging of one training run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sources, self.model, self.optimizer, self.scheduler, self.config = setup_job(args)
        registry.use_schedule(args.pipeline_schedule)
        tracing.configure(args.pipeline_timeout_s, args.trace_dir)
        self.iteration = 0
        if args.load:
            self.iteration, _ = checkpointing.load_checkpoint(
                args.load, self.model, self.optimizer, self.scheduler)
            log_rank_0(f" loaded checkpoint from {args.load} at iteration {self.iteration}")
        self.meter = SavedTensorMeter()
        self.tensorboard = None
        if args.tensorboard_dir and dist.get_rank() == dist.get_world_size() - 1:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise SystemExit("--tensorboard-dir needs the 'tensorboard' package: "
                                 "pip install tensorboard, or drop the flag") from err
            self.tensorboard = SummaryWriter(log_dir=args.tensorboard_dir)

    def train(self) -> list[float]:
        """Run ``--train-iters`` iterations; returns the lm losses (every rank)."""
        args = self.args
        losses = []
        metrics = None
        if args.metrics_jsonl and dist.get_rank() == dist.get_world_size() - 1:
            metrics = open(args.metrics_jsonl, "a")
        try:
            while self.iteration < args.train_iters:
                losses.append(self._train_iteration(metrics))
                saved = False
                if args.save and args.save_interval and self.iteration % args.save_interval == 0:
                    self.save()
                    saved = True
                if args.eval_interval and args.eval_iters and \
                        self.iteration % args.eval_interval == 0:
                    self.evaluate()
                if args.exit_interval and self.iteration % args.exit_interval == 0:
                    if args.save and not saved:
                        self.save()
                    log_rank_0(f" exiting program at iteration {self.iteration}")
                    return losses
            if args.save and (not args.save_interval or self.iteration % args.save_interval):
                self.save()
        finally:
            if metrics is not None:
                metrics.close()
        return losses

    def _train_iteration(self, metrics) -> float:
        args = self.args
        documents = self.sources["train"].documents(self.iteration)
        self.meter.reset_peak()
        for chunk in self.model:
            chunk.train()
        start = time.perf_counter()
        upcoming = None
        if self.iteration + 1 < args.train_iters:
            upcoming = self.sources["train"].documents(self.iteration + 1)
        with self.meter.active():
            result = step(self.model, self.optimizer, self.config, args, documents,
                          next_documents=upcoming)
        self.scheduler.step(increment=1)
        elapsed = time.perf_counter() - start
        self.iteration += 1
        # Peak, and bytes still saved after the step (0 unless something leaks), over ranks;
        # then per pipeline stage the measured peak and the plan's prediction (if any).
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        held = torch.zeros(2 + 2 * pp, dtype=torch.float64)
        held[0], held[1], held[2 + stage] = self.meter.peak, self.meter.current, self.meter.peak
        planned = result.get("planned_activation_bytes")
        if planned is not None:
            held[2 + pp + stage] = planned
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        loss = result["loss_sum"] / max(result["tokens"], 1.0)
        record = {
            "iteration": self.iteration,
            "lm_loss": loss,
            "num_tokens": int(result["tokens"]),
            "iteration_time_s": elapsed,
            "tokens_per_s": result["tokens"] / elapsed if elapsed > 0 else 0.0,
            "peak_activation_bytes": int(held[0]),
            "peak_activation_bytes_per_stage": [int(b) for b in held[2:2 + pp]],
            "live_activation_bytes": int(held[1]),
            "num_microbatches": result["num_microbatches"],
            "grad_norm": result["grad_norm"],
            "learning_rate": self.optimizer.param_groups[0]["lr"],
        }
        for key in ("plan_solve_s", "plan_wait_s"):
            if key in result:
                record[key] = result[key]
        if planned is not None:
            record["planned_activation_bytes_per_stage"] = [int(b) for b in held[2 + pp:]]
        device_peak = device_peak_bytes()
        if device_peak is not None:
            record["device_peak_bytes"] = device_peak
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if self.tensorboard is not None:
            for key in ("lm_loss", "tokens_per_s", "peak_activation_bytes", "grad_norm"):
                self.tensorboard.add_scalar(key, record[key], self.iteration)
        if self.iteration % args.log_interval == 0 or self.iteration == 1:
            log_rank_last(self._log_line(record, len(documents)))
        return loss

    def _log_line(self, record, num_documents) -> str:
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        grad_norm = record["grad_norm"]
        return (
            f" [{now}] iteration {self.iteration:8d}/{self.args.train_iters:8d} |"
            f" consumed documents: {self.iteration * self.args.global_batch_size:12d} |"
            f" elapsed time per iteration (ms): {1000 * record['iteration_time_s']:.1f} |"
            f" learning rate: {record['learning_rate']:.6E} |"
            f" global batch size: {num_documents:5d} |"
            f" lm loss: {record['lm_loss']:.6E} |"
            f" grad norm: {grad_norm if grad_norm is not None else float('nan'):.3f} |"
            f" tokens per second: {record['tokens_per_s']:.1f} |"
            f" peak activation bytes: {record['peak_activation_bytes']} |"
            + (f" planned: {max(record['planned_activation_bytes_per_stage'])} |"
               if "planned_activation_bytes_per_stage" in record else "")
            + (f" plan solve / wait (ms): {1000 * record['plan_solve_s']:.1f} /"
               f" {1000 * record['plan_wait_s']:.1f} |" if "plan_solve_s" in record else "")
        )

    def evaluate(self) -> float:
        """Forward-only over ``--eval-iters`` batches of the validation split."""
        source = self.sources.get("valid")
        if source is None or len(source) == 0:
            return float("nan")
        for chunk in self.model:
            chunk.eval()
        loss_sum = tokens = 0.0
        with torch.no_grad():
            for i in range(self.args.eval_iters):
                result = step(self.model, self.optimizer, self.config, self.args,
                              source.documents(i), forward_only=True)
                loss_sum += result["loss_sum"]
                tokens += result["tokens"]
        loss = loss_sum / max(tokens, 1.0)
        ppl = math.exp(min(20.0, loss))
        log_rank_last("-" * 100)
        log_rank_last(f" validation loss at iteration {self.iteration} | lm loss value: "
                      f"{loss:.6E} | lm loss PPL: {ppl:.6E} |")
        log_rank_last("-" * 100)
        return loss

    def save(self) -> None:
        path = checkpointing.save_checkpoint(self.args.save, self.iteration, self.model,
                                             self.optimizer, self.scheduler)
        log_rank_0(f" saved checkpoint at iteration {self.iteration} to {path}")


def pretrain(args: argparse.Namespace) -> list[float]:
    """Entry point used by ``pretrain_gpt_elastic.py``."""
    try:
        losses = Trainer(args).train()
    except BaseException:
        # No barrier: a peer may be blocked in a transfer this rank will never make. Exiting
        # lets the launcher stop the other ranks at once instead of after the comm timeout.
        parallel_state.destroy_model_parallel()
        raise
    shutdown_distributed()
    return losses


def shutdown_distributed() -> None:
    """Tear the groups down after a successful run, on every rank.

    Exiting with the process group alive lets gloo's worker threads outlive the interpreter;
    the C++ runtime then aborts the process now and then ("terminate called without an active
    exception") after all the work is done. The barrier keeps a fast rank from destroying the
    group while a peer still uses it.
    """
    parallel_state.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
