"""GPU code paths exercised on whatever devices torch has here: the CPU, the ``meta`` device
(placement logic: every tensor the outer sync makes follows the model's device), and CUDA when
present (``gpu``-marked, skipped without it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from geodiloco.compression import ErrorFeedback, Place, parse_pipeline
from geodiloco.distributed import DeviceError, backend_for, resolve_device
from geodiloco.params import Checksum, _mix, _mix_on_device, flatten_parameters, state_hash
from geodiloco.site.parallel.layout import Autocast, LayoutError, ParallelConfig, precision_problem
from geodiloco.site.shards import ShardMap
from geodiloco.workload import GPTConfig, build_model
from helpers import CUDA

MODEL = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)


def _values(n: int = 20_000) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e3
    x[:4] = torch.tensor([0.0, -0.0, float("inf"), 1e-42])  # signed zero, inf, a subnormal
    return x


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_hash_is_bit_identical_on_every_device(device: str) -> None:
    x = _values()
    on_device = Checksum()
    on_device.add_range(5, x.to(device))
    on_host = Checksum()
    on_host.add_range(5, x)
    assert on_device.hexdigest() == on_host.hexdigest()
    flipped = x.clone()
    flipped.view(torch.int32)[1234] ^= 1  # one bit anywhere changes the digest
    assert state_hash(flipped.to(device)) != state_hash(x)


def test_the_device_hash_path_gives_the_cpu_paths_bits() -> None:
    """The accelerator path (torch int64 ops) run on the CPU: the same sums as numpy's uint64."""
    x = _values()
    for start in (0, 7, (1 << 40) + 3):  # positions far beyond 2^32 wrap the same way
        positions = torch.arange(start, start + x.numel(), dtype=torch.int64)
        assert _mix_on_device(positions.clone(), x) == _mix(positions.numpy().astype(np.uint64), x)


@pytest.mark.parametrize("device", ["cpu", "meta", CUDA])
def test_outer_sync_tensors_follow_the_model_device(device: str) -> None:
    model = build_model(MODEL, seed=0).to(device)
    shards = ShardMap(model, 0, 1)
    assert shards.device.type == device
    snapshot = shards.clone_locals()
    delta = shards.gather_owned(snapshot)
    feedback = ErrorFeedback(shards.owned_numel)
    sent = feedback.compensate(delta)  # the residual moves to the values' device once
    feedback.record(sent, torch.zeros_like(sent))
    assert {t.device.type for t in (*snapshot, delta, sent, feedback.residual)} == {device}
    update = torch.ones(shards.num_params)  # decoded on the host, applied on the device
    assert shards.scatter_range(0, update, snapshot, add=True) == shards.num_params
    assert all(t.device.type == device for t in snapshot)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_codecs_take_device_values_and_give_the_same_bytes(device: str) -> None:
    x = _values(5000)
    x[:4] = 0.5
    for spec in ("q8|zstd:1", "cyclic:0.4|q2|zstd:1", "topk:0.1|q4"):
        codec = parse_pipeline(spec)
        place = Place.span(7, 100, x.numel())
        data, back = codec.roundtrip(x.to(device), place)
        assert data == codec.encode(x, place) and back.device.type == device  # decoded where Δ is


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_model_moved_to_a_device_flattens_to_the_same_hash(device: str) -> None:
    model = build_model(MODEL, seed=0)
    assert state_hash(flatten_parameters(model.to(device))) == state_hash(flatten_parameters(model.cpu()))


def test_cpu_device_never_asks_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched(*_: Any) -> None:
        raise AssertionError("CUDA was asked")

    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "device_count", touched)
    assert resolve_device("cpu", 3) == torch.device("cpu")
    assert backend_for(torch.device("cpu")) == "gloo"
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert precision_problem("bf16", torch.device("cpu")) is None


def test_devices_that_cannot_be_used_are_refused_clearly() -> None:
    with pytest.raises(DeviceError, match="not one of auto, cpu, cuda"):
        resolve_device("tpu", 0)
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="no CUDA device"):
            resolve_device("cuda", 0)
        assert resolve_device("auto", 0) == torch.device("cpu")
    else:
        with pytest.raises(DeviceError, match="has no GPU of its own"):
            resolve_device("cuda", torch.cuda.device_count())


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fp8_is_refused_off_cuda_with_a_clear_message(device: str) -> None:
    problem = precision_problem("fp8", torch.device(device))
    assert (
        problem == f"mixed-precision: fp8 needs a CUDA GPU of compute capability 8.9 or newer, not {device}"
    )
    with pytest.raises(LayoutError, match="fp8 is not supported with tensor parallel"):
        ParallelConfig.parse("tp", 2, "fp8")
    with pytest.raises(LayoutError, match="not one of fp32, bf16, fp8"):
        ParallelConfig.parse("ddp", 2, "fp16")


def test_bf16_autocast_computes_in_bf16_and_keeps_fp32_parameters() -> None:
    model = build_model(MODEL, seed=0)
    trained = Autocast(model, "cpu")
    seen: list[torch.dtype] = []
    model.blocks[0].fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    x = torch.randint(0, 256, (2, MODEL.seq_len))
    loss = trained(x, x)
    loss.backward()
    assert seen == [torch.bfloat16] and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(
        p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        for p in model.parameters()
    )
    assert next(n for n, _ in trained.named_parameters()).startswith("module.")


def test_fp8_swaps_linears_without_changing_the_canonical_parameters() -> None:
    pytest.importorskip("torchao", reason="fp8 is the optional extra geodiloco[fp8]")
    from geodiloco.site.parallel.layout import apply_float8

    model = build_model(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=8), seed=0)
    before = [(n, p.shape) for n, p in model.named_parameters()], state_hash(flatten_parameters(model))
    assert apply_float8(model) == 4  # qkv, proj, fc and out: every dim a multiple of 16
    assert type(model.blocks[0].fc).__name__ == "Float8Linear"
    after = [(n, p.shape) for n, p in model.named_parameters()], state_hash(flatten_parameters(model))
    assert after == before  # the wire's canonical vector is the same: fp8 sites join any run
    assert ShardMap(model, 0, 1).num_params == sum(p.numel() for p in model.parameters())
