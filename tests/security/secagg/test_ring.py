"""Ring packing: sums of packed pushes equal sums of the values mod 2^bits, the C kernel and the
numpy path give the same bytes, and a wrong size or width is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from geodiloco.security.secagg import ring
from geodiloco.security.secagg.secagg_errors import InvalidField


def test_ring_bits_hold_the_sum_of_the_sites_codes() -> None:
    assert [ring.ring_bits(n) for n in (1, 2, 3, 4, 5, 8, 16, 258)] == [8, 9, 10, 10, 11, 11, 12, 16]
    for n in (1, 2, 4, 8, 16, 100):
        assert 127 * n < 1 << (ring.ring_bits(n) - 1)
    with pytest.raises(InvalidField, match="sites"):
        ring.ring_bits(259)


@pytest.mark.parametrize("bits", ring.WIDTHS)
@pytest.mark.parametrize("numel", [1, 7, 8, 9, 1000, 4099])
def test_packed_values_add_up_mod_the_ring(bits: int, numel: int) -> None:
    rng = np.random.default_rng(bits * numel)
    acc = np.zeros(numel, dtype=np.uint16)
    expected = np.zeros(numel, dtype=np.int64)
    for _ in range(3):
        mask = rng.integers(0, 1 << 16, numel, dtype=np.uint16)
        codes = rng.integers(-127, 128, numel, dtype=np.int8)
        packed = ring.pack(mask, codes, bits)
        assert packed.size == ring.packed_size(numel, bits)
        assert 0 <= packed.size - (numel * bits + 7) // 8 <= bin(bits - 8).count("1")  # a byte per plane
        ring.add_packed(acc, packed.tobytes(), bits)
        expected += mask.astype(np.int64) + codes
    assert np.array_equal(acc & ((1 << bits) - 1), expected % (1 << bits))


@pytest.mark.skipif(ring._kernels is None, reason="the C kernels were not built")
@pytest.mark.parametrize("bits", ring.WIDTHS)
def test_kernel_and_numpy_give_the_same_bytes(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(bits)
    mask = rng.integers(0, 1 << 16, 1237, dtype=np.uint16)
    codes = rng.integers(-127, 128, 1237, dtype=np.int8)
    fast = ring.pack(mask, codes, bits).tobytes()
    acc_fast = np.arange(1237, dtype=np.uint16)
    ring.add_packed(acc_fast, fast, bits)
    monkeypatch.setattr(ring, "_kernels", None)
    assert ring.pack(mask, codes, bits).tobytes() == fast
    acc_slow = np.arange(1237, dtype=np.uint16)
    ring.add_packed(acc_slow, fast, bits)
    assert np.array_equal(acc_fast, acc_slow)


def test_signed_values_and_refusals() -> None:
    acc = np.array([0, 1, 511, 512, 1023, 1024 + 5], dtype=np.uint16)
    signed, largest = ring.to_signed(acc.copy(), 10)
    assert signed.tolist() == [0, 1, 511, -512, -1, 5] and largest == 512
    kernels, ring._kernels = ring._kernels, None
    try:
        assert ring.to_signed(acc.copy(), 10)[0].tolist() == signed.tolist()
        assert ring.to_signed(acc.copy(), 10)[1] == 512
    finally:
        ring._kernels = kernels
    with pytest.raises(InvalidField, match="ring_bits"):
        ring.pack(np.zeros(4, np.uint16), np.zeros(4, np.int8), 17)
    with pytest.raises(InvalidField, match="payload"):
        ring.add_packed(np.zeros(8, np.uint16), bytes(9), 10)


@pytest.mark.parametrize("bits", [8, 10, 11, 16])
def test_adding_several_pushes_at_once_equals_adding_each(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(bits)
    numel = 70_000 + bits  # several tiles of 8192 in every plane, uneven strides
    payloads = [
        ring.pack(
            rng.integers(0, 1 << 16, numel, dtype=np.uint16),
            rng.integers(-127, 128, numel, dtype=np.int8),
            bits,
        ).tobytes()
        for _ in range(3)
    ]
    one_by_one = np.arange(numel, dtype=np.uint16)
    for p in payloads:
        ring.add_packed(one_by_one, p, bits)
    together = np.arange(numel, dtype=np.uint16)
    ring.add_all(together, payloads, bits)
    assert np.array_equal(together, one_by_one)
    assigned = np.full(numel, 12345, dtype=np.uint16)  # not read
    ring.add_all(assigned, payloads, bits, assign=True)
    assert np.array_equal(assigned, one_by_one - np.arange(numel, dtype=np.uint16))
    with pytest.raises(InvalidField, match="payload"):
        ring.add_all(together, [*payloads, payloads[0][:-1]], bits)
    monkeypatch.setattr(ring, "_kernels", None)
    fallback = np.arange(numel, dtype=np.uint16)
    ring.add_all(fallback, payloads, bits)
    assert np.array_equal(fallback, one_by_one)
    ring.add_all(fallback, payloads, bits, assign=True)
    assert np.array_equal(fallback, assigned)
