"""The device path of the outer-sync codecs (quantise where the values live, copy only the raw
bytes to the host), forced onto CPU tensors: the same frames and decoded values as the host path
(the C kernels for q8) for every codec it takes (q8/q4/q2, fp4, nf4), and tensors made only
where the input lives."""

from __future__ import annotations

import pytest
import torch
from codec_strategies import tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, Place, parse_pipeline
from geodiloco.compression.cyclic import Cyclic
from geodiloco.compression.levels import LevelQuantizer, gaussian_two_bit_levels
from geodiloco.compression.pipeline import host_copy, kept_on_device
from geodiloco.compression.quantize import BlockwiseAbsmax
from helpers import CUDA, same_bits

DEVICE_SPECS = [
    "q8",
    "q8|zstd:1",
    "q8:100|zstd:3",
    "q4",
    "q4:64|zstd:1",
    "q2",
    "q2:33|zstd:1",
    "cyclic:0.4|q2",
    "cyclic:0.25|q8|zstd:1",
    "cyclic:0.5|q4:64|zstd:1",
    "topk:0.1|q4",
    "topk:0.05|q2|zstd:3",
    "fp4",
    "nf4:64|zstd:1",
    "cyclic:0.4|fp4:32",
    "topk:0.1|nf4",
]
HOST_SPECS = [
    "fp32|zstd:1",
    "bf16",
    "q4:64:sr=3",
    "lm2",
    "lm2:64|zstd:1",
    "topk:0.1:256|q4",
    "cyclic:0.4",
    "cyclic:0.4|sign:256",
]
SIZES = [1, 63, 128, 129, 1000, 4099]  # odd block tails, single elements, exact blocks


def _values(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 5 - 2)
    x[: min(n, 3)] = torch.tensor([0.0, -0.0, 1e-42])[: min(n, 3)]  # signed zero and a subnormal
    if n > 300:
        x[128:256] = 0.0  # an all-zero block: step 0
        x[256:260] = -0.0
    return x


@pytest.mark.parametrize("spec", DEVICE_SPECS)
@pytest.mark.parametrize("numel", SIZES)
def test_device_path_gives_the_host_paths_bytes_and_values(spec: str, numel: int) -> None:
    codec = parse_pipeline(spec)
    assert codec.device_ready
    for seed in range(3):
        x, place = _values(numel, seed), Place.span(seed + 5, 1000 * seed, numel)
        data, back = codec.roundtrip(x, place)  # CPU tensor: the host path (C kernels for q8)
        dev_data, dev_back = codec.roundtrip(x, place, on_device=True)
        assert dev_data == data == codec.encode(x, place, on_device=True)
        assert same_bits(dev_back, back)  # +0.0 where the receiver has +0.0: hashes agree
        assert same_bits(codec.decode(dev_data, numel, place), dev_back)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(DEVICE_SPECS), x=tensors(), round_=st.integers(0, 2**40))
def test_device_path_matches_the_host_path_on_awkward_tensors(
    spec: str, x: torch.Tensor, round_: int
) -> None:
    codec, place = parse_pipeline(spec), Place.span(round_, 3 * round_, x.numel())
    data, back = codec.roundtrip(x, place)
    dev_data, dev_back = codec.roundtrip(x, place, on_device=True)
    assert dev_data == data and same_bits(dev_back, back)


@pytest.mark.parametrize("spec", ["q8|zstd:1", "q4:64", "cyclic:0.4|q2|zstd:1", "topk:0.1|q8"])
def test_bf16_values_are_widened_on_the_device_like_on_the_host(spec: str) -> None:
    codec, x = parse_pipeline(spec), _values(777, 1).to(torch.bfloat16)
    place = Place.span(2, 0, x.numel())
    data, back = codec.roundtrip(x, place)
    dev_data, dev_back = codec.roundtrip(x, place, on_device=True)
    assert dev_data == data and same_bits(dev_back, back)


@pytest.mark.parametrize("spec", HOST_SPECS)
def test_codecs_without_a_device_path_still_code_on_the_host(spec: str) -> None:
    codec = parse_pipeline(spec)
    assert not codec.device_ready
    x, place = _values(1000, 2), Place.span(1, 0, 1000)
    data, back = codec.roundtrip(x, place, on_device=True)
    assert data == codec.encode(x, place)
    assert same_bits(back, codec.decode(data, x.numel(), place))


