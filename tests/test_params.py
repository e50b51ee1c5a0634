import pytest
import torch
from torch import nn

from geodiloco import params
from geodiloco.compression import Place, parse_pipeline
from geodiloco.params import Checksum, canonical_name, canonical_parameters
from helpers import DEVICES


def test_wrapper_prefixes_are_removed() -> None:
    assert canonical_name("module.blocks.0.fc.weight") == "blocks.0.fc.weight"
    assert canonical_name("_orig_mod.module.tok.weight") == "tok.weight"


def test_canonical_order_is_sorted_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    names = [n for n, _ in canonical_parameters(model)]
    assert names == sorted(names)


@pytest.mark.parametrize("start", [12_345, 2**40 - 3])
def test_the_checksum_kernel_gives_the_numpy_paths_sums(monkeypatch: pytest.MonkeyPatch, start: int) -> None:
    """The C kernel and the numpy reference agree bit for bit (NaN, Inf, -0.0, odd starts, and
    positions of a trillion-parameter model: the kernel advances index x GOLDEN by addition)."""
    assert params._kernels is not None
    x = torch.randn(200_003)
    x[5], x[7], x[9] = float("nan"), float("-inf"), -0.0
    fast = Checksum()
    fast.add_range(start, x)
    monkeypatch.setattr(params, "_kernels", None)
    slow = Checksum()
    slow.add_range(start, x)
    assert (fast.low, fast.high, fast.count) == (slow.low, slow.high, slow.count)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "row_len", "stride"), [(1, 7, 7), (37, 11, 20), (300, 257, 1000)])
def test_hashing_rows_a_stride_apart_equals_hashing_their_positions(
    rows: int, row_len: int, stride: int, device: str
) -> None:
    """A shard of a matrix's columns hashed in one kernel call: the sums of its elements' canonical
    positions, as every rank's digest must add them."""
    values = torch.randn(rows, row_len, device=device)
    values[0, 0] = float("nan")
    by_rows, by_positions = Checksum(), Checksum()
    by_rows.add_rows(4_321, stride, values)
    first = torch.arange(rows, dtype=torch.int64) * stride + 4_321
    by_positions.add((first[:, None] + torch.arange(row_len, dtype=torch.int64)).to(device), values)
    assert (by_rows.low, by_rows.high, by_rows.count) == (by_positions.low, by_positions.high, rows * row_len)
    with pytest.raises(ValueError, match="whole rows"):
        params._kernels.checksum_rows(torch.zeros(10).numpy(), 3, 0, 3)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_and_hash_kernel_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, with_residual: bool
) -> None:
    """θ += change (residual -= change) with the new θ's checksum and Σθ²: one C pass on the
    host, the same θ, residual and checksum as the torch ops and Checksum.add_range."""
    assert params._kernels is not None
    theta, change, residual = torch.randn(100_003), torch.randn(100_003) * 1e-3, torch.randn(100_003)

    def run() -> tuple[torch.Tensor, torch.Tensor, Checksum, float]:
        t, r = theta.clone(), residual.clone()
        checksum, sumsq = params.add_and_hash(t, change, 777, residual=r if with_residual else None)
        return t, r, checksum, sumsq

    fast = run()
    monkeypatch.setattr(params, "_kernels", None)
    slow = run()
    assert torch.equal(fast[0], theta + change) and torch.equal(fast[0], slow[0])
    assert torch.equal(fast[1], residual - change if with_residual else residual)
    assert torch.equal(fast[1], slow[1])
    reference = Checksum()
    reference.add_range(777, theta + change)
    for checksum in (fast[2], slow[2]):
        assert (checksum.low, checksum.high, checksum.count) == (
            reference.low,
            reference.high,
            reference.count,
        )
    exact = float((theta + change).double().square().sum())
    assert fast[3] == pytest.approx(exact, rel=1e-12) and slow[3] == pytest.approx(exact, rel=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["q8:64|zstd:1", "fp32", "q4", "topk:0.1|q8"])
def test_adding_encoded_values_equals_decoding_then_adding(spec: str, device: str) -> None:
    """add_encoded_and_hash, fused (q8 on the host) or decoding first (other codecs, θ on an
    accelerator), leaves the θ, residual and checksum of decoding and add_and_hash, also where
    fp32 codes share the residual's memory."""
    codec = parse_pipeline(spec)
    n = 5_000
    theta, residual = torch.randn(n, device=device), torch.randn(n, device=device) * 1e-2
    place = Place.span(3, 200, n)
    t, r = theta.clone(), residual.clone()
    payload, raw = codec.roundtrip_raw(r, place)
    decoded = codec.decode(payload, n, place).to(device)
    checksum, sumsq = params.add_encoded_and_hash(codec, raw, place, t, residual=r)
    assert torch.equal(t, theta + decoded) and torch.equal(r, residual - decoded)
    reference = Checksum()
    reference.add_range(200, (theta + decoded).cpu())
    assert (checksum.low, checksum.high, checksum.count) == (reference.low, reference.high, reference.count)
    assert sumsq == pytest.approx(float((theta + decoded).double().pow(2).sum()), rel=1e-9)
