"""Copies of codec bytes between host and device on explicit streams (compression/staging.py),
and the decoder that runs where those bytes land: on the CPU the staging's copies are plain
ones; the gpu-marked tests check the side stream and pinned buffers where CUDA is."""

from __future__ import annotations

import pytest
import torch

from geodiloco.compression import CodecError, envelope, parse_pipeline
from geodiloco.compression.staging import Staging, thread_staging
from helpers import CUDA, same_bits

SPECS = [
    "q8",
    "q8|zstd:1",
    "q8:100|zstd:3",
    "q4",
    "q4:64|zstd:1",
    "q2",
    "q2:33|zstd:1",
    "fp32",
    "fp32|zstd:1",
]
SIZES = [1, 63, 128, 129, 1000, 4099]


def _values(n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 5 - 2)
    x[: min(n, 3)] = torch.tensor([0.0, -0.0, 1e-42])[: min(n, 3)]  # signed zero and a subnormal
    if n > 300:
        x[128:256] = 0.0  # an all-zero block: step 0
    return x


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", SIZES)
def test_decoded_where_the_raw_bytes_are_the_values_are_the_host_decoders(spec: str, numel: int) -> None:
    codec = parse_pipeline(spec)
    assert codec.decodes_on_device
    x = _values(numel, numel)
    raw = codec.unpack(codec.encode(x), numel)
    codec.check_raw(raw, numel)
    assert same_bits(codec.decode_on_device(raw.clone(), numel), codec.decode_raw(raw, numel))


@pytest.mark.parametrize("spec", ["q8|zstd:1", "q4:64", "q2:33", "fp32"])
def test_the_device_decoder_makes_tensors_only_where_its_input_lives(spec: str) -> None:
    """With ``meta`` as the default device, a tensor made without naming the input's device
    lands on ``meta`` and the decode fails: on a GPU it would have been on the host."""
    codec = parse_pipeline(spec)
    raw = codec.unpack(codec.encode(_values(1000, 2)), 1000)
    expected = codec.decode_raw(raw, 1000)
    with torch.device("meta"):
        values = codec.decode_on_device(raw.clone(), 1000)
    assert values.device.type == "cpu" and same_bits(values, expected)


def test_the_host_check_refuses_what_the_host_decoder_refuses() -> None:
    q8, q4 = parse_pipeline("q8"), parse_pipeline("q4")
    raw = q8.unpack(q8.encode(_values(300, 1)), 300).clone()
    raw[-1] = 0x80  # code -128
    with pytest.raises(CodecError, match="-128"):
        q8.check_raw(raw, 300)
    raw4 = q4.unpack(q4.encode(_values(300, 1)), 300).clone()
    raw4[-1] = 0xFF  # a code of 15: past the grid's 14
    with pytest.raises(CodecError, match="exceeds 14"):
        q4.check_raw(raw4, 300)
    steps = q8.unpack(q8.encode(_values(300, 1)), 300).clone()
    steps[:4] = torch.tensor([0xFF, 0xFF, 0xFF, 0xFF], dtype=torch.uint8)  # a NaN step
    with pytest.raises(CodecError, match="step"):
        q8.check_raw(steps, 300)
    with pytest.raises(CodecError, match="bytes"):
        q8.check_raw(raw[:-1], 300)
    nan = torch.tensor([1.0, float("nan")]).view(torch.uint8)
    with pytest.raises(CodecError):
        parse_pipeline("fp32").check_raw(nan, 2)
    with pytest.raises(CodecError, match="host only"):
        parse_pipeline("topk:0.1|q4").check_raw(raw, 300)
    bad = envelope.seal(q8.tag, 300, raw.numpy().tobytes())
    with pytest.raises(CodecError, match="-128"):  # the host decoder refuses the same bytes
        q8.decode(bad, 300)


def test_on_the_cpu_the_staging_copies_nothing_and_waits_for_nothing() -> None:
    staging = Staging(torch.device("cpu"))
    assert not staging.resident and staging.stream is None
    x = torch.arange(10, dtype=torch.uint8)
    assert staging.to_host(x) is x and staging.to_device(x) is x
    with staging.side():
        y = x + 1
    staging.after_current()
    staging.fence()
    staging.synchronize()
    assert torch.equal(y, x + 1)
    assert Staging(torch.device("cpu"), resident=True).resident  # how CPU tests run the device path
    assert thread_staging(torch.device("cpu")) is thread_staging(torch.device("cpu"))


@pytest.mark.parametrize("device", [CUDA])
def test_on_a_gpu_copies_run_on_the_side_stream_through_pinned_buffers(device: str) -> None:
    staging = Staging(torch.device(device, 0))
    assert staging.resident and staging.stream is not None
    assert staging.stream != torch.cuda.current_stream()
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1, 1000, 70_000, 3, 70_001, 5, 9)]
    landed = [staging.to_device(c) for c in chunks]  # more than the ring holds: buffers are reused
    assert all(buf.is_pinned() for buf, _ in staging._down)
    with staging.side():
        sums = [t.to(torch.int64).sum() for t in landed]
    staging.fence()
    assert [int(s) for s in sums] == [int(c.to(torch.int64).sum()) for c in chunks]
    values = torch.randn(5000, device=device)
    raw = (values * 100).to(torch.int8).view(torch.uint8)  # made on the current stream
    host = staging.to_host(raw)
    assert host.is_pinned() and torch.equal(host, raw.cpu())
    floats = staging.to_device(torch.randn(7, 3))
    staging.fence()
    assert floats.shape == (7, 3) and floats.dtype == torch.float32 and floats.device.type == "cuda"


@pytest.mark.parametrize("spec", ["q8|zstd:1", "q4:64", "q2:33", "fp32"])
@pytest.mark.parametrize("device", [CUDA])
def test_on_a_gpu_decoded_values_are_the_host_decoders(spec: str, device: str) -> None:
    codec, staging = parse_pipeline(spec), Staging(torch.device(device, 0))
    raw = codec.unpack(codec.encode(_values(4099, 3)), 4099)
    codec.check_raw(raw, 4099)
    on_device = staging.to_device(raw)
    with staging.side():
        values = codec.decode_on_device(on_device, 4099)
    staging.fence()
    assert values.device.type == "cuda" and same_bits(values.cpu(), codec.decode_raw(raw, 4099))
