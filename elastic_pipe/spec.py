"""``--pipeline-schedule=elastic`` and ``seq1f1b``: plans of document chunks run by the executor.

Per iteration (:mod:`elastic_pipe.planned_batch`, called by the training loop with the global
batch):

1. the documents are spread over the data-parallel replicas so that their predicted costs
   balance (longest-processing-time first, by each document's layer-forward time);
2. each replica's documents are planned -- :func:`~elastic_pipe.scheduler.plan_elastic` for
   ``elastic``, :func:`~elastic_pipe.baselines.seq1f1b` (fixed-size chunks, uniform
   checkpointing) for ``seq1f1b`` -- and lowered to the IR, validated before anything runs.
   Every rank plans (the planner is deterministic: one CP-SAT worker, deterministic time
   limits); the ranks of one replica then compare a digest of their plans and stop with an error
   if they differ, so no rank can run a different schedule from its peers;
3. each chunk becomes one packed row (``[1, tokens]``, padded to a multiple of the TP x CP
   token split): pieces of split documents carry their document key and slice index, so the
   attention records and reads K/V context; whole documents carry none.

The schedule function then runs this rank's actions with
the executor extension :class:`~megatron.plugin.pipeline.chunks.DocumentChunks` (a fresh K/V
store per iteration, the plan's checkpointing table for this stage).

Cost model of a real run: the job's (:mod:`longctx.job_costs`: model shape and bytes per element
from the Megatron flags, ``--hardware-profile``) within ``--elastic-memory-gb`` (default: the
device's memory on CUDA, 16 GB on CPU) minus ``--elastic-reserved-gb`` (default 2 GB on CUDA, 0
on CPU). A measured profile's activation bytes are used only if they were counted in the run's
dtype (otherwise the run stops). The ranks record the executor's forward and backward times
and refit the profile's eq. 1 coefficients and backward factor to them, so that a unit is
priced with what it costs on this device (:mod:`elastic_pipe.run_costs`): by default
(``--elastic-refit-interval auto``) once, from training iterations 2 and 3; with ``K``, every
``K`` iterations; the log shows the fit and its error. The flags and their checks are
:mod:`elastic_pipe.flags`; the drawing of one batch's plan (``build_ir``) is
:mod:`elastic_pipe.drawing`. Megatron's
``--recompute-granularity full`` fixes the plan's checkpointing table
(:mod:`longctx.fixed_checkpointing`; the model itself then recomputes nothing).
"""

from __future__ import annotations

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline.chunks import DocumentChunks
from megatron.plugin.pipeline.layer_checkpoint import leading_layers
from megatron.plugin.executor_call import megatron_process_groups, run_this_rank
from megatron.plugin.pipeline.p2p import neighbour_links
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec

from longctx import fixed_checkpointing, job_costs

from elastic_pipe.batch_flags import missing_flags
from elastic_pipe.drawing import DRAW_ARGUMENTS, plan_builder
from elastic_pipe.flags import add_arguments, check_args
from elastic_pipe.planned_batch import PlannedBatch, input_functions
from elastic_pipe.proofs import (ELASTIC_PROOFS, ELASTIC_REFUSALS, SEQ1F1B_PROOFS,
                                 SEQ1F1B_REFUSALS)
from elastic_pipe.run_costs import MEASURED


def _run(call: RankCall) -> list:
    """This rank's actions of the planned batch, with a fresh K/V store and the plan's
    checkpointing table for this stage."""
    planned = call.input
    groups = megatron_process_groups()
    rank = groups.pp.rank()
    stage = planned.plan.ckpt_table()[rank]
    chunks = DocumentChunks(kv_store=KVStore(), layers=leading_layers(call.model),
                            checkpointed=stage.__getitem__, slices=planned.slices.__getitem__)
    events = [] if planned.refit and not call.forward_only else None
    result = run_this_rank(planned.schedule, groups, call, data_iterator=iter(planned.batches),
                           shape_of=planned.shape_of, extensions=[chunks], events=events,
                           links=neighbour_links, predicted=planned.predicted)
    if events is not None:
        MEASURED.record(planned, rank, events)
    elif not call.forward_only:
        MEASURED.ran()
    return result


def _report(planned: PlannedBatch) -> dict:
    return {"planned_activation_bytes": planned.planned_activation_bytes,
            "plan_solve_s": planned.timing.solve_s, "plan_wait_s": planned.timing.waited_s}


#: The accepted values that run something other than they name under elastic and seq1f1b.
SUBSTITUTIONS = (fixed_checkpointing.SUBSTITUTION,)


def _spec(name: str, proofs: dict, refusals: dict) -> ScheduleSpec:
    prepare_input, prefetch_input = input_functions(name)
    return ScheduleSpec(name, run=_run, input_type=PlannedBatch,
                        argument_groups=(job_costs.add_arguments, add_arguments),
                        check_args=check_args, plans_recomputation=True,
                        prepare_input=prepare_input, prefetch_input=prefetch_input,
                        report=_report, build_ir=plan_builder(name),
                        draw_arguments=DRAW_ARGUMENTS, draw_units=False,
                        substitutions=SUBSTITUTIONS, draw_missing=missing_flags,
                        proofs=proofs, refusals=refusals)


ELASTIC = _spec("elastic", ELASTIC_PROOFS, ELASTIC_REFUSALS)
SEQ1F1B = _spec("seq1f1b", SEQ1F1B_PROOFS, SEQ1F1B_REFUSALS)
