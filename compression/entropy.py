"""Byte stage: zstd entropy coding with a bounded decoder.

zstd spends most of its time on quantised data in Huffman-coding the literals, and on the codes
of a pseudo-gradient of few inner steps that gains nothing (after 25 AdamW steps its values are
spread nearly uniformly within each block; after 100 or more they are bell-shaped and zstd saves
4-6%: docs/compression.md, "zstd stores what cannot shrink"). So the encoder first estimates,
from a sample of the bytes, what an order-0 entropy coder could save; below :data:`MIN_GAIN` it
writes the bytes as raw blocks of a standard zstd frame (RFC 8878: frame header, then blocks of at
most 128 KiB, each behind a 3-byte header), which any zstd decoder reads and which costs one copy. zstd's own
fastest level would still search for matches (3.5x slower on such bytes). The choice depends on
the bytes only, so encoding stays deterministic.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from geodiloco.compression.codec_error import CodecError

MIN_LEVEL, MAX_LEVEL = -7, 22
MIN_GAIN = 0.02  # code only if order-0 entropy promises >= 2% fewer bytes (of the whole frame)
SAMPLES = 8192  # bytes sampled: the entropy estimate is then biased low by < 0.03 bits/byte
MIN_SAMPLED = 1 << 16  # below this size, always code at the configured level


def estimated_gain(data: bytes | memoryview) -> float:
    """1 - H/8, H the order-0 entropy (bits/byte) of about ``SAMPLES`` evenly spaced bytes.

    The stride is odd, so the sample covers every byte position of multi-byte values (an even
    stride on fp32 data would see only one byte of each value).
    """
    sample = np.frombuffer(data, dtype=np.uint8)[:: max(1, len(data) // SAMPLES) | 1]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / sample.size
    return float(1.0 + (p * np.log2(p)).sum() / 8.0)


_FRAME_MAGIC = 0xFD2FB528
_SINGLE_SEGMENT_8_BYTE_SIZE = 0xE0  # frame header descriptor: content size in 8 bytes, no window, no checksum
_RAW_BLOCK_MAX = 128 * 1024


def stored_frame(data: bytes | memoryview) -> bytes:
    """``data`` as a zstd frame of raw (uncompressed) blocks, its content size declared."""
    view = memoryview(data).cast("B")
    parts: list[bytes | memoryview] = [
        struct.pack("<IBQ", _FRAME_MAGIC, _SINGLE_SEGMENT_8_BYTE_SIZE, len(view))
    ]
    start = 0
    while True:
        size = min(_RAW_BLOCK_MAX, len(view) - start)
        last = start + size == len(view)
        parts.append((size << 3 | int(last)).to_bytes(3, "little"))  # block type 0: raw
        parts.append(view[start : start + size])
        start += size
        if last:
            return b"".join(parts)


_compressors = threading.local()  # zstd contexts are not thread-safe; reuse one per thread and level


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _compressors.__dict__.setdefault("by_level", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


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

    def worth_coding(self, data: bytes | memoryview, of_frame: int = 0) -> bool:
        """False for bytes that entropy coding cannot shrink by MIN_GAIN of the ``of_frame`` bytes
        they are part of (default: of themselves); they are stored instead."""
        share = len(data) / of_frame if of_frame else 1.0
        return len(data) < MIN_SAMPLED or estimated_gain(data) * share >= MIN_GAIN

    def encode(self, data: bytes | memoryview, of_frame: int = 0) -> bytes:
        if not self.worth_coding(data, of_frame):
            return stored_frame(data)
        return _compressor(self.level).compress(data)

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