@pytest.mark.parametrize("spec", ["q8", "q2|zstd:1", "topk:0.1|q4", "fp4"])
def test_only_quantised_bytes_leave_the_device(spec: str) -> None:
    codec, x = parse_pipeline(spec), _values(4099, 3)
    raw, back, kept = codec.device_stage(x)
    k = x.numel() if kept is None else kept.numel()
    assert raw.dtype == torch.uint8 and raw.numel() == codec.values.encoded_size(k)
    assert raw.numel() <= x.numel() * 4 * 0.27  # codes and steps: a quarter of fp32 at most
    assert back.shape == x.shape and back.dtype == torch.float32
    assert host_copy(raw) is raw  # already on the host: no copy


def test_cyclic_kept_set_reaches_the_device_as_a_bit_mask() -> None:
    codec = parse_pipeline("cyclic:0.4|q2")
    assert isinstance(codec.sparsifier, Cyclic)
    for numel in (1, 7, 8, 9, 1000):
        kept = codec.sparsifier.select(Place.span(5, 11, numel), numel)
        assert torch.equal(kept_on_device(kept, numel, torch.device("cpu")), kept)


@pytest.mark.parametrize("spec", ["q8|zstd:1", "q4:64", "q2:33", "topk:0.1|q4", "fp4:64", "nf4"])
def test_device_stage_makes_tensors_only_where_its_input_lives(spec: str) -> None:
    """With ``meta`` as the default device, any tensor made without naming the input's device
    lands on ``meta`` and the stage fails (mixed devices, or no data to read): on a GPU that
    tensor would have been on the host."""
    codec, x = parse_pipeline(spec), _values(1000, 4)
    expected = codec.device_stage(x)
    with torch.device("meta"):
        raw, back, kept = codec.device_stage(x)
    assert {t.device.type for t in (raw, back)} == {"cpu"}
    assert torch.equal(raw, expected[0]) and same_bits(back, expected[1])
    assert kept is None or torch.equal(kept, expected[2])


def test_device_path_refuses_non_finite_values_and_a_missing_place() -> None:
    for spec in ("q8", "q2", "cyclic:0.4|q4", "topk:0.1|q8", "nf4"):
        x = _values(300)
        x[200] = float("nan")
        with pytest.raises(CodecError, match="NaN or Inf"):
            parse_pipeline(spec).roundtrip(x, Place.span(0, 0, 300), on_device=True)
    with pytest.raises(CodecError, match="needs the chunk's round and place"):
        parse_pipeline("cyclic:0.4|q2").roundtrip(_values(300), on_device=True)
    with pytest.raises(CodecError, match="stochastic rounding is coded on the host"):
        BlockwiseAbsmax(bits=4, sr_seed=1).encode_on_device(_values(10))
    with pytest.raises(CodecError, match="scaled by an RMS or a mean are coded on the host"):
        LevelQuantizer("lm2", gaussian_two_bit_levels(), bits=2, scale="rms").encode_on_device(_values(10))


def test_empty_chunks_take_the_device_path() -> None:
    for spec in ("q8|zstd:1", "q4", "cyclic:0.4|q2", "topk:0.1|q4", "fp4"):
        codec, place = parse_pipeline(spec), Place.span(0, 0, 0)
        data, back = codec.roundtrip(torch.zeros(0), place, on_device=True)
        assert data == codec.encode(torch.zeros(0), place) and back.numel() == 0


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("spec", DEVICE_SPECS)
def test_on_a_gpu_the_frames_and_decoded_values_match_the_cpu(device: str, spec: str) -> None:
    codec = parse_pipeline(spec)
    for numel in SIZES:
        x, place = _values(numel, 1), Place.span(3, 17, numel)
        data, back = codec.roundtrip(x, place)
        gpu_data, gpu_back = codec.roundtrip(x.to(device), place)
        assert gpu_back.device.type == device
        assert gpu_data == data and same_bits(gpu_back.cpu(), back)
