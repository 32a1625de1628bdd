"""How a packed micro-batch's rows are laid out, for the attention: :class:`Segment` (a run of
one document's tokens, or of one slice of it), :class:`PackedDocuments` (the segments of every
row, the true positions and the K/V store; Megatron hands it untouched to every core attention)
and :func:`document_segments`."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.plugin.layers.kv_store import KVStore


@dataclass(frozen=True)
class Segment:
    """A run ``[start, stop)`` of one document's tokens inside a packed row.

    ``doc_key``/``slice_index`` name the document slice for the K/V store; ``doc_key=None``
    means a whole document with no context (nothing is stored). ``doc_tokens``: the whole
    document's tokens when the segment is a slice of it (0: the segment is the whole document).
    ``padding``: the run holds no document (filler of a padded row).
    """

    start: int
    stop: int
    doc_key: object = None
    slice_index: int = 0
    doc_tokens: int = 0
    padding: bool = False

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass
class PackedDocuments(PackedSeqParams):
    """Layout of a packed micro-batch ``[s, b]``: per row, the document segments.

    ``position_ids`` is ``[b, s]`` (true positions, offset by the context length for slices).
    ``kv_store`` is required when a segment has ``slice_index > 0`` or will be continued.
    ``share``: the row is one rank's range of a slice computed by a sequence-parallel group
    (SPPO's multiplexed partitioning, :class:`~sppo_offload.mux_runtime.GroupShare`); its
    ``context(key, value, layer_number)`` returns the K/V context blocks of the range.
    ``positions_end``: one past the largest of ``position_ids`` (or a bound above it), known
    from the plan; ``None`` leaves :meth:`rotary_length` to read it from ``position_ids``.
    """

    segments: tuple[tuple[Segment, ...], ...] = ()
    position_ids: torch.Tensor | None = None
    kv_store: KVStore | None = None
    record_kv: bool = field(default=False)
    share: object = None
    positions_end: int | None = None

    _bounds: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.qkv_format = "sbhd"

    def rotary_length(self) -> int:
        """The rotary table's length for this layout: ``positions_end`` when the plan gave it
        (no read back from the device), else one past the largest position id (a host sync,
        for a layout built by hand)."""
        if self.positions_end is not None:
            return self.positions_end
        return int(self.position_ids.max()) + 1

    def row_bounds(self, row: int, seq: int, device) -> tuple[torch.Tensor, int]:
        """``(cu_seqlens, longest)`` of row ``row`` (``seq`` tokens): its documents' bounds as
        an int32 tensor on ``device`` and the longest document, made once per micro-batch (not
        once per layer) from the plan's segments, with no read back from the device."""
        cached = self._bounds.get((row, device))
        if cached is None:
            segments = self.segments[row] if self.segments else ()
            bounds = [0] + [seg.stop for seg in segments] if segments else [0, seq]
            if bounds[-1] != seq:
                raise ValueError(f"segments cover {bounds[-1]} tokens of a {seq}-token row")
            cached = (torch.tensor(bounds, dtype=torch.int32, device=device),
                      max(hi - lo for lo, hi in zip(bounds, bounds[1:])))
            self._bounds[(row, device)] = cached
        return cached


def document_segments(lengths, doc_keys=None, slice_indices=None) -> tuple[Segment, ...]:
    """Segments of one packed row from consecutive document lengths."""
    segments, start = [], 0
    for i, length in enumerate(lengths):
        key = None if doc_keys is None else doc_keys[i]
        index = 0 if slice_indices is None else slice_indices[i]
        segments.append(Segment(start, start + int(length), key, index))
        start += int(length)
    return tuple(segments)
