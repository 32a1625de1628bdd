"""Megatron's data-parallel gradient synchronisation as the executor drives it.

Megatron's DDP (``megatron.core.distributed``) keeps the gradients in buckets. With
``--overlap-grad-reduce`` a parameter's backward hook counts it ready only while gradient sync is
enabled (outside ``no_sync_func``); in a training step after the first, a bucket's reduction
starts from the hook that makes every count of its parameters equal to the counts the first step
recorded, while the backward goes on with the other buckets. The executor keeps sync disabled
(:meth:`GradSync.disable`) until right before the rank's last backward, as Megatron's 1F1B does:
every parameter of a whole-stage unit gets its last gradient in that backward (one autograd call,
or two around a checkpoint boundary), so the counts are those of one backward and the
reduction of a bucket starts once its parameters' gradients of the whole step are in.

The schedules' gradients that are not a plain backward of a unit reach the parameters through
the same hooks, inside the backward action that produces them: the K/V store's context
gradients are activation gradients, consumed by the backward of an earlier slice; SPPO's
multiplexed owner hands its helpers' weight gradients to autograd with its parameters as roots
within the backward of its share, so those parameters count twice in every step and their
bucket starts after the second. Helix runs each layer part's backward apart, and every backward
of a part touches the same parameters, so each parameter's last gradient of the step comes in
the last backward of some part: those backwards run with sync enabled and the others without
(:meth:`~megatron.plugin.pipeline.parts.Parts.grad_sync_backwards`), and a bucket's reduction
starts in the last of them that holds its parameters, before the rank's last backward.

A step whose counts differ from the first step's would have started a bucket's reduction
before its last gradient was in, or never: :meth:`GradSync.check_ready_counts` refuses it
(unless the reduction did not start and the end of the step starts it: a rank without a
backward in this step). With one distributed-optimizer instance a started reduction leaves its
handle on the bucket group. With several (``--num-distributed-optimizer-instances``) Megatron
runs the reduce-scatter and the instances' all-reduce synchronously on a communication stream of
its own and keeps no handle; the counts tell instead: they only grow, and the hooks start the
reduction when they equal the first step's, so a step whose counts reached every count of the
first step's and went past may have started it early, and is refused (one in which some count
stays short never started it).

Megatron's end-of-step start (``grad_sync_func``, each model chunk's ``start_grad_sync``) runs
on the pipeline stages that kept sync disabled through their last backward (with
``--align-grad-reduce``, Megatron's default: every stage after the first). Their buckets count
no hooks, so they stay in their first step for good, and in the first step ``finish_grad_sync``
starts a bucket's reduction itself. With one instance that second start finds the handle of the
first and does nothing; with several it dispatches the reduce-scatter and the all-reduce again,
and a sum (``--calculate-per-token-loss``) comes out doubled on every stage after the first,
under Megatron's own schedules as under these. :func:`one_start_per_step` runs every schedule
with a ``grad_sync_func`` that leaves such buckets to ``finish_grad_sync``.
"""
from __future__ import annotations

import contextlib


class GradSync:
    """Megatron's ``disable_grad_sync`` / ``enable_grad_sync`` pair over ``model`` (one DDP model
    chunk), and the check of its buckets' grad-ready counts."""

    def __init__(self, config, model):
        self.no_sync = config.no_sync_func or contextlib.nullcontext
        self.context = None
        ddp = getattr(model, "ddp_config", None)
        self.bucket_groups = [] if ddp is None or not ddp.overlap_grad_reduce else \
            _bucket_groups(model)

    def disable(self):
        if self.context is None:
            self.context = self.no_sync()
            self.context.__enter__()

    def enable(self):
        if self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None

    def check_ready_counts(self, rank: int, started_at_end: bool) -> None:
        """After the last backward, before the end of the step (which starts every bucket's
        reduction when ``started_at_end``): refuse a step after the first in which a bucket's
        grad-ready counts differ from the first step's and either its reduction started from
        the hooks (then before a gradient the counts do not expect: its handle is set, or the
        counts went past every count of the first step's) or nothing would start it."""
        for index, group in enumerate(self.bucket_groups):
            counts, golden = group.per_param_grad_ready_counts, \
                group.golden_per_param_grad_ready_counts
            if group.is_first_batch or counts == golden:
                continue
            started = group.grad_reduce_handle is not None or \
                all(counts.get(p, 0) >= n for p, n in golden.items())
            if not started and started_at_end:
                continue
            off = sum(1 for p in group.params if counts.get(p, 0) != golden.get(p, 0))
            raise RuntimeError(
                f"pipeline rank {rank}: {off} of the {len(group.params)} parameters of gradient "
                f"bucket group {index} took their gradients in this step's last backward a "
                f"different number of times than in the first step, so Megatron's DDP started "
                f"(or may have started) the bucket's reduction before its last gradient was "
                f"in, or never: drop --overlap-grad-reduce for this schedule and model")


def _bucket_groups(chunk) -> list:
    return [*chunk.bucket_groups, *chunk.expert_parallel_bucket_groups]


@contextlib.contextmanager
def one_start_per_step(config):
    """For the duration, with several distributed-optimizer instances, each model chunk's
    ``config.grad_sync_func`` (Megatron-LM's ``start_grad_sync`` of the chunk, as its ``train()``
    sets it) starts only the buckets past their first step: ``finish_grad_sync`` starts the
    others (see the module docstring)."""
    funcs = config.grad_sync_func
    chunks = [getattr(func, "__self__", None) for func in
              (funcs if isinstance(funcs, list) else [funcs])]
    if funcs is None or any(getattr(chunk, "ddp_config", None) is None for chunk in chunks) \
            or chunks[0].ddp_config.num_distributed_optimizer_instances == 1:
        yield
        return

    def starting(chunk):
        def start_grad_sync(*unused):
            for group in _bucket_groups(chunk):
                if not group.is_first_batch:
                    group.start_grad_sync()
        return start_grad_sync

    starts = [starting(chunk) for chunk in chunks]
    config.grad_sync_func = starts if isinstance(funcs, list) else starts[0]
    try:
        yield
    finally:
        config.grad_sync_func = funcs
