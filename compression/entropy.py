"""Byte stage: zstd entropy coding with a bounded decoder."""

from __future__ import annotations

from dataclasses import dataclass

import zstandard

from geodiloco.compression.errors import CodecError

MIN_LEVEL, MAX_LEVEL = -7, 22


@dataclass(frozen=True, slots=True)
class Zstd:
    """zstd at a given level. Decoding never allocates more than the declared raw size.

    Lossless; what it saves depends on the data (the benchmark reports it per pipeline).
    """

    level: int = 3

    def __post_init__(self) -> None:
        if not MIN_LEVEL <= self.level <= MAX_LEVEL:
            raise CodecError(f"zstd level must be in [{MIN_LEVEL}, {MAX_LEVEL}], got {self.level}")

    @property
    def spec(self) -> str:
        return f"zstd:{self.level}"

    def encode(self, data: bytes | memoryview) -> bytes:
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data)

    def decode(self, data: bytes | memoryview, expected_size: int) -> bytes:
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd frame header is invalid: {exc}") from None
        if declared != expected_size:
            raise CodecError(f"zstd frame declares {declared} bytes, expected {expected_size}")
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected_size)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd frame is corrupt: {exc}") from None
        if len(out) != expected_size:
            raise CodecError(f"zstd frame holds {len(out)} bytes, expected {expected_size}")
        return out
