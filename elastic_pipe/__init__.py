"""InfiniPipe's elastic pipeline parallelism (EPP) planner: pure, CPU-only, deterministic.

Given the document lengths of one global batch, a model shape, a hardware profile, the parallel
layout and the per-GPU memory, :func:`elastic_pipe.scheduler.plan_elastic` returns a
:class:`elastic_pipe.plan_types.Plan`: workload-balanced chunks (:mod:`.sequence_processor`),
grouped into back-to-back 1F1B pipelines by a dynamic programme (:mod:`.scheduler`), with
stage-aware chunk-level checkpointing chosen by CP-SAT (:mod:`.checkpointing`).
:mod:`.lowering` turns a plan into the project's schedule IR and prices it with the project's
simulator; ``python -m elastic_pipe.plan`` is the command line.
"""
