import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression.bits import pack_bits, packed_size, unpack_bits


@settings(max_examples=60, deadline=None)
@given(width=st.integers(1, 32), count=st.integers(0, 3000), seed=st.integers(0, 1000))
def test_pack_unpack_is_identity(width: int, count: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << width, (count,), generator=gen, dtype=torch.int64)
    packed = pack_bits(codes, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(count, width)
    assert torch.equal(unpack_bits(packed, width, count).to(torch.int64), codes)


def test_two_bit_packing_is_little_endian() -> None:
    packed = pack_bits(torch.tensor([1, 2, 3, 0, 1], dtype=torch.uint8), 2)
    assert packed.tolist() == [0b00111001, 0b00000001]


def test_unpack_refuses_a_wrong_length() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 7)
