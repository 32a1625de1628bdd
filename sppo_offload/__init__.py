"""SPPO planning (pure, CPU-only, deterministic): one ultra-long sequence cut into
FLOPs-balanced subsequences (:mod:`.partition`), pipelined over the stages as schedule IR with
offload and reload actions (:mod:`.pipeline`), with per-subsequence offload ratios sized to the
host link (:mod:`.offload`), priced by the project's simulator (:mod:`.costs`); a heuristic
solver for (SP, PP, N) and the baselines priced the same way (:mod:`.solver`); multiplexed
partitioning of the edge subsequences (:mod:`.multiplex`); ``python -m sppo_offload.plan`` is
the command line. :mod:`.spec` trains with it: ``--pipeline-schedule=sppo``, run by the
executor, which moves the saved activations to host memory and back
(:mod:`megatron.plugin.pipeline.offload`).
"""
