"""Fixed-size framing of a flat tensor into independently decodable chunks.

Each chunk covers one element range, so a receiver decodes it on arrival into its place and
never buffers the whole payload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from geodiloco.compression.codec_error import CodecError
from geodiloco.compression.cyclic import Place
from geodiloco.compression.pipeline import Pipeline


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    start: int
    numel: int
    payload: bytes | memoryview  # a view where the chunk is read out of a larger buffer (a logged update)


def chunk_ranges(numel: int, chunk_elements: int) -> Iterator[tuple[int, int]]:
    for start in range(0, numel, chunk_elements):
        yield start, min(chunk_elements, numel - start)


def encode_chunks(
    pipeline: Pipeline, flat: torch.Tensor, chunk_elements: int, *, round_: int
) -> tuple[list[EncodedChunk], torch.Tensor]:
    """Encode the canonical vector ``flat`` of round ``round_`` chunk by chunk; also return what
    every receiver will decode."""
    chunks: list[EncodedChunk] = []
    decoded = torch.empty_like(flat)
    for start, numel in chunk_ranges(flat.numel(), chunk_elements):
        payload, back = pipeline.roundtrip(flat[start : start + numel], Place.span(round_, start, numel))
        decoded[start : start + numel] = back
        chunks.append(EncodedChunk(start, numel, payload))
    return chunks, decoded


def decode_chunks_into(
    pipeline: Pipeline, chunks: Iterable[EncodedChunk], out: torch.Tensor, *, round_: int
) -> None:
    """Decode the chunks of round ``round_`` into the canonical vector ``out``; their ranges must
    tile it exactly, in order."""
    expected_start = 0
    for chunk in chunks:
        if chunk.start != expected_start:
            raise CodecError(f"chunk starts at {chunk.start}, expected {expected_start}")
        if chunk.numel <= 0 or chunk.start + chunk.numel > out.numel():
            raise CodecError(f"chunk range [{chunk.start}, +{chunk.numel}) is outside the tensor")
        place = Place.span(round_, chunk.start, chunk.numel)
        out[chunk.start : chunk.start + chunk.numel] = pipeline.decode(chunk.payload, chunk.numel, place)
        expected_start += chunk.numel
    if expected_start != out.numel():
        raise CodecError(f"chunks cover {expected_start} of {out.numel()} elements")
