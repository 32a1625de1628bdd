"""``1f1b-ir``: Megatron's non-interleaved 1F1B as IR, run by the executor.

The executor's proof: the same per-rank order as Megatron's warmup / steady / cooldown loop
(:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`), transfers added by
:func:`~megatron.plugin.pipeline.passes.add_communication`, validated once per
``(pp, micro-batches)`` before anything runs, then interpreted by
:func:`~megatron.plugin.pipeline.executor.run_schedule`. Transfers carry Megatron's fixed
``[seq/TP (with SP), micro-batch, hidden]`` activation shape.

:func:`single_model_chunk` and :func:`run_this_rank` are the glue every IR schedule shares
between Megatron's forward-backward arguments and the executor (``elastic``, ``seq1f1b`` and
``sppo`` use them too).
"""
from __future__ import annotations

import functools

from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron.plugin.pipeline import tracing
from megatron.plugin.pipeline.executor import StageContext, run_schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.validation import validate
from megatron.plugin.registry import register_schedule


@functools.lru_cache(maxsize=64)
def planned_1f1b(pp: int, microbatches: int):
    """Validated 1F1B schedule with transfers (cached: it depends on two numbers only)."""
    schedule = add_communication(one_f_one_b(pp, microbatches))
    validate(schedule)
    return schedule


def megatron_process_groups() -> ProcessGroupCollection:
    """The groups Megatron's own schedules use, from ``parallel_state``."""
    return ProcessGroupCollection.use_mpu_process_groups(
        required_pgs=["tp", "cp", "pp", "embd", "pos_embd", "dp", "dp_cp", "mp"])


def single_model_chunk(name: str, model, data_iterator):
    """``(model, data_iterator)`` of the one model chunk an IR schedule runs per rank."""
    if isinstance(model, list):
        if len(model) != 1:
            raise ValueError(f"{name} runs one model chunk per rank: drop "
                             f"--num-layers-per-virtual-pipeline-stage or use 'interleaved'")
        model = model[0]
    if isinstance(data_iterator, list):
        data_iterator = data_iterator[0]
    return model, data_iterator


def run_this_rank(schedule, groups: ProcessGroupCollection, *, forward_step_func,
                  data_iterator, model, num_microbatches, shape_of, forward_only,
                  collect_non_loss_data, first_val_step, chunks=None, program=None,
                  offload=None, events: list | None = None) -> list:
    """Run this pipeline rank's row of ``schedule`` with Megatron's forward-backward
    arguments, under the configured timeout, and record its trace (also appended to
    ``events`` when given, with device times); returns the loss dicts."""
    pp, rank = groups.pp.size(), groups.pp.rank()
    ctx = StageContext(
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, shape_of=shape_of, pp_group=groups.pp,
        pg_collection=groups, is_first_stage=rank == 0, is_last_stage=rank == pp - 1,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step, timeout_s=tracing.settings().timeout_s, chunks=chunks,
        program=program, offload=offload, device_times=events is not None)
    result = run_schedule(schedule[rank], ctx)
    tracing.record(ctx.events)
    if events is not None:
        events.extend(ctx.events)
    return result


def forward_backward_1f1b_ir(*, forward_step_func, data_iterator, model, num_microbatches,
                             seq_length, micro_batch_size, decoder_seq_length=None,
                             forward_only=False, collect_non_loss_data=False,
                             first_val_step=None, **unused):
    """Megatron forward-backward signature; see the module docstring."""
    del unused
    model, data_iterator = single_model_chunk("1f1b-ir", model, data_iterator)
    groups = megatron_process_groups()
    shape = megatron_schedules.get_tensor_shapes(
        seq_length=seq_length, micro_batch_size=micro_batch_size,
        decoder_seq_length=decoder_seq_length, config=get_model_config(model),
        tp_group=groups.tp, cp_group=groups.cp)[0]
    return run_this_rank(
        planned_1f1b(groups.pp.size(), num_microbatches), groups,
        forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
        num_microbatches=num_microbatches, shape_of=lambda action: shape,
        forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        first_val_step=first_val_step)


register_schedule("1f1b-ir", forward_backward_1f1b_ir)
