"""Codecs that turn fp32 tensors into compact bytes and back.

A pipeline is named by a spec string such as ``"topk:0.05|q2|zstd:3"``: an optional sparsifier,
one value codec, an optional entropy stage; every chunk is framed with a length, codec tag and
checksum. See :mod:`.pipeline`.
"""

from geodiloco.compression.codec_error import CodecError
from geodiloco.compression.cyclic import Place
from geodiloco.compression.error_feedback import ErrorFeedback
from geodiloco.compression.frames import EncodedChunk, decode_chunks_into, encode_chunks
from geodiloco.compression.pipeline import Pipeline, known_stages, parse_pipeline

__all__ = [
    "CodecError",
    "EncodedChunk",
    "ErrorFeedback",
    "Pipeline",
    "Place",
    "decode_chunks_into",
    "encode_chunks",
    "known_stages",
    "parse_pipeline",
]
