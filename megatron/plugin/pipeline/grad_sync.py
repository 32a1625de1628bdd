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
bucket starts after the second. Helix refuses the overlap (its last backward holds one layer
part's parameters: :mod:`megatron.plugin.option_classes`).

A step whose counts differ from the first step's would have started a bucket's reduction
before its last gradient was in, or never: :meth:`GradSync.check_ready_counts` refuses it
(unless the reduction did not start and the end of the step starts it: a rank without a
backward in this step).
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
        self.bucket_groups = [] if ddp is None or not ddp.overlap_grad_reduce else [
            *model.bucket_groups, *model.expert_parallel_bucket_groups]

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
        the hooks (then before a gradient the counts do not expect) or nothing would start it."""
        for index, group in enumerate(self.bucket_groups):
            counts, golden = group.per_param_grad_ready_counts, \
                group.golden_per_param_grad_ready_counts
            if group.is_first_batch or counts == golden or \
                    (group.grad_reduce_handle is None and started_at_end):
                continue
            off = sum(1 for p in group.params if counts.get(p, 0) != golden.get(p, 0))
            raise RuntimeError(
                f"pipeline rank {rank}: {off} of the {len(group.params)} parameters of gradient "
                f"bucket group {index} took their gradients in this step's last backward a "
                f"different number of times than in the first step, so Megatron's DDP started "
                f"the bucket's reduction before its last gradient was in, or never: drop "
                f"--overlap-grad-reduce for this schedule and model")
