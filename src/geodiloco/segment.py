"""A place in the canonical flat parameter vector: a contiguous range or a strided box.

A site's rank holds a piece of a column-sharded matrix as rows that are not adjacent in the
canonical vector; one :class:`Segment` names such a piece without listing its elements.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements ``start + i * stride + j`` (``i < rows``, ``j < row_len``) of the canonical vector."""

    start: int
    rows: int
    row_len: int
    stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.row_len

    @property
    def contiguous(self) -> bool:
        return self.rows <= 1 or self.row_len == self.stride

    @property
    def end(self) -> int:
        """One past the last element."""
        return self.start + (self.rows - 1) * self.stride + self.row_len if self.numel else self.start

    def flat(self) -> Segment:
        """The same elements as one row, when they are contiguous."""
        return Segment(self.start, 1, self.numel, self.numel) if self.contiguous else self

    def view_of(self, flat: torch.Tensor) -> torch.Tensor:
        """A ``rows x row_len`` view of these elements in a canonical-layout tensor."""
        return flat.as_strided(
            (self.rows, self.row_len), (self.stride, 1), flat.storage_offset() + self.start
        )

    def positions(self) -> torch.Tensor:
        """Canonical indices of the elements, row-major (for checksums; keep segments small)."""
        rows = torch.arange(self.rows, dtype=torch.int64) * self.stride + self.start
        return (rows[:, None] + torch.arange(self.row_len, dtype=torch.int64)).reshape(-1)

    def split_rows(self, max_numel: int) -> Iterator[tuple[int, Segment]]:
        """Pieces of at most ``max_numel`` elements, with their offset into this segment's elements."""
        if self.contiguous:
            s = self.flat()
            for a in range(0, s.numel, max_numel):
                n = min(max_numel, s.numel - a)
                yield a, Segment(s.start + a, 1, n, n)
            return
        if self.row_len > max_numel:  # very long rows: each row in contiguous pieces
            for i in range(self.rows):
                for a in range(0, self.row_len, max_numel):
                    n = min(max_numel, self.row_len - a)
                    yield i * self.row_len + a, Segment(self.start + i * self.stride + a, 1, n, n)
            return
        per = max(1, max_numel // self.row_len)
        for r in range(0, self.rows, per):
            n = min(per, self.rows - r)
            yield r * self.row_len, Segment(self.start + r * self.stride, n, self.row_len, self.stride)


def segment_of(header: Any) -> Segment:
    """The elements a ``ChunkHeader`` names (rows 0 or 1: a contiguous range)."""
    if header.rows <= 1:
        return Segment(header.start, 1, header.numel, header.numel)
    row_len, rest = divmod(header.numel, header.rows)
    if rest:
        raise ValueError(f"chunk of {header.numel} elements does not split into {header.rows} rows")
    return Segment(header.start, header.rows, row_len, header.stride)
