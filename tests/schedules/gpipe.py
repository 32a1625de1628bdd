"""A schedule from outside the source tree, registered through the schedule contract alone
(``ScheduleSpec``): GPipe's order, every micro-batch's forward on every stage, then every
backward in the same order, run by the executor over Megatron's packed micro-batches.

Nothing in the project names it: a run registers it with
``LONGCTX_SCHEDULES=tests.schedules.gpipe:SPEC`` (with the repository on ``PYTHONPATH``); the
tests draw it with ``scripts/show_schedule.py``, price and validate it, and train it to the
single-process reference gradients (``tests/distributed/test_golden_megatron.py``).
"""
from megatron.plugin.pipeline.catalog import Built, Options
from megatron.plugin.pipeline.ir import Action, Kind, Schedule
from megatron.plugin.pipeline.passes import add_communication
from megatron.plugin.executor_call import run_over_packed
from megatron.plugin.option_classes import DROPOUT, MODEL, each
from megatron.plugin.pipeline.simulator import UniformCosts
from megatron.plugin.pipeline.validation import validate
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec


def gpipe(pp: int, microbatches: int) -> Schedule:
    """Validated GPipe order with transfers."""
    if pp < 1 or microbatches < 1:
        raise ValueError(f"GPipe needs pp >= 1 and micro-batches >= 1, got {pp}, {microbatches}")
    order = [[Action(rank, kind, unit) for kind in (Kind.FORWARD, Kind.BACKWARD)
              for unit in range(microbatches)] for rank in range(pp)]
    schedule = add_communication(order, num_stages=pp)
    validate(schedule)
    return schedule


def build_ir(pp: int, microbatches: int, options: Options) -> Built:
    return Built(gpipe(pp, microbatches), UniformCosts(
        forward=options.forward, backward=options.backward, transfer=options.transfer))


def run(call: RankCall) -> list:
    return run_over_packed(call, gpipe)


#: What it honours: the model's shape, the batch and its micro-batches, proved by the golden
#: layout that trains it (any other option is refused under it).
PROOFS = {**each((*MODEL, "micro_batch_size"), "golden:pp2_gpipe_outside"),
          **each(DROPOUT, "golden:pp2_dropout_gpipe_outside")}

SPEC = ScheduleSpec("gpipe", run=run, build_ir=build_ir, proofs=PROOFS)
