"""Pieces and chunks: the units the elastic pipeline runs.

A *piece* is a token range of one document; a *chunk* is the work of one pipeline unit: one or
more pieces, run together as one forward and one backward per stage. The paper's chunk ``{C, S}``
(context length of a split slice, list of slice lengths) is recovered from the pieces: each piece
carries its own context (its start offset in the document), so a chunk is

- *batched*: whole documents only (every context 0);
- *split*: one slice of a long document that is not its last slice (alone in its chunk);
- *hybrid*: the last slice (*tail*) of a split document packed with whole short documents.

Two tail slices of different documents never share a chunk, so a chunk has at most one piece
with a non-zero context.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True, order=True)
class Piece:
    """Tokens ``[start, end)`` of document ``doc``, its slice number ``slice``."""

    doc: int
    """Index of the document in the global batch (the order the lengths were given in)."""
    slice: int
    """0 for the first (or only) slice of the document."""
    start: int
    """First token; also the context length the slice attends to (K/V of earlier slices)."""
    end: int
    """One past the last token."""
    final: bool
    """True for the document's last slice; earlier slices keep their K/V for later ones."""

    def __post_init__(self):
        if not 0 <= self.start < self.end:
            raise ValueError(f"piece of document {self.doc} needs 0 <= start < end, "
                             f"got [{self.start}, {self.end})")
        if (self.slice == 0) != (self.start == 0):
            raise ValueError(f"piece of document {self.doc}: slice 0 must start at token 0")

    @property
    def tokens(self) -> int:
        return self.end - self.start

    @property
    def context(self) -> int:
        return self.start

    @property
    def is_tail(self) -> bool:
        """Last slice of a document that was split."""
        return self.final and self.slice > 0


@dataclass(frozen=True)
class Chunk:
    """One pipeline unit: pieces run together."""

    pieces: tuple[Piece, ...]
    """The token ranges, in the order they are laid out in the chunk."""

    def __post_init__(self):
        if not self.pieces:
            raise ValueError("a chunk needs at least one piece")
        if sum(piece.is_tail for piece in self.pieces) > 1:
            raise ValueError(f"two tail slices in one chunk: {self.pieces}")
        if any(not piece.final for piece in self.pieces) and len(self.pieces) > 1:
            raise ValueError(f"a slice that is not its document's last must be alone: "
                             f"{self.pieces}")

    @property
    def tokens(self) -> int:
        return sum(piece.tokens for piece in self.pieces)

    @property
    def context(self) -> int:
        """The paper's C: context of the split slice (0 for a batched chunk)."""
        return max(piece.context for piece in self.pieces)

    @property
    def kind(self) -> str:
        """``"batched"``, ``"split"`` or ``"hybrid"``."""
        if not self.pieces[0].final:
            return "split"
        return "hybrid" if any(piece.is_tail for piece in self.pieces) else "batched"

    @cached_property
    def signature(self) -> tuple:
        """What the cost model sees: (context, tokens, is final) of each piece, sorted."""
        return tuple(sorted((p.context, p.tokens, p.final) for p in self.pieces))
