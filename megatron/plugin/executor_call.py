"""Run this rank's row of an IR schedule with Megatron's forward-backward arguments: the glue
between a :class:`~megatron.plugin.schedule_spec.RankCall` and the executor that every IR
schedule (``1f1b-ir``, ``elastic``, ``seq1f1b``, ``helix``, ``sppo``) shares."""
from __future__ import annotations

from typing import Callable

from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron.plugin.pipeline import p2p, run_settings
from megatron.plugin.pipeline.executor import run_schedule
from megatron.plugin.pipeline.stage_context import StageContext
from megatron.plugin.schedule_spec import RankCall


def megatron_process_groups() -> ProcessGroupCollection:
    """The groups Megatron's own schedules use, from ``parallel_state``."""
    return ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp", "mp"])


def run_over_packed(call: RankCall, schedule_for) -> list:
    """Run ``schedule_for(pp, micro-batches)`` (a validated schedule with transfers) over
    Megatron's packed micro-batches (``call.input``), transfers carrying Megatron's fixed
    activation shape ``[seq/TP (with SP), micro-batch, hidden]``."""
    groups = megatron_process_groups()
    shape = megatron_schedules.get_tensor_shapes(
        seq_length=call.seq_length, micro_batch_size=call.micro_batch_size,
        decoder_seq_length=call.decoder_seq_length, config=get_model_config(call.model),
        tp_group=groups.tp, cp_group=groups.cp)[0]
    return run_this_rank(schedule_for(groups.pp.size(), call.num_microbatches), groups, call,
                         data_iterator=call.input, shape_of=lambda action: shape,
                         links=p2p.neighbour_links)


def run_this_rank(schedule, groups: ProcessGroupCollection, call: RankCall, *, data_iterator,
                  shape_of, extensions=(), events: list | None = None,
                  links: Callable[[int], p2p.Links] = p2p.every_link,
                  predicted=()) -> list:
    """Run this pipeline rank's row of ``schedule`` for ``call`` with the schedule's
    ``extensions``, reading units from ``data_iterator``, its transfers on the ``links(pp)`` it
    declares (checked first), under the configured timeout, and record its trace (also
    appended to ``events`` when given, with device times) beside the ``predicted`` timeline
    of its plan; returns the loss dicts."""
    pp, rank = groups.pp.size(), groups.pp.rank()
    declared = links(pp)
    p2p.check_links(schedule, declared)
    ctx = StageContext(
        forward_step_func=call.forward_step_func, data_iterator=data_iterator,
        model=call.model, num_microbatches=call.num_microbatches, shape_of=shape_of,
        pp_group=groups.pp, pg_collection=groups, is_first_stage=rank == 0,
        is_last_stage=rank == pp - 1, forward_only=call.forward_only,
        collect_non_loss_data=call.collect_non_loss_data, first_val_step=call.first_val_step,
        timeout_s=run_settings.settings().timeout_s, links=declared,
        extensions=list(extensions),
        device_times=events is not None)
    result = run_schedule(schedule[rank], ctx)
    run_settings.record(ctx.events, predicted)
    if events is not None:
        events.extend(ctx.events)
    return result
