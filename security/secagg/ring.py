"""Masked codes on the wire at ``bits`` per element (8, 9, 10, 12 or 16), not 16.

Arithmetic is mod 2^16 in uint16 lanes and only the low ``bits`` travel: 2^bits divides 2^16,
so sums agree in the ring Z_{2^bits}. Layout of a span of n elements (``bits`` = 8 + h): the n
low bytes, then the high h bits, 8/h to a byte and strided: with m = ceil(n·h/8), byte k holds
the high bits of elements k, k+m, k+2m, ... (element k+s·m at bit s·h). A plain bit stream of
10-bit fields would be as small, but its shifts differ per element and do not vectorise; this
layout is contiguous passes only (``ring_pack``/``ring_add`` in compression/_kernels.c, about
memory speed; without the kernels numpy gives the same bytes, slower).
"""

from __future__ import annotations

import numpy as np

from geodiloco.security.secagg.secagg_errors import InvalidField

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

CODE_MAX = 127  # int8 codes of the shared-scale quantiser are in [-127, 127]
WIDTHS = (8, 9, 10, 12, 16)  # 8 + h with h dividing 8: the high bits pack whole into bytes


def ring_bits(sites: int) -> int:
    """The narrowest ring holding any sum of ``sites`` codes as a signed value: 127·n < 2^(bits-1)."""
    if sites < 1:
        raise InvalidField("sites", f"must be >= 1, got {sites}")
    need = (CODE_MAX * sites).bit_length() + 1
    for bits in WIDTHS:
        if bits >= need:
            return bits
    raise InvalidField("sites", f"{sites} sites need a {need}-bit ring; at most {WIDTHS[-1]} bits supported")


def packed_size(numel: int, bits: int) -> int:
    return (numel * bits + 7) // 8


def _check(bits: int) -> None:
    if bits not in WIDTHS:
        raise InvalidField("ring_bits", f"must be one of {WIDTHS}, got {bits}")


def _high(numel: int, bits: int) -> tuple[int, int, int]:
    """(h, elements per high byte, high bytes m) of a span."""
    h = bits - 8
    return h, (8 // h if h else 0), (numel * h + 7) // 8


def pack(mask: np.ndarray, codes: np.ndarray, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """The wire bytes (uint8) of (mask + codes) mod 2^bits: ``mask`` uint16, ``codes`` int8, same
    length; written to the front of ``out`` (a reused uint8 buffer) where given."""
    _check(bits)
    if mask.dtype != np.uint16 or codes.dtype != np.int8 or mask.shape != codes.shape:
        raise InvalidField("codes", "pack takes a uint16 mask and int8 codes of one length")
    size = packed_size(codes.size, bits)
    out = np.empty(size, dtype=np.uint8) if out is None or out.size < size else out[:size]
    if _kernels is not None:
        _kernels.ring_pack(np.ascontiguousarray(mask), np.ascontiguousarray(codes), bits, out)
        return out
    values = mask + codes.astype(np.int16).view(np.uint16)
    h, per, m = _high(codes.size, bits)
    out[: codes.size] = values.astype(np.uint8)
    high = out[codes.size :]
    high[:] = 0
    for s in range(per):
        part = values[s * m : (s + 1) * m]
        high[: part.size] |= (((part >> 8) & ((1 << h) - 1)) << (s * h)).astype(np.uint8)
    return out


def add_packed(acc: np.ndarray, packed: bytes | memoryview, bits: int) -> None:
    """``acc`` (uint16) += the fields of ``packed`` (wire bytes of ``acc.size`` elements), mod 2^16."""
    _check(bits)
    if acc.dtype != np.uint16 or len(packed) != packed_size(acc.size, bits):
        raise InvalidField("payload", f"{len(packed)} bytes, expected {packed_size(acc.size, bits)}")
    if _kernels is not None:
        _kernels.ring_add(packed, bits, acc)
        return
    raw = np.frombuffer(packed, dtype=np.uint8)
    acc += raw[: acc.size]
    h, per, m = _high(acc.size, bits)
    high = raw[acc.size :].astype(np.uint16)
    for s in range(per):
        part = acc[s * m : (s + 1) * m]
        part += ((high[: part.size] >> (s * h)) & ((1 << h) - 1)) << 8


def to_signed(acc: np.ndarray, bits: int) -> np.ndarray:
    """The ring elements of ``acc`` (uint16, mod 2^bits) as int16 in [-2^(bits-1), 2^(bits-1)),
    in place: shifted to the top of the lane, then back with the sign. Returns a view of ``acc``."""
    _check(bits)
    shift = 16 - bits
    np.left_shift(acc, shift, out=acc)
    signed = acc.view(np.int16)
    np.right_shift(signed, shift, out=signed)
    return signed
