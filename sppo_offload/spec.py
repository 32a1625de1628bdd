"""``--pipeline-schedule=sppo``: SPPO's subsequence pipeline with adaptive offloading, trained.

Per iteration (:func:`~sppo_offload.subsequence_batch.prepare_input`, called by the training
loop with the global batch):

1. the documents are spread over the data-parallel replicas by predicted cost
   (:func:`~longctx.replicas.replica_share`);
2. every document of this replica's share wants ``N`` FLOPs-balanced subsequences
   (:func:`~sppo_offload.partition.balanced_lengths` with the job's cost-model coefficients).
   ``N`` is ``--sppo-subsequences``, or with ``auto`` the smallest count the solver considers
   for the job's layout (:func:`~sppo_offload.solver.subsequence_counts`): the fewest
   subsequences, at least ``PP``, whose tokens per device (``S / (N x TP x CP)``) stay within
   the solver's 16K band top -- ``N = PP`` for every document shorter than that, as in the
   tiny CPU runs. The longest of those subsequences is the batch's unit length: documents
   no longer than it are packed whole into rows of at most that many tokens, and a longer
   document is cut into no more subsequences than keep them about that long
   (:func:`~sppo_offload.batch_plan.plan_subsequences`; the paper is about one long sequence).
   Under ``auto`` (with ``--sppo-offload auto`` or ``off`` and no ``--sppo-multiplex``, which
   ask for no cut), Megatron-LM's own micro-batches of the same documents are the other
   candidate (:func:`~sppo_offload.batch_plan.megatron_plan`): the simulator prices both with
   each unit's fixed cost, and Megatron's are planned where they fit and are predicted no
   slower (:func:`~sppo_offload.batch_plan.fastest_plan`), so a batch runs in more units than
   Megatron's only where the pipeline's overlap pays for them;
3. each subsequence is one unit: one packed row (padded to a multiple of the TP x CP token
   split) whose piece records its K/V and reads those of the document's earlier subsequences
   (the K/V-context execution of the elastic schedule's split chunks); a row of packed whole
   documents is one unit too, each document attending within itself;
4. one pipeline over all the share's units (:mod:`sppo_offload.pipeline`, several
   sequences: a cut document, or a row of packed documents): sequences one after the other in
   the order of their first document, each cut document's backwards last-first, the next
   sequence's forwards filling the current one's drain. One document is the SPPO case;
5. offload ratios per document and stage (:func:`~sppo_offload.offload.offload_ratios`:
   ``--sppo-offload auto`` sizes them to the hardware profile's host link, ``off`` moves
   nothing, a ``RATIO`` is used for every subsequence but a document's last); every unit with
   a positive ratio gets an ``OFFLOAD`` / ``RELOAD`` pair
   (:func:`~sppo_offload.pipeline.add_offload`), which the executor runs with an
   :class:`~megatron.plugin.pipeline.offload.ActivationOffloader` into a host tier of
   ``--sppo-host-memory-gb`` (pinned buffers and a side stream on CUDA). Under that cap the
   ``auto`` ratios of each document are lowered largest first, as the solver does
   (:func:`~sppo_offload.offload.capped`); a fixed ``RATIO`` is not lowered;
6. before any rank computes, :func:`check_budget` replays the batch's schedule in the
   simulator with the same cost model: when the predicted host bytes of a stage exceed
   ``--sppo-host-memory-gb``, or its peak device memory exceeds ``--sppo-memory-gb`` (default:
   the CUDA device's memory, 16 GB on CPU as for ``--elastic-memory-gb``), every rank stops
   with an error naming the number to change -- the host budget the ratios need, or the
   smallest device budget that fits (the ``auto`` ratios raised to 1 within the host cap, the
   solver's most memory-saving option), or that the batch cannot fit even fully offloaded.
   The executor's own host-tier check (:class:`~megatron.plugin.pipeline.offload.HostMemory`)
   stays as the guard on the real bytes.

With ``--sppo-multiplex`` (one document per replica) the schedule is
:func:`~sppo_offload.multiplex.multiplexed_schedule`: the first subsequence's shares run through
the executor's part program :class:`~sppo_offload.mux_runtime.MultiplexProgram`, the steady
subsequences whole-stage as above (the shares are not offloaded); step 6 replays the plain
schedule of the same subsequences.

Every rank plans the same schedule: the plan is arithmetic on the document lengths and the
flags, with no solver time limit involved. The cost model is the job's
(:func:`~longctx.job_costs.job_cost_model`: model shape and bytes per element from the
Megatron flags and ``params_dtype``; hardware profile from ``--hardware-profile``, by default
matched from the CUDA device name, ``a800`` on CPU; its host link share per GPU
(``host_gbps_per_gpu``) prices the
``auto`` ratios).
"""
from __future__ import annotations


