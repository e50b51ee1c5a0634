"""Byte stage: zstd entropy coding with a bounded decoder.

zstd spends most of its time on quantised data in Huffman-coding the literals, and on the
codes of real pseudo-gradients that gains nothing (their values are spread nearly uniformly
within each block). So the encoder first estimates, from a sample of the bytes, what an order-0
entropy coder could save; below :data:`MIN_GAIN` it writes the frame at zstd's fastest level,
which stores the bytes without coding them (a valid zstd frame all the same: decoders do not
depend on the level). The choice depends on the bytes only, so encoding stays deterministic.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from geodiloco.compression.errors import CodecError

MIN_LEVEL, MAX_LEVEL = -7, 22
FAST_LEVEL = -1  # no Huffman coding of literals: bytes that cannot shrink are stored at memcpy speed
MIN_GAIN = 0.02  # code at the configured level only if order-0 entropy promises >= 2% fewer bytes
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

    def effective_level(self, data: bytes | memoryview) -> int:
        """The configured level, or :data:`FAST_LEVEL` for bytes that entropy coding cannot shrink."""
        if len(data) < MIN_SAMPLED or self.level <= FAST_LEVEL or estimated_gain(data) >= MIN_GAIN:
            return self.level
        return FAST_LEVEL

    def encode(self, data: bytes | memoryview) -> bytes:
        return _compressor(self.effective_level(data)).compress(data)

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
