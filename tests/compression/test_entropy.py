import os

import numpy as np
import pytest
import torch
import zstandard

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.compression.entropy import MIN_SAMPLED, Zstd, estimated_gain, stored_frame


def test_bytes_that_cannot_shrink_skip_entropy_coding() -> None:
    data = os.urandom(1 << 18)
    assert estimated_gain(data) < 0.02
    zstd = Zstd(level=3)
    assert not zstd.worth_coding(data)
    frame = zstd.encode(data)
    assert frame == stored_frame(data)
    assert len(frame) == len(data) + 13 + 3 * 2  # frame header, then one 3-byte header per 128 KiB
    assert zstd.decode(frame, len(data)) == data


def test_skewed_bytes_are_coded_at_the_configured_level() -> None:
    rng = np.random.default_rng(0)
    codes = np.clip(np.round(rng.normal(0, 8, 1 << 18)), -127, 127).astype(np.int8).tobytes()
    zstd = Zstd(level=3)
    assert estimated_gain(codes) > 0.3
    assert zstd.worth_coding(codes)
    frame = zstd.encode(codes)
    assert len(frame) < 0.75 * len(codes)
    assert zstd.decode(frame, len(codes)) == codes


def test_small_inputs_always_use_the_configured_level() -> None:
    data = os.urandom(MIN_SAMPLED - 1)
    assert Zstd(level=5).worth_coding(data)


@pytest.mark.parametrize("size", [0, 1, 1000, 128 * 1024 - 1, 128 * 1024, 128 * 1024 + 1, 3 << 20])
def test_stored_frames_are_standard_zstd_frames(size: int) -> None:
    """Any zstd decoder reads them, with the content size declared; the blocks split at 128 KiB."""
    data = os.urandom(size)
    frame = stored_frame(data)
    assert zstandard.frame_content_size(frame) == size
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=size) == data
    assert Zstd(level=3).decode(frame, size) == data
    assert len(frame) == 13 + 3 * max(1, -(-size // (128 * 1024))) + size


def test_q8_of_uniform_values_is_stored_and_decodes_exactly_like_q8() -> None:
    """Codes of values spread uniformly in each block (as real pseudo-gradients are) gain nothing."""
    x = torch.rand(1 << 18, generator=torch.Generator().manual_seed(1)) * 2 - 1
    coded, plain = parse_pipeline("q8|zstd:3"), parse_pipeline("q8")
    data, y = coded.roundtrip(x)
    assert coded.encode(x) == data
    assert torch.equal(y, plain.roundtrip(x)[1])
    assert len(data) == pytest.approx(len(plain.encode(x)), rel=1e-3)


def test_fp32_bytes_are_sampled_at_every_byte_position() -> None:
    """fp32 Gaussian data: the exponent bytes make zstd worth ~8%; a stride of 4 would miss them."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    pipeline = parse_pipeline("fp32|zstd:1")
    assert estimated_gain(x.numpy().tobytes()) > 0.05
    assert len(pipeline.encode(x)) < 0.95 * 4 * x.numel()


def test_a_damaged_stored_frame_is_a_clear_error() -> None:
    """Below the frame checksum, the zstd decoder itself refuses a stored frame cut short or lying."""
    data = os.urandom(200_000)
    frame = bytearray(stored_frame(data))
    zstd = Zstd(level=3)
    with pytest.raises(CodecError, match="zstd"):
        zstd.decode(bytes(frame[:-10]), len(data))  # truncated
    with pytest.raises(CodecError, match="zstd frame declares"):
        zstd.decode(bytes(frame), len(data) - 1)  # the receiver expects another size
    frame[13:16] = ((1 << 20) << 3 | 1).to_bytes(3, "little")  # first block claims 1 MiB, last
    with pytest.raises(CodecError, match="zstd"):
        zstd.decode(bytes(frame), len(data))


def test_a_part_is_coded_only_if_it_saves_min_gain_of_its_whole_frame() -> None:
    gen = torch.Generator().manual_seed(3)
    data = (
        torch.randint(0, 200, (1 << 17,), generator=gen, dtype=torch.uint8).numpy().tobytes()
    )  # ~4.5% to gain
    zstd = Zstd(level=1)
    assert zstd.encode(data) != stored_frame(data)
    assert zstd.encode(data, of_frame=3 * len(data)) == stored_frame(data)  # 1.5% of the frame: stored
