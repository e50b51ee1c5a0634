"""Byte stages: zstd entropy coding with a bounded decoder."""

from __future__ import annotations

from dataclasses import dataclass

import zstandard

from geodiloco.compression.errors import CodecError


@dataclass(frozen=True, slots=True)
class Zstd:
    """zstd at a given level. Decoding never allocates more than the declared raw size."""

    level: int = 3
    name = "zstd"

    def encode(self, data: bytes) -> bytes:
        return zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(data)

    def decode(self, data: bytes, expected_size: int) -> bytes:
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd frame header is invalid: {exc}") from None
        if declared not in (-1, expected_size):
            raise CodecError(f"zstd frame declares {declared} bytes, expected {expected_size}")
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected_size)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd frame is corrupt: {exc}") from None
        if len(out) != expected_size:
            raise CodecError(f"zstd frame holds {len(out)} bytes, expected {expected_size}")
        return out
