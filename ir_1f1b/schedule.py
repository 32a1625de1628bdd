"""``1f1b-ir``: Megatron's non-interleaved 1F1B as IR, run by the executor.

The executor's proof: the same per-rank order as Megatron's warmup / steady / cooldown loop
(:func:`~megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`), transfers added by
:func:`~megatron.plugin.pipeline.passes.add_communication`, validated once per
``(pp, micro-batches)`` before anything runs, then interpreted by
:func:`~megatron.plugin.pipeline.executor.run_schedule`. Its input is Megatron's packed
``--seq-length`` micro-batches; transfers carry Megatron's fixed
``[seq/TP (with SP), micro-batch, hidden]`` activation shape.
"""
from __future__ import annotations

import functools

from megatron.plugin.pipeline.catalog import one_f_one_b_ir
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.executor_call import run_over_packed
from megatron.plugin.pipeline.schedule_1f1b import one_f_one_b
from megatron.plugin.pipeline.validation import validate
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from ir_1f1b.proofs import PROOFS, REFUSALS


@functools.lru_cache(maxsize=64)
def planned_1f1b(pp: int, microbatches: int):
    """Validated 1F1B schedule with transfers (cached: it depends on two numbers only)."""
    schedule = add_communication(one_f_one_b(pp, microbatches))
    validate(schedule)
    return schedule


def run(call: RankCall) -> list:
    return run_over_packed(call, planned_1f1b)


SPEC = ScheduleSpec("1f1b-ir", run=run, build_ir=one_f_one_b_ir, proofs=PROOFS,
                    refusals=REFUSALS)
