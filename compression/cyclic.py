"""Cyclic sparsification: a rotating coordinate set that sender and receivers derive alike.

Element ``i`` of the canonical parameter vector is kept in outer round ``r`` when
``frac(i·φ + r·F) < F`` (``φ`` the golden ratio, a Weyl sequence). Every sender and receiver
computes the same set from the chunk's round and place, so:

- no index travels: the whole bit budget goes to values (at 1 bit/param, ~40% of the elements
  at 2 bits, against ~10% for top-k, which spends most of its budget on indices);
- all sites' updates of a round share one support, so their average is exactly as sparse and,
  with the FedAvg outer step (or any without momentum), the downlink sends it at the same size
  instead of sparsifying it a second time (Nesterov's momentum makes the update dense: what
  falls outside the set waits in the coordinator's error feedback);
- each element's turn comes every ``⌊1/F⌋`` or ``⌈1/F⌉`` rounds (every ``1/F`` when that is an
  integer, up to fp64 rounding at the interval's edge); error feedback at the sender holds what
  it accumulated until then.

The set depends on canonical indices, not on how a chunk was cut, so uplink chunks (shaped by
a site's shards) and downlink chunks (shaped by the coordinator) agree. The frame body starts with
the round it was encoded for and a CRC of the chunk's place, so a receiver decoding it for
another round or other elements gets a clear error instead of values at the wrong indices.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch

from geodiloco.compression.codec_error import CodecError
from geodiloco.segment import Segment

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_PREFIX = struct.Struct("<QI")  # round, CRC-32 of the place's elements
_GEOMETRY = struct.Struct("<qqqq")


@dataclass(frozen=True, slots=True)
class Place:
    """Where a chunk belongs: the outer round it is part of and its elements in the canonical vector."""

    round: int
    segment: Segment

    @classmethod
    def span(cls, round_: int, start: int, numel: int) -> Place:
        """A contiguous range of the canonical vector."""
        return cls(round_, Segment(start, 1, numel, numel))

    @property
    def elements_crc(self) -> int:
        """CRC-32 of which elements these are (the same for every description of one set)."""
        seg = self.segment.flat()
        return zlib.crc32(_GEOMETRY.pack(seg.start, seg.rows, seg.row_len, seg.stride))


@dataclass(frozen=True, slots=True)
class Cyclic:
    """Keep the elements whose turn it is: about ``fraction`` of them each round."""

    fraction: float
    prefix_size = _PREFIX.size

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise CodecError(f"cyclic fraction must be in (0, 1], got {self.fraction}")

    @property
    def spec(self) -> str:
        return f"cyclic:{self.fraction:g}"

    def nominal_count(self, numel: int) -> int:
        """The expected number kept (the exact one depends on the place)."""
        return min(numel, math.ceil(self.fraction * numel))

    def select(self, place: Place | None, numel: int) -> torch.Tensor:
        """Sorted offsets, within the chunk, of the elements kept at ``place``."""
        if place is None:
            raise CodecError(f"{self.spec} needs the chunk's round and place in the parameter vector")
        if place.round < 0 or place.segment.numel != numel or place.segment.start < 0:
            raise CodecError(
                f"{self.spec}: place (round {place.round}, {place.segment.numel} elements at "
                f"{place.segment.start}) does not fit a chunk of {numel} elements"
            )
        if numel == 0:
            return torch.zeros(0, dtype=torch.int64)
        phase = math.fmod(place.round * self.fraction, 1.0)
        turn = place.segment.positions().to(torch.float64).mul_(GOLDEN).add_(phase).frac_()
        return torch.nonzero(turn < self.fraction).view(-1)

    def prefix(self, place: Place) -> bytes:
        return _PREFIX.pack(place.round, place.elements_crc)

    def check_prefix(self, body: memoryview, place: Place | None) -> memoryview:
        """The rest of the body, once its round and elements are the receiver's."""
        if len(body) < self.prefix_size:
            raise CodecError(f"{self.spec}: frame body of {len(body)} bytes has no round")
        encoded_for, crc = _PREFIX.unpack_from(body)
        if place is not None and encoded_for != place.round:
            raise CodecError(
                f"{self.spec}: frame was encoded for round {encoded_for}, decoded for {place.round}"
            )
        if place is not None and crc != place.elements_crc:
            raise CodecError(
                f"{self.spec}: frame was encoded for other elements than the {place.segment.numel} "
                f"at {place.segment.start}"
            )
        return body[self.prefix_size :]
