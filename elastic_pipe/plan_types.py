"""The planner's output: pipelines of chunks with their checkpointing table."""
from __future__ import annotations

from dataclasses import dataclass, field

from longctx.chunks import Chunk


@dataclass(frozen=True)
class PipelinePlan:
    """One 1F1B pipeline: its chunks in forward order and its checkpointing."""

    chunks: tuple[Chunk, ...]
    """Chunks in forward order (each split document's slices consecutive)."""
    backward: tuple[int, ...]
    """Local chunk indices in backward order (split documents' blocks reversed)."""
    ckpt: tuple[tuple[int, ...], ...]
    """``[stage][local chunk]`` number of leading layers recomputed."""
    predicted_time_s: float
    """The checkpointing model's ``sum_t C_t`` (the simulator's figure is authoritative)."""
    status: str
    """How ``ckpt`` was found (see :class:`elastic_pipe.checkpointing.CheckpointSolution`)."""
    num_slices: int
    """The ``N`` the group's documents were chunked with."""
    lookahead: int
    """How many backwards ahead the stages raise their forward window for a split document
    (:func:`megatron.plugin.pipeline.schedule_1f1b.one_f_one_b`)."""


@dataclass(frozen=True)
class Plan:
    """Pipelines run back to back; chunk (unit) numbers run on across pipelines."""

    pipelines: tuple[PipelinePlan, ...]
    """In execution order."""
    predicted_time_s: float
    """Sum of the pipelines' predicted times."""
    peak_memory_bytes: tuple[float, ...]
    """Per stage: model state + reserve + the largest in-flight activations of the solver's
    model (an upper bound by the MiB rounding)."""
    chunk_time_rsd: float
    """Relative std-dev of chunk layer-forward time over all chunks (paper Table 2)."""
    chunk_length_rsd: float
    """Relative std-dev of chunk tokens over all chunks."""
    solve_time_s: float
    """Wall-clock seconds the planner took."""
    fallbacks: tuple[dict, ...] = field(default=())
    """Pipelines whose checkpointing is not proven optimal: ``{"pipeline", "status",
    "reason"}``."""

    def chunks(self) -> list[Chunk]:
        """All chunks, indexed by their global unit number."""
        return [chunk for pipeline in self.pipelines for chunk in pipeline.chunks]

    def ckpt_table(self) -> list[list[int]]:
        """``[stage][unit]`` checkpointed layers over all pipelines."""
        stages = len(self.pipelines[0].ckpt)
        return [[c for pipeline in self.pipelines for c in pipeline.ckpt[stage]]
                for stage in range(stages)]

    def to_dict(self) -> dict:
        """JSON-ready description: pipelines, chunks with their pieces, ckpt table."""
        unit, pipelines = 0, []
        for pipeline in self.pipelines:
            chunks = []
            for chunk in pipeline.chunks:
                chunks.append({"unit": unit, "kind": chunk.kind, "tokens": chunk.tokens,
                               "pieces": [{"doc": p.doc, "slice": p.slice,
                                           "tokens": [p.start, p.end], "context": p.context}
                                          for p in chunk.pieces]})
                unit += 1
            pipelines.append({"chunks": chunks, "num_slices": pipeline.num_slices,
                              "lookahead": pipeline.lookahead,
                              "backward_order": list(pipeline.backward),
                              "predicted_time_s": pipeline.predicted_time_s,
                              "status": pipeline.status})
        return {"pipelines": pipelines, "ckpt": self.ckpt_table(),
                "predicted_time_s": self.predicted_time_s,
                "chunk_time_rsd": self.chunk_time_rsd,
                "chunk_length_rsd": self.chunk_length_rsd}
