"""One site's pseudo-gradient for one round, put together from the parts its ranks push.

Each rank of a site streams the elements it owns (``PushDelta`` with ``part``/``parts``); the
coordinator places every chunk where the canonical layout says and keeps a coverage mask, so
overlapping or missing elements are refused instead of silently averaged. A part whose stream
breaks gives back what it claimed, so its retry starts clean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from geodiloco.config import LimitsConfig
from geodiloco.coordinator.errors import InvalidArgument, Unavailable
from geodiloco.segment import Segment
from geodiloco.workload.data import DataRange


@dataclass(slots=True)
class Assembly:
    """The parts received so far of one (site, round) contribution."""

    round: int
    parts: int
    tokens: int
    data: list[DataRange]
    values: torch.Tensor
    covered: torch.Tensor
    received: set[int] = field(default_factory=set)
    streaming: dict[int, list[Segment]] = field(default_factory=dict)

    @classmethod
    def open(cls, round_: int, num_params: int, parts: int, tokens: int, data: list[DataRange]) -> Assembly:
        return cls(
            round_,
            parts,
            tokens,
            data,
            torch.empty(num_params, dtype=torch.float32),
            torch.zeros(num_params, dtype=torch.bool),
        )

    def begin(self, part: int, parts: int, tokens: int, data: list[DataRange]) -> bool:
        """Start receiving ``part``; False when it was already received (an idempotent retry)."""
        if (parts, tokens) != (self.parts, self.tokens):
            raise InvalidArgument(
                f"part {part} says {parts} parts and {tokens} tokens; "
                f"earlier parts said {self.parts} parts and {self.tokens} tokens"
            )
        if data and data != self.data:
            raise InvalidArgument(
                f"part {part} names other data ranges than the contribution's earlier parts"
            )
        if part in self.received:
            return False
        if part in self.streaming:
            raise Unavailable(f"part {part} is already being received; retry")
        self.streaming[part] = []
        return True

    def claim(self, part: int, segment: Segment) -> torch.Tensor:
        """Reserve ``segment`` for ``part``; returns the view its decoded values go to."""
        mask = segment.view_of(self.covered)
        if bool(mask.any()):
            raise InvalidArgument(
                f"part {part}: chunk at element {segment.start} overlaps elements already pushed"
            )
        mask.fill_(True)
        self.streaming[part].append(segment)
        return segment.view_of(self.values)

    def finish(self, part: int) -> None:
        self.streaming.pop(part)
        self.received.add(part)

    def abandon(self, part: int) -> None:
        """A part's stream failed: release what it claimed."""
        for segment in self.streaming.pop(part, []):
            segment.view_of(self.covered).fill_(False)

    @property
    def complete(self) -> bool:
        return len(self.received) == self.parts and not self.streaming

    def check_covered(self) -> None:
        missing = int((~self.covered).sum())
        if missing:
            raise InvalidArgument(
                f"all {self.parts} parts arrived but {missing} of {self.covered.numel()} elements are missing"
            )


def check_declared(limits: LimitsConfig, chunk: Any, num_params: int) -> None:
    """The counts the first chunk of a push declares, against the run's limits."""
    if not 0 < chunk.tokens <= limits.max_tokens:
        raise InvalidArgument(
            f"tokens must be in [1, {limits.max_tokens}] (limits.max_tokens), got {chunk.tokens}"
        )
    most = min(limits.max_chunks_per_part, num_params)
    if not 0 < chunk.total_chunks <= most:
        raise InvalidArgument(
            f"total_chunks {chunk.total_chunks} is out of range [1, {most}] "
            "(limits.max_chunks_per_part, and at most one chunk per parameter)"
        )
    parts = chunk.parts or 1
    if not 0 < parts <= limits.max_parts or chunk.part >= parts:
        raise InvalidArgument(
            f"part {chunk.part} of {parts} is out of range (limits.max_parts {limits.max_parts})"
        )
    if len(chunk.data) > limits.max_data_ranges:
        raise InvalidArgument(
            f"{len(chunk.data)} data ranges exceed limits.max_data_ranges {limits.max_data_ranges}"
        )


def check_segment(segment: Segment, num_params: int, chunk_elements: int, seq: int) -> None:
    """A chunk's place must lie inside the model and hold at most one chunk of elements."""
    s = segment
    if s.rows < 1 or s.row_len < 1 or (s.rows > 1 and s.stride < s.row_len):
        raise InvalidArgument(
            f"chunk {seq}: rows {s.rows}, row length {s.row_len}, stride {s.stride} is no layout"
        )
    if s.numel > chunk_elements or s.end > num_params:
        raise InvalidArgument(
            f"chunk {seq} covers {s.numel} elements up to {s.end}, outside the model's {num_params} "
            f"parameters or over {chunk_elements} elements"
        )