import torch.distributed as dist

from megatron.plugin.layers.kv_store import KVStore
from megatron.plugin.pipeline.chunks import DocumentChunks
from megatron.plugin.pipeline.offloading import Offloading
from megatron.plugin.pipeline.parts import Parts
from megatron.plugin.pipeline.layer_checkpoint import leading_layers
from megatron.plugin.executor_call import megatron_process_groups, run_this_rank
from megatron.plugin.pipeline.p2p import neighbour_links
from megatron.plugin.schedule_spec import RankCall, ScheduleSpec
from megatron.plugin.substitutions import Substitution

from longctx import fixed_checkpointing, job_costs

from sppo_offload.flags import NAME, add_arguments, add_draw_arguments, check_args
from sppo_offload.mux_runtime import MultiplexProgram, block_groups
from sppo_offload.offload import OFF
from sppo_offload.proofs import PROOFS, REFUSALS
from sppo_offload.pipeline import sppo_ir
from sppo_offload.subsequence_batch import SubsequenceBatch, prepare_input


def run(call: RankCall) -> list:
    """This rank's actions over ``call.input`` (:class:`SubsequenceBatch`)."""
    planned = call.input
    groups = megatron_process_groups()
    recomputed = planned.subsequences.recomputes(groups.pp.rank())
    chunks = DocumentChunks(kv_store=KVStore(), layers=leading_layers(call.model),
                            checkpointed=lambda unit: recomputed,
                            slices=planned.slices.__getitem__)
    extensions = [chunks, Offloading(planned.offloader, resident=chunks.kv_store.storage_keys)]
    store, batches = [], planned.batches
    if planned.multiplex:
        program = MultiplexProgram(
            model=call.model, u0=batches[0], doc_key=planned.slices[0][0][0],
            stage=groups.pp.rank(), pp=groups.pp.size(),
            groups=block_groups(tuple(dist.get_process_group_ranks(groups.pp))),
            chunks=chunks, forward_step_func=call.forward_step_func, forward_data_store=store,
            num_microbatches=call.num_microbatches, forward_only=call.forward_only,
            collect_non_loss_data=call.collect_non_loss_data)
        extensions.insert(0, Parts(program))  # first: it runs every action with a part
        batches = batches[1:]
    result = run_this_rank(planned.schedule, groups, call, data_iterator=iter(batches),
                           shape_of=planned.shape_of, extensions=extensions,
                           links=neighbour_links)
    return store + result


def _offloads(args) -> bool:
    return args.sppo_offload not in (OFF, 0) and \
        fixed_checkpointing.fixed_checkpointing(args) is None


def _host_to_host(args) -> str:
    return (f"--sppo-offload {args.sppo_offload} on a machine without CUDA: the activations "
            f"already live in host memory, so an offload copies them within it, synchronously, "
            f"and the process holds as much memory as without offloading (the activation meter "
            f"counts the copies as moved)")


#: The accepted values that run something other than they name under sppo.
SUBSTITUTIONS = (
    Substitution("--sppo-offload", _offloads, _host_to_host, device="cpu"),
    fixed_checkpointing.SUBSTITUTION,
)

SPEC = ScheduleSpec(NAME, run=run, input_type=SubsequenceBatch,
                    argument_groups=(job_costs.add_arguments, add_arguments),
                    check_args=check_args, plans_recomputation=True,
                    borrows_weights=lambda args: args.sppo_multiplex,
                    prepare_input=prepare_input, build_ir=sppo_ir,
                    report=lambda batch: {
                        "planned_activation_bytes": batch.planned_activation_bytes,
                        "host_allocations": batch.offloader.tier.step_allocations()},
                    draw_arguments=(add_draw_arguments,), substitutions=SUBSTITUTIONS,
                    proofs=PROOFS, refusals=REFUSALS)
