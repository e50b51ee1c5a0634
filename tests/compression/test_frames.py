import pytest
import torch

from geodiloco.compression import CodecError, ErrorFeedback, decode_chunks_into, encode_chunks, parse_pipeline


def test_chunks_tile_the_tensor_and_match_the_sender_view() -> None:
    x = torch.randn(10_001)
    pipeline = parse_pipeline("q8|zstd:3")
    chunks, decoded = encode_chunks(pipeline, x, chunk_elements=1000, round_=0)
    assert [c.start for c in chunks] == list(range(0, 10_001, 1000))
    assert sum(c.numel for c in chunks) == 10_001
    out = torch.empty(10_001)
    decode_chunks_into(pipeline, chunks, out, round_=0)
    assert torch.equal(out, decoded)


def test_missing_or_reordered_chunks_are_refused() -> None:
    pipeline = parse_pipeline("fp32")
    chunks, _ = encode_chunks(pipeline, torch.randn(3000), chunk_elements=1000, round_=0)
    with pytest.raises(CodecError, match="cover"):
        decode_chunks_into(pipeline, chunks[:2], torch.empty(3000), round_=0)
    with pytest.raises(CodecError, match="starts at"):
        decode_chunks_into(pipeline, [chunks[1], chunks[0], chunks[2]], torch.empty(3000), round_=0)


def test_lossless_pipeline_is_exact() -> None:
    x = torch.randn(4096)
    _, decoded = encode_chunks(parse_pipeline("fp32|zstd:1"), x, chunk_elements=1000, round_=0)
    assert torch.equal(decoded, x)


def test_error_feedback_carries_what_the_codec_dropped() -> None:
    torch.manual_seed(0)
    pipeline = parse_pipeline("q8:64")
    feedback = ErrorFeedback(256)
    signal = torch.randn(256) * 1e-3
    received = torch.zeros(256)
    for _ in range(50):
        to_send = feedback.compensate(signal)
        _, decoded = pipeline.roundtrip(to_send)
        feedback.record(to_send, decoded)
        received += decoded
    # The sum of what arrived equals the sum sent, up to one round's residual.
    assert torch.allclose(received + feedback.residual, signal * 50, atol=1e-6)
    assert feedback.residual.abs().max() <= signal.abs().max() / 100
