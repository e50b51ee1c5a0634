import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import indices
from geodiloco.compression.codec_error import CodecError


@settings(max_examples=80, deadline=None)
@given(universe=st.integers(1, 200_000), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_elias_fano_roundtrip_and_size(universe: int, fraction: float, seed: int) -> None:
    count = int(universe * fraction)
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(universe, generator=gen)[:count].sort().values
    raw = indices.encode(idx, universe)
    assert raw.numel() == indices.encoded_size(universe, count)
    assert torch.equal(indices.decode(raw, universe, count), idx)
    if count:  # about 2 + log2(n/k) bits per index
        assert (
            8 * raw.numel() <= count * (3 + max(0.0, torch.log2(torch.tensor(universe / count)).item())) + 16
        )


def test_corrupted_index_sets_are_refused() -> None:
    idx = torch.tensor([3, 10, 11, 500, 999])
    raw = indices.encode(idx, 1000)
    with pytest.raises(CodecError, match="bytes, expected"):
        indices.decode(raw[:-1], 1000, 5)
    flipped = raw.clone()
    flipped[-1] ^= 0x01  # one set bit too many or too few in the high part
    with pytest.raises(CodecError, match="entries in the high part"):
        indices.decode(flipped, 1000, 5)
