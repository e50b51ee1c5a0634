"""The 16-byte header in front of every encoded chunk: magic, version, codec tag, size, checksum.

gRPC and TLS already protect bytes in transit, and sealing (AEAD) authenticates them, but the
decoders must still turn a truncated, corrupted or mislabelled payload into a clear error
rather than wrong numbers: in unsealed development runs, at rest in files, and when a chunk is
handed to the wrong pipeline. The checksum is the low 32 bits of XXH3-64 of the body: a random
corruption passes with probability 2^-32, as with a CRC-32, but XXH3 hashes ~100 GB/s where
zlib's CRC-32 managed ~6 (on a q8 chunk of the reference pseudo-gradient: 5 µs against 85 µs,
a quarter of the whole fused int8 encode). It is no defence against a forger: sealing is. The tag
(CRC-32 of the canonical pipeline spec, computed once per pipeline) catches a chunk decoded with
the wrong pipeline, the element count a chunk decoded at the wrong size.
"""

from __future__ import annotations

import struct
import zlib

import xxhash

from geodiloco.compression.codec_error import CodecError

MAGIC = b"GD"
VERSION = 3  # 1 checked the body with CRC-32; 2 gave zstd whole int8 codes (no nibble split)
_HEADER = struct.Struct("<2sBBIII")  # magic, version, flags (0), codec tag, element count, body checksum
HEADER_SIZE = _HEADER.size
MAX_ELEMENTS = (1 << 32) - 1


def codec_tag(canonical_spec: str) -> int:
    return zlib.crc32(canonical_spec.encode())


def checksum(*body: bytes | memoryview) -> int:
    """The low 32 bits of XXH3-64 (seed 0) of ``body``, which may come in pieces."""
    if len(body) == 1:
        return xxhash.xxh3_64_intdigest(body[0]) & 0xFFFFFFFF
    digest = xxhash.xxh3_64()
    for piece in body:
        digest.update(piece)
    return digest.intdigest() & 0xFFFFFFFF


def seal(tag: int, numel: int, *body: bytes | memoryview) -> bytes:
    """Header + body, the body given in pieces: joined once, with the header."""
    if numel > MAX_ELEMENTS:
        raise CodecError(f"a chunk holds at most {MAX_ELEMENTS} elements, got {numel}")
    return b"".join((_HEADER.pack(MAGIC, VERSION, 0, tag, numel, checksum(*body)), *body))


def open_frame(data: bytes | memoryview, tag: int, numel: int, spec: str) -> memoryview:
    """The body of a frame, after checking it is whole and is what the receiver expects."""
    if len(data) < HEADER_SIZE:
        raise CodecError(f"frame is truncated: {len(data)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, flags, got_tag, got_numel, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CodecError(f"not a geodiloco codec frame (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise CodecError(f"frame format version {version} is not supported (this build reads {VERSION})")
    if flags:
        raise CodecError(f"frame sets flags {flags:#04x}; this build knows none")
    if got_tag != tag:
        raise CodecError(f"frame was encoded by another codec pipeline, not {spec!r} (tag {got_tag:#010x})")
    if got_numel != numel:
        raise CodecError(f"frame holds {got_numel} elements, the receiver expects {numel}")
    body = memoryview(data)[HEADER_SIZE:]
    if checksum(body) != crc:
        raise CodecError(f"frame checksum mismatch ({len(body)}-byte body): corrupted or truncated")
    return body
